"""The in-graph sampler's CPU twin: gpu_backend/graphs/sampler.py (the torch code every
step graph captures) run on CPU tensors against the CPU daemon's batched sampler
(logits_processors.apply + sampling.filter_batch + logprobs.records) on the same logits
and parameters, over several steps so the in-graph seat update (counts, recent tokens)
is checked against the daemon's PenaltyState and bad-word rule."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_backend import logits_processors, logprobs, sampling
from gpu_backend.graphs import sampler
from gpu_backend.scheduler.sequence import SamplingParams, Sequence
from shared_layout.layout import decode_logprob_records

V = 300
EOS = 2


def _seq(i: int, prompt, output, stop=(), ignore_eos=False, **kw) -> Sequence:
    stops = set(stop) | (set() if ignore_eos else {EOS})
    return Sequence(slot=i, seq=i, epoch=1, prompt=list(prompt), max_tokens=64, params=SamplingParams(**kw),
                    stop_ids=frozenset(stops), max_len=512, output=list(output))


def _requests() -> list[Sequence]:
    """A batch mixing every rule with plain rows (greedy and sampling)."""
    return [
        _seq(0, [5, 6, 7], []),                                                      # plain greedy
        _seq(1, [5, 9], [11, 12], temperature=0.8, top_p=0.9, seed=1),             # plain sampling
        _seq(2, [1, 2, 3, 40], [40, 41, 40], repetition_penalty=1.3, frequency_penalty=0.5,
             presence_penalty=0.7),
        _seq(3, [7], [8], logit_bias=((3, 5.0), (4, -100.0), (17, 2.5)), temperature=1.2, top_k=20, seed=3),
        _seq(4, [7], [], allowed_token_ids=(3, 4, 5, 100, 299), bad_words=((100,),)),
        _seq(5, [8, 9], [21, 22, 23], bad_words=((22, 23, 24), (23, 30), (77,), (50, 51, 52, 53))),
        _seq(6, [8], [EOS], min_tokens=4, stop=(9, 10), temperature=0.7, min_p=0.1, seed=6),
        _seq(7, [8], [], min_tokens=2, ignore_eos=True, stop=(13,), repetition_penalty=0.8),
        _seq(8, [1], [4, 4, 4], frequency_penalty=-1.5, presence_penalty=-0.5, min_p=0.3, temperature=1.0,
             top_p=0.5, seed=2**63 + 5),
        _seq(9, [3, 4], [6], logit_bias=((6, 1.0),), repetition_penalty=1.7, bad_words=((6, 6),), logprobs=5),
    ]


def _graph_side(seqs: list[Sequence], seats: int = 16):
    """RowParams and SeatState as the host loop stages them (seat i for row i)."""
    n = len(seqs)
    s = sampler.SeatState(seats, V)
    p = sampler.RowParams.neutral(n, s.sink)
    for i, q in enumerate(seqs):
        a = q.params
        p.temperature[i], p.top_p[i], p.top_k[i], p.min_p[i] = a.temperature, a.top_p, a.top_k, a.min_p
        p.seed[i] = (a.seed or 0) & (2**64 - 1) if (a.seed or 0) < 2**63 else (a.seed or 0) - 2**64
        p.index[i] = len(q.output)
        p.presence[i], p.frequency[i] = a.presence_penalty, a.frequency_penalty
        p.repetition[i] = a.repetition_penalty or 1.0
        p.min_tokens[i] = a.min_tokens
        stops = sorted(q.stop_ids)
        p.stop_ids[i, :len(stops)] = torch.tensor(stops)
        p.seat[i] = i
        s.fill(i, q.prompt, q.output, a.logit_bias, a.allowed_token_ids, a.bad_words)
    return p, s


def _logits(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * 3


def _same_processed(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    fin = torch.isfinite(want)
    assert torch.allclose(got[fin], want[fin], rtol=1e-6, atol=1e-5)


def test_processed_logits_and_greedy_picks_match_the_cpu_daemon_over_steps():
    seqs = _requests()
    p, s = _graph_side(seqs)
    for step in range(6):
        raw = _logits(len(seqs), 100 + step)
        want = logits_processors.apply(raw, seqs)
        got = sampler.process(raw, p, s)
        _same_processed(got, want)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        # the graph's greedy tokens (all rows greedy here) extend both sides alike
        greedy = sampler.RowParams(**{**vars(p), "temperature": torch.zeros(len(seqs))})
        out = sampler.sample_step(raw, greedy, s)
        assert out.tokens.tolist() == want.argmax(-1).tolist()
        for q, t in zip(seqs, out.tokens.tolist()):
            q.output.append(t)
        p.index += 1
    # the in-graph update kept every seat's counts equal to the daemon's PenaltyState
    for i, q in enumerate(seqs):
        want_counts = torch.bincount(torch.tensor(q.output), minlength=V).float()
        assert torch.equal(s.counts[i], want_counts), i
    assert float(s.counts[s.sink].abs().sum()) == 0 and bool((s.recent[s.sink] == -1).all())


def test_bad_word_prefixes_follow_the_generated_tokens():
    q = _seq(0, [1], [22, 23], bad_words=((22, 23, 24), (23, 25), (24, 26, 27)))
    p, s = _graph_side([q])
    for nxt, banned in ((24, {24, 25}), (26, set()), (0, {27})):
        got = sampler.process(torch.zeros(1, V), p, s)
        assert set(torch.nonzero(torch.isneginf(got[0])).flatten().tolist()) == banned
        assert set(torch.nonzero(torch.isneginf(logits_processors.apply(torch.zeros(1, V), [q])[0]))
                   .flatten().tolist()) == banned
        sampler.update(s, p, torch.tensor([nxt]))
        q.output.append(nxt)
        p.index += 1


def test_filtered_distribution_matches_filter_batch():
    seqs = _requests()
    p, s = _graph_side(seqs)
    raw = _logits(len(seqs), 7)
    x = logits_processors.apply(raw, seqs)
    rows = [i for i, q in enumerate(seqs) if q.params.temperature >= sampling.MIN_TEMPERATURE]
    idx = torch.tensor(rows)
    want = sampling.filter_batch(x[idx], p.temperature[idx], p.top_k[idx], p.top_p[idx], p.min_p[idx])
    probs, order = sampler.filtered_sorted(sampler.process(raw, p, s)[idx], p.temperature[idx], p.top_p[idx],
                                           p.top_k[idx], p.min_p[idx])
    got = torch.zeros_like(probs).scatter(1, order, probs)
    assert torch.allclose(got, want, atol=1e-6)


def test_logprob_records_match_the_cpu_daemon():
    seqs = _requests()
    p, s = _graph_side(seqs)
    raw = _logits(len(seqs), 11)
    out = sampler.sample_step(raw, p, s)
    k = sampler.TOP_LOGPROBS
    want = logprobs.records(raw, out.tokens, k)
    lp, rank, ids, vals = decode_logprob_records(want.reshape(-1), k)
    assert np.allclose(out.logprob.numpy(), lp, atol=1e-6) and out.rank.numpy().tolist() == rank.tolist()
    assert np.allclose(out.top_logprobs.numpy(), vals, atol=1e-6)
    got_ids = out.top_ids.numpy()
    for r in range(len(seqs)):                # ids equal except where two logprobs tie exactly
        for j in np.nonzero(got_ids[r] != ids[r])[0]:
            assert vals[r, j] == out.top_logprobs[r, j].item() and (vals[r] == vals[r, j]).sum() > 1
    # the sampled token's logprob is the raw logits' (not the processed ones')
    full = torch.log_softmax(raw, -1).gather(1, out.tokens[:, None])[:, 0]
    assert torch.allclose(out.logprob, full)


def test_a_plain_row_is_untouched_bit_for_bit():
    seqs = [_seq(0, [1, 2], [3]), _seq(1, [4], [], ignore_eos=True, temperature=0.9)]
    p, s = _graph_side(seqs)
    p.seat[:] = s.sink                          # plain rows ride the sink seat
    raw = _logits(2, 3)
    assert torch.equal(sampler.process(raw, p, s), raw)
    before = s.counts.clone()
    sampler.update(s, p, torch.tensor([5, 6]))
    assert torch.equal(s.counts, before)


def test_seeded_draws_reproduce_and_differ_across_seeds():
    seqs = _requests()
    raw = _logits(len(seqs), 21)
    runs = []
    for _ in range(2):
        p, s = _graph_side(seqs)
        runs.append(sampler.sample_step(raw, p, s).tokens.tolist())
    assert runs[0] == runs[1]
    p, s = _graph_side(seqs)
    p.seed += 1
    p.temperature[:] = 1.5
    p.top_p[:], p.top_k[:], p.min_p[:] = 1.0, 0, 0.0
    draws = {tuple(sampler.sample_step(raw, p, sampler.SeatState(16, V)).tokens.tolist())}
    p.seed += 1000
    draws.add(tuple(sampler.sample_step(raw, p, sampler.SeatState(16, V)).tokens.tolist()))
    assert len(draws) == 2


def test_drawn_tokens_respect_every_ban():
    """Sampling rows never draw a -inf token: allowed ids, bad words, stops before min_tokens."""
    seqs = _requests()
    for trial in range(20):
        p, s = _graph_side(seqs)
        p.temperature[:] = 2.0
        p.seed[:] = torch.arange(len(seqs)) * 7919 + trial
        raw = _logits(len(seqs), 300 + trial)
        x = sampler.process(raw, p, s)
        tok = sampler.sample_step(raw, p, s).tokens
        assert bool(torch.isfinite(x.gather(1, tok[:, None])).all())
    assert set(tok[4:5].tolist()) <= {3, 4, 5, 299}


def test_a_seat_refuses_more_bad_words_than_it_holds():
    s = sampler.SeatState(2, V)
    with pytest.raises(ValueError, match="bad words"):
        s.fill(0, [1], [], bad_words=tuple((i, i + 1) for i in range(sampler.BAD_WORDS + 1)))
    with pytest.raises(ValueError, match="seat"):
        s.fill(2, [1], [])
