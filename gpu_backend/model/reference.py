"""greedy_generate: the plain unbatched decode loop, the correctness reference.

prompt ids -> one prefill forward over DenseCausalAttention -> argmax -> one
forward per new token until max_new_tokens, an eos id, or the context is full.
Executors are diffed against it and benchmarks use it as the baseline.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from .attention import DenseCausalAttention
from .llama import LlamaModel


@torch.inference_mode()
def greedy_generate(model: LlamaModel, prompt_ids: list[int], max_new_tokens: int,
                    eos_ids: Iterable[int] = ()) -> list[int]:
    """New token ids only; an eos id that ends generation is included as the last one."""
    config = model.config
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if any(not 0 <= t < config.vocab_size for t in prompt_ids):
        raise ValueError(f"prompt token ids must lie in [0, {config.vocab_size})")
    if len(prompt_ids) >= config.max_position_embeddings:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context "
                         f"({config.max_position_embeddings})")
    eos = frozenset(eos_ids)
    device = model.device
    attn = DenseCausalAttention(config)
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)          # [T]
    positions = torch.arange(len(prompt_ids), device=device)                 # [T]
    out: list[int] = []
    while len(out) < max_new_tokens and len(prompt_ids) + len(out) < config.max_position_embeddings:
        hidden = model(ids, positions, attn)                                 # [T, hidden]
        token = int(model.compute_logits(hidden[-1:]).argmax(-1))            # host sync: the loop needs it
        out.append(token)
        if token in eos:
            break
        ids = torch.tensor([token], dtype=torch.long, device=device)         # [1]
        positions = positions[-1:] + 1                                        # [1]
    return out
