"""Sampling: logits of the sequences that emit a token this step -> token ids.

    logits [N, vocab] float32 + each sequence's SamplingParams and generator
      -> greedy rows: argmax
      -> other rows: / temperature -> top-k -> top-p (nucleus) -> softmax
         -> multinomial with the sequence's own torch.Generator

Each sequence owns its generator (seeded from its seed, or from fresh entropy
without one), so a seeded request yields the same tokens whatever else shares
its batch, and recompute after a preemption never replays a draw.
"""
from __future__ import annotations

import os

import torch

from .sequence import Sequence


def generator_for(seq: Sequence) -> torch.Generator:
    """The sequence's generator, made on first use."""
    if seq.generator is None:
        seed = seq.params.seed if seq.params.seed is not None else int.from_bytes(os.urandom(8), "little")
        g = torch.Generator()
        g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        seq.generator = g
    return seq.generator


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """One row [vocab] -> probabilities [vocab] after temperature, top-k and top-p."""
    x = logits / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # drop a token when the tokens before it already reach top_p (the first always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
    return torch.softmax(x, dim=-1)


# Below this temperature sampling is argmax in all but name, and logits / T
# would overflow float32 into inf/NaN probabilities.
MIN_TEMPERATURE = 1e-5


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits: [N, vocab] float32, row i for seqs[i] -> N token ids."""
    out = logits.argmax(dim=-1).tolist()      # host sync: tokens go to the ring
    for i, s in enumerate(seqs):
        p = s.params
        if p.temperature < MIN_TEMPERATURE:
            continue
        probs = filter_logits(logits[i].float(), p.temperature, p.top_k, p.top_p)
        if not bool(torch.isfinite(probs).all()):
            continue                          # degenerate row: keep argmax rather than fail the batch
        out[i] = int(torch.multinomial(probs, 1, generator=generator_for(s)))
    return out
