"""The sampler's fused Triton kernels (graphs/triton_sampler.py) against the PyTorch sampler they
stand in for (graphs/sampler.py, itself diffed with the CPU daemon by test_sampler_twin.py), bit
for bit: the processed logits of a batch mixing every rule, the counter-based uniform over seeds
of all 64 bits, and whole sampling steps (tokens, logprob records (their values within rounding),
seat updates) over several steps. Under Triton's interpreter without a GPU; compiled, and marked `gpu`, with one."""
from __future__ import annotations

import os
import pathlib
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"      # before the kernels are decorated (their module's import)
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
pytest.importorskip("triton")

from gpu_backend.graphs import sampler  # noqa: E402
from gpu_backend.graphs import triton_sampler as ts  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_sampler_twin import V, _graph_side, _logits, _requests  # noqa: E402


def _on(p: sampler.RowParams, s: sampler.SeatState):
    """The staged parameters and seats on DEVICE (copies)."""
    p = sampler.RowParams(*(None if t is None else t.to(DEVICE, copy=True) for t in vars(p).values()))
    s2 = sampler.SeatState.__new__(sampler.SeatState)
    s2.__dict__.update({k: v.to(DEVICE, copy=True) if isinstance(v, torch.Tensor) else v for k, v in vars(s).items()})
    return p, s2


def _with_automaton(p: sampler.RowParams, rows: int) -> sampler.RowParams:
    gen = torch.Generator().manual_seed(9)
    on = torch.zeros(rows, dtype=torch.bool)
    on[[1, 4, 6]] = True
    allowed = torch.rand(rows, V, generator=gen) < 0.3
    return sampler.RowParams(**{**vars(p), "automaton_on": on, "automaton_allowed": allowed})


@pytest.mark.parametrize("automaton", [False, True])
def test_processed_logits_are_the_pytorch_samplers_bit_for_bit(automaton):
    seqs = _requests()
    p, s = _graph_side(seqs)
    if automaton:
        p = _with_automaton(p, len(seqs))
    p, s = _on(p, s)
    for step in range(4):
        raw = (_logits(len(seqs), 200 + step)).to(DEVICE)
        raw[0, 5] = 0.0                                   # a zero logit (x > 0 decides the penalty's side)
        want = sampler.process(raw, p, s)
        got = ts.process(raw, p, s)
        assert torch.equal(got, want), (got - want).abs().nan_to_num().max()
        greedy = sampler.RowParams(**{**vars(p), "temperature": torch.zeros(len(seqs), device=DEVICE)})
        sampler.update(s, greedy, want.argmax(-1))       # bad-word prefixes and counts move on
        p.index += 1


def test_the_uniform_is_the_pytorch_hash_bit_for_bit():
    gen = torch.Generator().manual_seed(7)
    seeds = torch.cat([torch.randint(-2**63, 2**63 - 1, (500,), generator=gen, dtype=torch.int64),
                       torch.tensor([0, 1, -1, 2**63 - 1, -2**63, 5 - 2**63], dtype=torch.int64)])
    index = torch.randint(0, 2**40, (seeds.numel(),), generator=gen, dtype=torch.int64)
    want = sampler.uniform(seeds, index)
    got = ts.uniform(seeds.to(DEVICE), index.to(DEVICE)).cpu()
    assert torch.equal(got, want)
    assert got.min() >= 0 and got.max() < 1
    assert sampler.uniform_reference(int(seeds[3]), int(index[3])) == float(got[3])


def test_sampling_steps_with_the_fused_kernels_are_the_pytorch_samplers():
    """Tokens (greedy, seeded sampling, bans, penalties), logprob records and seat updates."""
    seqs = _requests()
    p0, s0 = _graph_side(seqs)
    sides = {k: _on(p0, s0) for k in ("torch", "triton")}
    for step in range(5):
        raw = (_logits(len(seqs), 300 + step)).to(DEVICE)
        outs = {k: sampler.sample_step(raw, p, s, kernels=k) for k, (p, s) in sides.items()}
        a, b = outs["torch"], outs["triton"]
        assert b.tokens.tolist() == a.tokens.tolist(), step
        assert torch.equal(a.rank, b.rank) and torch.equal(a.top_ids, b.top_ids)
        for x, y in ((a.logprob, b.logprob), (a.top_logprobs, b.top_logprobs)):     # sums in another order
            torch.testing.assert_close(y, x, rtol=1e-6, atol=4e-6)
        for p, _ in sides.values():
            p.index += 1
    (_, st), (_, sr) = sides["torch"], sides["triton"]
    assert torch.equal(st.counts, sr.counts) and torch.equal(st.recent, sr.recent)


def test_the_fused_logprobs_give_the_wanted_rows_pytorchs_and_skip_the_rest():
    """A wanted row: the token's logprob and rank, the top entries most likely first (equal values
    by id, over two tiles of columns; a row of one value throughout), -inf logits, k below
    TOP_LOGPROBS and a vocabulary narrower than the kept block; rows nobody reads get zeros."""
    gen = torch.Generator().manual_seed(26)
    for v, k in ((ts.LOGPROB_BLOCK + 300, 20), (300, 5), (16, 16)):
        raw = torch.randn(5, v, generator=gen) * 3
        raw[1, : v // 2] = float("-inf")
        raw[3, [2, v - 3, v // 2]] = 9.0                 # three equal best, far apart: by id
        raw[4] = 0.5                                      # every value tied: the first k ids
        tokens = torch.tensor([0, v - 1, 1, v // 2, 4])
        want = torch.tensor([1, 1, 0, 1, 1])
        lp, rank, ids, vals = sampler.logprobs(raw, tokens, k)
        got = [t.cpu() for t in ts.logprobs(raw.to(DEVICE), tokens.to(DEVICE), k, want.to(DEVICE))]
        w = want.bool()
        # torch.topk orders equal values as it likes (the tied best of row 3, row 1's -inf), the kernel by id
        by_id = [sorted(zip((-vals[i]).tolist(), ids[i].tolist())) for i in range(5)]
        assert torch.equal(got[1][w], rank[w]), (v, got[1], rank)
        assert all(got[2][i].tolist() == [t for _, t in by_id[i]] for i in (0, 1, 3)), (v, got[2], ids)
        assert got[2][4].tolist() == list(range(k)) and got[1][4] == 1
        torch.testing.assert_close(got[0][w], lp[w], rtol=1e-6, atol=4e-6)
        torch.testing.assert_close(got[3][w], vals[w], rtol=1e-6, atol=4e-6)
        assert got[2][3, :3].tolist() == sorted([2, v - 3, v // 2]) and got[1][3] == 1   # ties: none above
        assert all(float(t[~w].abs().sum()) == 0 for t in got)
    with pytest.raises(ValueError, match="k 33 outside 1..16"):
        ts.logprobs(raw.to(DEVICE), tokens.to(DEVICE), 33)


def test_the_logprobs_candidates_hold_the_top_entries_wherever_they_lie():
    """The candidate bound at its worst: the largest values all in one lane (the same column of every
    tile); 31 lanes whose every value is a candidate, beside the 32nd lane's maximum, over 35 tiles
    (1,086 candidates: two merges); ties at the k-th value; a row whose top entries sit in one
    tile. Ids and values as the every-tile merge and PyTorch give them."""
    b, k = ts.LOGPROB_BLOCK, 20
    gen = torch.Generator().manual_seed(5)

    def records(raw, tokens):
        want = sampler.logprobs(raw, tokens, k)
        got = [[t.cpu() for t in ts.logprobs(raw.to(DEVICE), tokens.to(DEVICE), k, candidates=c)] for c in (True, False)]
        assert all(torch.equal(x, y) for x, y in zip(*got))
        _, rank, ids, vals = want
        by_id = [[t for _, t in sorted(zip((-vals[i]).tolist(), ids[i].tolist()))] for i in range(len(raw))]
        assert [got[0][2][i].tolist() for i in range(len(raw))] == by_id
        assert torch.equal(got[0][1], rank)
        torch.testing.assert_close(got[0][3], vals, rtol=1e-6, atol=4e-6)
        return got[0]

    v = 3 * b + 77
    raw = torch.randn(3, v, generator=gen)
    lanes = torch.arange(v) % b
    raw[0, lanes == 7] = 50.0 + torch.arange(int((lanes == 7).sum()), dtype=torch.float32)   # one lane on top
    raw[1, 10:40] = 30.0                                                                  # 30 equal, k = 20 of them
    raw[2, b + 5: b + 30] = 20.0 + torch.arange(25, dtype=torch.float32)                  # one tile
    got = records(raw, torch.tensor([7, 12, b + 6]))
    assert got[2][1].tolist() == list(range(10, 30))
    # lane 0 at 40 throughout (its maximum, id 0, is the smallest of the lane maxima: L) and lanes
    # 1..31 above it, rising with id, over 35 tiles: every value of theirs is a candidate (1,086, two
    # merges), the last written the largest
    v = 34 * b + 77
    raw = torch.randn(1, v, generator=gen)
    lanes = torch.arange(v) % b
    raw[0, lanes == 0] = 40.0
    rest = (lanes > 0) & (lanes < ts.TOP_BLOCK)
    raw[0, rest] = 41.0 + 0.25 * torch.arange(int(rest.sum()), dtype=torch.float32)
    assert int(rest.sum()) + 1 > b
    got = records(raw, torch.tensor([1]))
    assert got[2][0, 0] == int(rest.nonzero()[-1])


def test_a_seat_wider_than_the_ban_tile_is_refused():
    p, s = _on(*_graph_side(_requests()[:2]))
    s.bad_last = torch.full((s.seats + 1, 65), V, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="exceed the ban kernel's tiles"):
        ts.process(torch.zeros(2, V, device=DEVICE), p, s)


def _draw_params(rows: int, gen: torch.Generator):
    """A batch of rows under every rule: greedy, temperature only, top-k (1, small, the vocabulary),
    top-p (tight, loose), min_p, combinations; seeds over all 64 bits."""
    temp = torch.tensor([0.0, 0.7, 1.0, 1.5, 0.7, 1.0, 1.0, 2.0, 0.5, 1.0, 1e-6, 1.0]).repeat(rows // 12)
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0, 0.95, 1.0, 0.8, 1.0, 1.0, 1.0, 0.3]).repeat(rows // 12)
    top_k = torch.tensor([0, 0, 50, 0, 5, 20, 0, 0, 1, V, 0, 10]).repeat(rows // 12)
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.0, 0.2]).repeat(rows // 12)
    seed = torch.randint(-2**63, 2**63 - 1, (rows,), generator=gen, dtype=torch.int64)
    return temp, top_p, top_k, min_p, seed


def test_the_fused_draw_draws_the_pytorch_samplers_tokens():
    """Same rules, same hash, the same id order: the same token at (nearly) every draw; sums run in
    another order, so a draw whose u falls within rounding of a CDF step may part (none did here).
    Greedy rows and rows below the minimum temperature take the argmax exactly."""
    gen = torch.Generator().manual_seed(21)
    rows = 24
    temp, top_p, top_k, min_p, seed = _draw_params(rows, gen)
    same = total = 0
    for step in range(6):
        x = torch.randn(rows, V, generator=gen) * 3
        x[5, :10] = float("-inf")                                         # banned tokens in a sampled row
        x[12] = float("-inf")                                             # a greedy row with every token banned
        index = torch.full((rows,), step, dtype=torch.int64)
        want = sampler.draw(x, temp, top_p, top_k, seed, index, min_p)
        got = ts.draw(*(t.to(DEVICE) for t in (x, temp, top_p, top_k, seed, index, min_p))).cpu()
        greedy = (temp < sampler.MIN_TEMPERATURE) | (top_k == 1)
        assert torch.equal(got[greedy], x.argmax(-1)[greedy])
        same += int((got == want).sum())
        total += rows
    assert same >= 0.99 * total, (same, total)


def _kept(x, temp, top_p, top_k, min_p=None) -> torch.Tensor:
    """[R, V] bool: the ids the reference's filters keep (positive probability)."""
    probs, order = sampler.filtered_sorted(x, temp, top_p, top_k, min_p)
    return torch.zeros_like(probs).scatter_(1, order, probs) > 0


def test_the_fused_draw_resolves_ties_and_edges_as_the_pytorch_sampler():
    """No sort: top-k and top-p find their thresholds by a descent over the values' order keys, so
    ties at either cut, k past the finite values, negative and zero values, +inf and a row with
    nothing finite are where it could part from the sorted reference. Every token is one the
    reference keeps, and the draws are the reference's."""
    rows = 10
    x = torch.randn(rows, V, generator=torch.Generator().manual_seed(23)) * 3
    x[0, [3, 40, 41, 200]] = 20.0                        # top-k 2: the best value four times, all kept
    x[1, [3, 40, 41, 200]] = 20.0
    x[1, [7, 8]] = 19.5                                  # top-k 5: ties with the 5th value (19.5) kept
    x[2] = -20.0                                         # top-p 0.6 over four equal best: the first three ids
    x[2, [250, 9, 120, 60]] = 2.0
    x[3, 100:] = float("-inf")                           # top-k past the 100 finite values
    x[4] = -torch.rand(V, generator=torch.Generator().manual_seed(24)) - 1.0      # negative values only
    x[5, :150] = 0.0                                     # zeros, -0.0 among them, and top-p cutting them
    x[5, :150:2] = -0.0
    x[5, 150:] = -30.0
    x[6, 17] = float("inf")                              # not finite: the argmax
    x[7] = float("-inf")                                 # nothing finite in a sampled row: the argmax (0)
    temp = torch.tensor([1.0, 0.8, 1.0, 1.0, 0.3, 1.0, 1.0, 1.0, 1.0, 0.7])
    top_k = torch.tensor([2, 5, 0, 250, 7, 0, 0, 0, V - 1, 3])
    top_p = torch.tensor([1.0, 1.0, 0.6, 0.9, 0.6, 0.1, 1.0, 1.0, 0.999, 0.0])      # top-p 0: the argmax
    kept = _kept(x, temp, top_p, top_k)
    assert kept[0].nonzero().flatten().tolist() == [3, 40, 41, 200]
    assert kept[2].nonzero().flatten().tolist() == [9, 60, 120]   # 2.4 of 4 ties' mass
    assert kept[5].sum() == 15                            # 150 equal values, top-p 0.1: exactly 15 of them
    same = total = 0
    for step in range(6):
        seed = torch.randint(-2**63, 2**63 - 1, (rows,), generator=torch.Generator().manual_seed(step))
        index = torch.full((rows,), step, dtype=torch.int64)
        want = sampler.draw(x, temp, top_p, top_k, seed, index)
        got = ts.draw(*(t.to(DEVICE) for t in (x, temp, top_p, top_k, seed, index))).cpu()
        sampled = torch.tensor([True] * 6 + [False, False, True, False])
        assert bool(kept[sampled].gather(1, got[sampled, None]).all()), (step, got)
        assert got[6] == 17 and got[7] == 0 and got[9] == x[9].argmax()
        same += int((got == want).sum())
        total += rows
    assert same >= total - 1, (same, total)


def test_the_fused_draw_walks_rows_wider_than_a_tile():
    """A vocabulary past one tile of the draw (ts.DRAW_BLOCK columns): ties at top-p's cut and at
    top-k's threshold on both sides of the tile boundary, so the tie ranks and the running mass
    carry from tile to tile; a plain temperature row draws over both tiles."""
    v = ts.DRAW_BLOCK + 76
    x = torch.full((3, v), -25.0)
    x[0, 1090] = 3.5                                     # the best, past the boundary, then four ties of
    x[0, [5, 700, 1030, 1060]] = 3.0                     # which top-p 0.55 keeps two: the tile-1 ties rank 3rd, 4th
    x[1, [10, 1023, 1024, 1099]] = 4.0                   # top-k 2: all four kept, across the boundary
    x[2] = torch.randn(v, generator=torch.Generator().manual_seed(25))
    x[2, 1050:] += 2.0                                   # most of the mass in the second tile
    temp, top_p, top_k = torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0.55, 1.0, 1.0]), torch.tensor([0, 2, 0])
    kept = _kept(x, temp, top_p, top_k)
    assert kept[0].nonzero().flatten().tolist() == [5, 700, 1090]
    assert kept[1].nonzero().flatten().tolist() == [10, 1023, 1024, 1099]
    seen = set()
    for step in range(8):
        seed = torch.randint(-2**63, 2**63 - 1, (3,), generator=torch.Generator().manual_seed(100 + step))
        index = torch.full((3,), step, dtype=torch.int64)
        want = sampler.draw(x, temp, top_p, top_k, seed, index)
        got = ts.draw(*(t.to(DEVICE) for t in (x, temp, top_p, top_k, seed, index))).cpu()
        assert bool(kept.gather(1, got[:, None]).all()) and got.tolist() == want.tolist(), (step, got, want)
        seen |= {int(got[0]), int(got[1])}
    assert seen & {5, 700, 10, 1023} and seen & {1090, 1024, 1099}    # draws on both sides of the boundary


def test_the_fused_draw_follows_the_filtered_distribution():
    """One distribution, 1,200 draws (one row each, different seeds) by the reference: the
    frequencies are the temperature / top-k / top-p filtered softmax's, and nothing outside it is
    ever drawn; the fused draw gives the reference's tokens on 96 of them (the interpreter walks
    each row's 32 descent passes in Python)."""
    gen = torch.Generator().manual_seed(22)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0] + [-9.0] * (V - 8))
    rows = 300
    x = logits.repeat(rows, 1)
    temp, top_p, top_k = torch.full((rows,), 0.8), torch.full((rows,), 0.9), torch.full((rows,), 6)
    probs, order = sampler.filtered_sorted(logits[None], temp[:1], top_p[:1], top_k[:1])
    want = torch.zeros(V)
    want[order[0]] = probs[0]
    counts = torch.zeros(V)
    for step in range(4):
        seed = torch.randint(-2**63, 2**63 - 1, (rows,), generator=gen, dtype=torch.int64)
        index = torch.full((rows,), step, dtype=torch.int64)
        drawn = sampler.draw(x, temp, top_p, top_k, seed, index)
        counts += torch.bincount(drawn, minlength=V).float()
        part = slice(24 * step, 24 * step + 24)
        got = ts.draw(*(t[part].to(DEVICE) for t in (x, temp, top_p, top_k, seed, index))).cpu()
        assert got.tolist() == drawn[part].tolist()
    freq = counts / counts.sum()
    assert float(freq[want == 0].sum()) == 0.0                          # outside the nucleus: never
    assert float((freq - want).abs().max()) < 0.045, (freq[:8], want[:8])        # ~3.4 sigma at p = 0.3
