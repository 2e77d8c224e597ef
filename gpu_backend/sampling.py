"""Sampling: logits of the sequences that emit a token this step -> token ids (+ logprob records).

    raw logits [N, vocab] float32 + each sequence's SamplingParams and generator
      -> logits_processors.apply (structured-output automaton, allowed ids, bad words, min_tokens,
         logit_bias, penalties)
      -> greedy rows: argmax of the processed logits
      -> other rows, batched: / temperature -> min_p -> top-k -> top-p (nucleus) -> softmax
         -> one inverse-CDF draw per row with a uniform from the sequence's own torch.Generator
      -> constrained rows: their automaton steps over the drawn token (logits_processors.advance)
      -> rows that ask for logprobs: logprobs.records of the *raw* logits for the sampled
         token (vLLM's default raw_logprobs), left in seq.step_logprobs for the engine

Each sequence owns its generator (seeded from its seed, or from fresh entropy
without one), so a seeded request yields the same tokens whatever else shares
its batch, and recompute after a preemption never replays a draw.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from . import logits_processors, logprobs
from .scheduler.sequence import Sequence


def generator_for(seq: Sequence) -> torch.Generator:
    """The sequence's generator, made on first use."""
    if seq.generator is None:
        seed = seq.params.seed if seq.params.seed is not None else int.from_bytes(os.urandom(8), "little")
        g = torch.Generator()
        g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        seq.generator = g
    return seq.generator


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                  min_p: float = 0.0) -> torch.Tensor:
    """One row [vocab] -> probabilities [vocab] after temperature, min_p, top-k and top-p
    (the CUDA sampler's reference; `filter_batch` is the same over rows)."""
    t = torch.tensor
    return filter_batch(logits[None], t([temperature]), t([top_k]), t([top_p]), t([min_p]))[0]


def filter_batch(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """logits [R, vocab]; temperature, top_p, min_p [R] float; top_k [R] int (0 = off)
    -> probabilities [R, vocab]."""
    x = logits / temperature.to(logits.dtype)[:, None]
    vocab = x.shape[-1]
    if bool((min_p > 0).any()):
        probs = torch.softmax(x, dim=-1)
        floor = min_p.to(x.dtype)[:, None] * probs.amax(dim=-1, keepdim=True)
        x = x.masked_fill(probs < floor, float("-inf"))
    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1.0
    if bool(k_on.any()) or bool(p_on.any()):
        sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)        # [R, vocab]: ties by id
        if bool(k_on.any()):
            kth = sorted_x.gather(1, (top_k.clamp(1, vocab) - 1).long()[:, None])    # [R, 1]
            kth = torch.where(k_on[:, None], kth, torch.full_like(kth, float("-inf")))
            sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        if bool(p_on.any()):
            probs = torch.softmax(sorted_x, dim=-1)
            # drop a token when the tokens before it already reach top_p (the first always stays)
            limit = torch.where(p_on, top_p.to(x.dtype), torch.tensor(float("inf")))[:, None]
            sorted_x = sorted_x.masked_fill((torch.cumsum(probs, dim=-1) - probs) >= limit, float("-inf"))
        x = torch.empty_like(x).scatter_(1, order, sorted_x)
    return torch.softmax(x, dim=-1)


# Below this temperature sampling is argmax in all but name, and logits / T
# would overflow float32 into inf/NaN probabilities.
MIN_TEMPERATURE = 1e-5


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits: [N, vocab] float32, row i for seqs[i] -> N token ids (-1 for a row holding a NaN);
    seqs[i].step_logprobs set for the sequences that ask for logprobs (None for the others)."""
    raw = logits.float()
    x = logits_processors.apply(raw, seqs)
    picks = argmax_rows(x)               # [N]
    out = picks.tolist()                 # host sync: tokens go to the ring
    rows = [i for i, s in enumerate(seqs) if s.params.temperature >= MIN_TEMPERATURE]
    if rows:
        ps = [seqs[i].params for i in rows]
        probs = filter_batch(x[torch.tensor(rows)], torch.tensor([p.temperature for p in ps]),
                             torch.tensor([p.top_k for p in ps]), torch.tensor([p.top_p for p in ps]),
                             torch.tensor([p.min_p for p in ps]))                          # [R, vocab]
        finite = torch.isfinite(probs).all(dim=-1).tolist()
        cdf = torch.cumsum(probs, dim=-1)                                                   # [R, vocab]
        for j, i in enumerate(rows):
            if finite[j]:                 # a degenerate row keeps argmax rather than fail the batch
                out[i] = draw(cdf[j], generator_for(seqs[i]))
    if x is not raw:
        logits_processors.advance(seqs, out)
    _logprobs(raw, seqs, out)
    for i in nan_rows(raw, picks if x is raw else None):
        out[i] = -1                      # NaN logits: no token; the engine ends this request alone
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, vocab] -> each row's argmax, int64 [N]: a row's first maximum, and its first NaN where it
    holds one (nan_rows relies on that), as torch.argmax. For float32 on the CPU numpy's, whose SIMD
    loop takes ~3 us over SmolLM2's 49152 logits where torch's reduction takes ~45 us (~1% of a
    1-row decode step)."""
    a = _numpy_rows(x)
    return x.argmax(dim=-1) if a is None else torch.from_numpy(a.argmax(axis=-1))


def _numpy_rows(x: torch.Tensor) -> np.ndarray | None:
    """x [N, vocab] as numpy (no copy) where numpy's loops serve: float32 on the CPU, no autograd."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and not x.requires_grad:
        return x.numpy()
    return None


def nan_rows(raw: torch.Tensor, picks: torch.Tensor | None = None) -> list[int]:
    """Rows of raw [N, vocab] holding a NaN. argmax propagates NaN (a row's first NaN is its argmax),
    so with that row's argmax of raw itself (`picks`) one value a row tells it, not a pass over the
    vocabulary (~40 us of a 1-row step at SmolLM2's 49152); without picks, the full check. Float32
    rows on the CPU take numpy's gather (~3 us where torch's five small operators took ~35)."""
    if picks is None:
        return torch.isnan(raw).any(dim=-1).nonzero().flatten().tolist()
    a = _numpy_rows(raw)
    if a is not None:
        return np.flatnonzero(np.isnan(a[np.arange(a.shape[0]), picks.numpy()])).tolist()
    at = raw.gather(1, picks[:, None]).flatten()
    return torch.isnan(at).nonzero().flatten().tolist()


def draw(cdf: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a row's cumulative probabilities [vocab] by inverse CDF with one uniform
    from the sequence's generator: the first id whose cumulative sum exceeds u * total (a
    zero-probability id never is). As the CUDA sampler draws (graphs/sampler.draw); it
    replaced torch.multinomial, whose exponential race draws one exponential per vocabulary
    entry (~1 ms of a 1-row step's single-threaded time at SmolLM2's 49152)."""
    u = torch.rand((1,), generator=generator, dtype=cdf.dtype) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1))


def _logprobs(raw: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> None:
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    for s in seqs:
        s.step_logprobs = None
    if not rows:
        return
    k = max(seqs[i].params.logprobs for i in rows)
    idx = torch.tensor(rows)
    recs = logprobs.records(raw[idx], torch.tensor([tokens[i] for i in rows]), k)       # [R, 2 + 2k]
    for j, i in enumerate(rows):
        ki = seqs[i].params.logprobs
        r = recs[j]
        seqs[i].step_logprobs = (r if ki == k else
                                 r[list(range(2 + ki)) + list(range(2 + k, 2 + k + ki))])[None]
