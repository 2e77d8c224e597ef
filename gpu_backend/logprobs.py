"""Logprob records: raw float32 logits -> the words the ring's logprob arena carries.

    logits [N, vocab] float32 (the model's, before any processor or temperature: vLLM's
    default logprobs_mode "raw_logprobs") + the token each row scored + top count k
      -> log_softmax -> the token's logprob, its rank (1 = most likely), the k most likely
         ids and their logprobs
      -> [N, 2 + 2k] int32 words (float32 values as their bits), shared_layout's record
         layout (layout.logprob_record_words)

Used twice: for the token sampled this step (sampling.py, one row per sequence that asks)
and for prompt tokens during prefill (row p scores prompt token p + 1; cpu.py), in slices
of PROMPT_ROWS rows so a long prompt never holds [T, vocab] logits at once.
"""
from __future__ import annotations

import numpy as np
import torch

PROMPT_ROWS = 128   # prompt positions whose logits are materialised at once


def records(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> np.ndarray:
    """logits [N, vocab], token_ids [N] long -> [N, 2 + 2k] int32 record words."""
    lp = torch.log_softmax(logits.float(), dim=-1)                     # [N, vocab]
    chosen = lp.gather(1, token_ids[:, None])                          # [N, 1]
    rank = (lp > chosen).sum(dim=-1, keepdim=True) + 1               # [N, 1]
    n = logits.shape[0]
    out = np.empty((n, 2 + 2 * k), "<i4")
    out[:, 0] = chosen[:, 0].numpy().view("<i4")
    out[:, 1] = rank[:, 0].numpy()
    if k:
        top = torch.topk(lp, k, dim=-1)                                # sorted, most likely first
        out[:, 2:2 + k] = top.indices.numpy()
        out[:, 2 + k:] = top.values.numpy().view("<i4")
    return out

