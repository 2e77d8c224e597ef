"""In-graph sampling: the counter-based uniform is exact (Python-integer
reference), the filtering is the CPU executor's (gpu_backend/sampling.py), the
draws follow the filtered distribution, and a seed reproduces its tokens."""
from __future__ import annotations

import numpy as np
import torch

from gpu_backend.graphs import sampler
from gpu_backend.sampling import filter_logits


def test_uniform_matches_the_integer_reference():
    rng = np.random.default_rng(0)
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 0xDEADBEEF, 1 << 40] + rng.integers(-2**63, 2**63 - 1, 200).tolist()
    idx = [0, 1, 2**31, 2**32 - 1] + rng.integers(0, 1 << 20, 203).tolist()
    got = sampler.uniform(torch.tensor(seeds, dtype=torch.int64), torch.tensor(idx, dtype=torch.int64))
    want = [sampler.uniform_reference(s, i) for s, i in zip(seeds, idx)]
    assert got.tolist() == want
    assert 0.0 <= float(got.min()) and float(got.max()) < 1.0


def test_uniform_is_well_spread():
    u = sampler.uniform(torch.full((20000,), 12345, dtype=torch.int64), torch.arange(20000)).numpy()
    hist = np.histogram(u, bins=10, range=(0, 1))[0]
    assert hist.min() > 1700 and hist.max() < 2300            # ~2000 each
    v = sampler.uniform(torch.arange(20000, dtype=torch.int64), torch.zeros(20000, dtype=torch.int64)).numpy()
    assert abs(float(np.corrcoef(u, v)[0, 1])) < 0.05


def _rows(n, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * 3


def test_filtering_matches_the_cpu_sampler():
    logits = _rows(40, v=64)
    rng = np.random.default_rng(1)
    temp = torch.tensor(rng.choice([0.3, 0.7, 1.0, 1.7], 40), dtype=torch.float32)
    top_p = torch.tensor(rng.choice([0.05, 0.5, 0.9, 1.0], 40), dtype=torch.float32)
    top_k = torch.tensor(rng.choice([0, 1, 3, 20, 64, 100], 40), dtype=torch.int64)
    probs, order = sampler.filtered_sorted(logits, temp, top_p, top_k)
    for i in range(40):
        want = filter_logits(logits[i], float(temp[i]), int(top_k[i]), float(top_p[i]))
        got = torch.zeros(64).scatter(0, order[i], probs[i])
        assert torch.allclose(got, want, atol=1e-6), i


def test_greedy_and_degenerate_rows_take_the_argmax():
    logits = _rows(6)
    z = torch.zeros(6, dtype=torch.int64)
    temp = torch.tensor([0.0, 1e-6, 1.0, 1.0, 1.0, 1.0])
    top_k = torch.tensor([0, 0, 1, 0, 0, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 1e-9, 1.0, 1.0])
    logits[5] = float("nan")
    out = sampler.sample(logits, temp, top_p, top_k, torch.arange(6), z)
    am = logits.argmax(-1)
    assert out[:4].tolist() == am[:4].tolist()           # greedy, top-k 1, top-p tiny
    assert out[5] == am[5]


def test_draws_follow_the_filtered_distribution():
    v = 8
    logits = torch.log(torch.tensor([0.4, 0.3, 0.1, 0.1, 0.05, 0.03, 0.01, 0.01]))[None].repeat(4000, 1)
    n = logits.shape[0]
    ones = torch.ones(n)
    out = sampler.sample(logits, ones, ones, torch.zeros(n, dtype=torch.int64),
                         torch.arange(n, dtype=torch.int64) * 7919, torch.zeros(n, dtype=torch.int64))
    freq = np.bincount(out.numpy(), minlength=v) / n
    assert np.allclose(freq, [0.4, 0.3, 0.1, 0.1, 0.05, 0.03, 0.01, 0.01], atol=0.03)
    # top_k 2 renormalises over the two best
    out = sampler.sample(logits, ones, ones, torch.full((n,), 2), torch.arange(n) * 31, torch.zeros(n, dtype=torch.int64))
    freq = np.bincount(out.numpy(), minlength=v) / n
    assert freq[2:].sum() == 0 and abs(freq[0] - 0.4 / 0.7) < 0.04


def test_same_seed_same_tokens_whatever_the_batch():
    logits = _rows(1, v=200, seed=9)
    one = torch.ones(1)
    draws = [int(sampler.sample(logits, one, one, torch.zeros(1, dtype=torch.int64), torch.tensor([42]),
                                torch.tensor([i]))[0]) for i in range(30)]
    again = [int(sampler.sample(logits, one, one, torch.zeros(1, dtype=torch.int64), torch.tensor([42]),
                                torch.tensor([i]))[0]) for i in range(30)]
    assert draws == again and len(set(draws)) > 5
    # the same row inside a batch of others draws the same token
    batch = torch.cat([_rows(5, v=200, seed=1), logits, _rows(3, v=200, seed=2)])
    n = batch.shape[0]
    seeds = torch.tensor([1, 2, 3, 4, 5, 42, 6, 7, 8])
    for i in range(30):
        out = sampler.sample(batch, torch.ones(n), torch.ones(n), torch.zeros(n, dtype=torch.int64), seeds,
                             torch.full((n,), i))
        assert int(out[5]) == draws[i]
