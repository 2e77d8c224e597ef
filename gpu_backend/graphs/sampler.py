"""In-graph sampling: logits of every row -> one token per row, with no host
sync and no data-dependent shape, so it is captured inside each step graph.

    logits [R, V] float32, per row: temperature, top_p, top_k, seed, token index
      -> greedy rows (temperature < MIN_TEMPERATURE): argmax
      -> others: / temperature -> sort (descending) -> top-k (ties with the k-th
         kept) -> top-p over the sorted probabilities (a token stays while the
         ones before it hold less than top_p; the first always stays) ->
         softmax -> inverse CDF at u = hash(seed, token index) -> token
      -> rows whose filtered distribution is not finite keep the argmax

The filtering is gpu_backend/sampling.filter_logits row for row (the CPU
executor's); the draw differs: a counter-based uniform (a murmur3-style hash of
the request's seed and the index of the token being drawn) instead of a
torch.Generator, so a request's draws depend on nothing else in its batch, a
recompute after preemption draws the same tokens, and the same seed gives the
same tokens on every run. The hash uses only int64 ops on values below 2^49,
so it is exact and identical on CPU and GPU.
"""
from __future__ import annotations

import torch

MIN_TEMPERATURE = 1e-5          # as gpu_backend/sampling.py: below this, argmax
_M32 = 0xFFFF_FFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), without int64 overflow: c split in 16-bit halves."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + ((x * hi) & 0xFFFF) * 65536) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser on 32-bit values held in int64."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EB_CA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2_AE35)
    return h ^ (h >> 16)


def uniform(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[R] int64 seeds (any 64 bits) and token indices -> [R] float32 in [0, 1) (24-bit resolution)."""
    lo = seed & _M32
    hi = (seed >> 32) & _M32                       # arithmetic shift, then the low 32 bits: the seed's high word
    h = _fmix32((index & _M32) ^ 0x9E37_79B9)
    h = _fmix32(lo ^ h)
    h = _fmix32(hi ^ _mul32(h, 0x27D4_EB2D))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def uniform_reference(seed: int, index: int) -> float:
    """The same hash in Python integers (the test's reference)."""
    def fmix(h):
        h ^= h >> 16
        h = (h * 0x85EB_CA6B) & _M32
        h ^= h >> 13
        h = (h * 0xC2B2_AE35) & _M32
        return h ^ (h >> 16)
    seed &= (1 << 64) - 1
    h = fmix((index & _M32) ^ 0x9E37_79B9)
    h = fmix((seed & _M32) ^ h)
    h = fmix((seed >> 32) ^ ((h * 0x27D4_EB2D) & _M32))
    return (h >> 8) / (1 << 24)


def filtered_sorted(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                    top_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] -> (probabilities in descending-logit order [R, V], that order [R, V])."""
    v = logits.shape[-1]
    t = torch.where(temperature < MIN_TEMPERATURE, torch.ones_like(temperature), temperature)   # [R]
    x = logits / t[:, None]                                                                     # [R, V]
    sorted_x, order = torch.sort(x, dim=-1, descending=True)                                    # [R, V] each
    k = torch.where((top_k > 0) & (top_k < v), top_k, torch.full_like(top_k, v))                # [R]
    kth = sorted_x.gather(1, (k - 1)[:, None])                                                  # [R, 1]
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p[:, None]                              # [R, V]
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.softmax(sorted_x, dim=-1), order


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """logits [R, V] float32; temperature, top_p [R] float32; top_k, seed, index [R] int64 -> tokens [R] int64."""
    greedy = logits.argmax(dim=-1)                                                              # [R]
    probs, order = filtered_sorted(logits, temperature, top_p, top_k)                           # [R, V]
    cdf = torch.cumsum(probs, dim=-1)                                                           # [R, V]
    u = uniform(seed, index) * cdf[:, -1]                                                       # [R]
    pick = torch.searchsorted(cdf, u[:, None], right=True).clamp_(max=logits.shape[-1] - 1)    # [R, 1]
    drawn = order.gather(1, pick)[:, 0]                                                         # [R]
    ok = torch.isfinite(probs).all(dim=-1) & (temperature >= MIN_TEMPERATURE)
    return torch.where(ok, drawn, greedy)
