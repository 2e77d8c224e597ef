"""sampling: temperature / top-k / top-p filters and per-request generators."""
import torch

from gpu_backend.sampling import argmax_rows, draw, filter_logits, sample
from gpu_backend.scheduler.sequence import SamplingParams, Sequence


def seq(**params):
    return Sequence(slot=0, seq=1, epoch=0, prompt=[1], max_tokens=4, params=SamplingParams(**params),
                    stop_ids=frozenset(), max_len=100)


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
    p = filter_logits(logits, 1.0, 2, 1.0)
    assert (p > 0).tolist() == [False, True, False, True, False]
    torch.testing.assert_close(p.sum(), torch.tensor(1.0))


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p = filter_logits(probs.log(), 1.0, 0, 0.8)
    assert (p > 0).tolist() == [True, True, False, False]
    p = filter_logits(probs.log(), 1.0, 0, 0.81)
    assert (p > 0).tolist() == [True, True, True, False]
    assert (filter_logits(probs.log(), 1.0, 0, 1e-9) > 0).tolist() == [True, False, False, False]


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([1.0, 2.0])
    assert filter_logits(logits, 0.1, 0, 1.0)[1] > filter_logits(logits, 10.0, 0, 1.0)[1]


def test_greedy_rows_take_argmax_and_seeds_replay():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    a = [seq(), seq(temperature=1.0, seed=7), seq(temperature=1.0, seed=8)]
    first = [sample(logits, a) for _ in range(20)]
    assert all(row[0] == int(logits[0].argmax()) for row in first)
    b = [seq(), seq(temperature=1.0, seed=7), seq(temperature=1.0, seed=8)]
    again = [sample(logits, b) for _ in range(20)]
    assert first == again                                    # same seeds, same draws
    assert [r[1] for r in first] != [r[2] for r in first]    # different seeds differ
    # a seeded sequence draws the same alone as beside others
    c = [seq(temperature=1.0, seed=7)]
    assert [sample(logits[1:2], c)[0] for _ in range(20)] == [r[1] for r in first]


def test_unseeded_sequences_differ():
    logits = torch.zeros(2, 1000)
    a, b = seq(temperature=1.0), seq(temperature=1.0)
    draws = [sample(logits, [a, b]) for _ in range(10)]
    assert [d[0] for d in draws] != [d[1] for d in draws]


def test_tiny_temperature_is_greedy_not_nan():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1)) * 30
    out = sample(logits, [seq(temperature=1e-30, seed=1), seq(temperature=1e-4, top_p=0.5, seed=2)])
    assert out == logits.argmax(-1).tolist()


def test_the_draw_follows_the_probabilities_and_never_picks_a_zero():
    """draw: inverse CDF with one uniform from the generator; frequencies over 20k draws match
    the probabilities (each within 4 standard deviations) and a zero-probability id never comes."""
    probs = torch.tensor([0.5, 0.0, 0.2, 0.0, 0.3, 0.0])
    cdf = torch.cumsum(probs, dim=-1)
    g = torch.Generator().manual_seed(1)
    n = 20000
    counts = torch.bincount(torch.tensor([draw(cdf, g) for _ in range(n)]), minlength=6).double()
    assert counts[1] == counts[3] == counts[5] == 0
    sd = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert bool(((counts / n - probs.double()).abs() <= 4 * sd + 1e-12).all())
    last = torch.cumsum(torch.tensor([0.0, 0.0, 1.0, 0.0]), dim=-1)              # mass on one id
    assert {draw(last, g) for _ in range(200)} == {2}


def test_nan_rows_from_the_argmax_match_the_full_check():
    """nan_rows with the rows' argmax (argmax propagates NaN) finds the rows the full scan finds,
    wherever the NaN sits, in float32 and bf16; sample() gives such a row -1 and the others argmax."""
    from gpu_backend.sampling import nan_rows
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(6, 49152, generator=g).to(dtype)
        x[1, 7] = float("nan")                    # before the max
        x[3, 49151] = float("nan")                # last
        x[4, x[4].float().argmax()] = float("nan")   # at the max
        x[5, 0] = x[5, 100] = float("nan")        # two
        want = [1, 3, 4, 5]
        assert nan_rows(x) == want and nan_rows(x, x.argmax(dim=-1)) == want
        assert nan_rows(x, argmax_rows(x)) == want
        strided = x[::2, 3:]                                  # rows 0, 2, 4: only row 4's NaN is in it
        assert nan_rows(strided, argmax_rows(strided)) == [2] == nan_rows(strided)
    logits = torch.randn(3, 50, generator=g)
    logits[1, 10] = float("nan")
    out = sample(logits, [seq(), seq(), seq()])
    assert out[1] == -1 and [out[0], out[2]] == [int(logits[0].argmax()), int(logits[2].argmax())]


def test_argmax_rows_is_torch_argmax_first_maximum_and_first_nan():
    """The numpy row argmax the CPU sampler takes returns what torch.argmax does: a row's first
    maximum on ties, its first NaN where it has one (nan_rows reads the pick), strided rows too."""
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(3))
    x[1, 40] = x[1, 250] = float("nan")
    x[2] = 1.0                                        # all tied: the first
    x[3, 7] = x[3, 9] = float("inf")
    with torch.inference_mode():
        for rows in (x, x[:, ::3], x.clone().requires_grad_(False)[:, 10:]):
            got = argmax_rows(rows)
            assert got.dtype == torch.int64 and got.tolist() == rows.argmax(dim=-1).tolist()
    assert argmax_rows(x)[1] == 40 and argmax_rows(x)[2] == 0 and argmax_rows(x)[3] == 7
    assert argmax_rows(x.double()).tolist() == x.double().argmax(dim=-1).tolist()     # torch's own path
