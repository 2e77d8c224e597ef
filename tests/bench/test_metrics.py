"""bench.metrics against hand-computed examples (vllm bench serve's definitions)."""
import math

import numpy as np
import pytest

from bench.metrics import RequestRecord, Slo, distribution, meets_slo, parse_slo, summarize


def rec(ttft, e2e, out, itl=(), prompt=10, ok=True, timed_out=False):
    return RequestRecord(prompt_tokens=prompt, max_tokens=out, ttft_s=ttft, e2e_s=e2e, itl_s=list(itl),
                         output_tokens=out if ok else 0, success=ok, timed_out=timed_out)


def test_tpot_is_decode_time_over_tokens_after_the_first():
    # 0.1 s to the first token, 1.0 s total, 10 tokens: 0.9 s over 9 gaps = 0.1 s.
    assert rec(0.1, 1.0, 10).tpot_s == pytest.approx(0.1)
    assert rec(0.2, 0.5, 4).tpot_s == pytest.approx(0.1)
    assert rec(0.2, 0.2, 1).tpot_s is None          # one token: no TPOT
    assert rec(0.2, 0.9, 5, ok=False).tpot_s is None


def test_summary_pools_itl_and_tpot_and_counts_failures():
    records = [
        rec(0.1, 1.0, 10, itl=[0.1] * 9),
        rec(0.3, 0.6, 4, itl=[0.1, 0.1, 0.1], prompt=20),
        rec(0.5, 0.5, 1, prompt=30),                 # one-token request: in TTFT/E2E, not in TPOT
        rec(None, None, 8, ok=False, timed_out=True),
        rec(None, None, 8, ok=False),
    ]
    s = summarize(records, duration_s=2.0)
    assert (s.requests, s.completed, s.failed, s.timeouts) == (5, 3, 2, 1)
    assert s.total_prompt_tokens == 60 and s.total_output_tokens == 15
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx(7.5)
    assert s.total_token_throughput == pytest.approx(37.5)
    assert s.ttft.n == 3 and s.ttft.mean_ms == pytest.approx(300.0)
    assert s.ttft.p50_ms == pytest.approx(300.0)
    assert s.tpot.n == 2 and s.tpot.mean_ms == pytest.approx(100.0)
    assert s.itl.n == 12 and s.itl.mean_ms == pytest.approx(100.0)
    assert s.e2e.mean_ms == pytest.approx((1000 + 600 + 500) / 3)
    assert s.goodput is None


def test_percentiles_are_numpy_linear_interpolation_in_ms():
    samples = [0.010, 0.020, 0.030, 0.040, 0.100]
    d = distribution(samples)
    # Hand-computed: p50 = 30; p90: rank 3.6 -> 40 + 0.6*(100-40) = 76; p99: rank 3.96 -> 97.6
    assert d.percentiles_ms[50.0] == pytest.approx(30.0)
    assert d.percentiles_ms[90.0] == pytest.approx(76.0)
    assert d.percentiles_ms[99.0] == pytest.approx(97.6)
    assert d.percentiles_ms[99.9] == pytest.approx(99.76)
    assert d.mean_ms == pytest.approx(40.0)
    assert d.std_ms == pytest.approx(float(np.std(np.array(samples) * 1000)))
    empty = distribution([])
    assert empty.n == 0 and math.isnan(empty.mean_ms) and math.isnan(empty.p99_ms)


def test_goodput_applies_every_slo_and_one_token_requests_have_zero_tpot():
    records = [
        rec(0.1, 1.0, 10),    # ttft 100 ms, tpot 100 ms
        rec(0.4, 1.3, 10),    # ttft 400 ms, tpot 100 ms
        rec(0.1, 2.8, 10),    # ttft 100 ms, tpot 300 ms
        rec(0.2, 0.2, 1),     # one token: tpot counts as 0
        rec(None, None, 5, ok=False),
    ]
    s = summarize(records, 2.0, Slo(ttft_ms=250, tpot_ms=150))
    assert s.goodput == pytest.approx(2 / 2.0)       # the first and the one-token request
    assert summarize(records, 4.0, Slo(ttft_ms=500)).goodput == pytest.approx(4 / 4.0)
    assert summarize(records, 1.0, Slo(e2e_ms=1000)).goodput == pytest.approx(2.0)
    assert meets_slo(rec(0.25, 1.0, 10), Slo(ttft_ms=250))  # the limit itself is met
    assert not meets_slo(rec(None, None, 1, ok=False), Slo(ttft_ms=1e9))


def test_parse_slo_and_bad_input():
    assert parse_slo("ttft:500,tpot:50") == Slo(500.0, 50.0, None)
    assert parse_slo("ttft:1 e2el:3") == Slo(1.0, None, 3.0)
    assert parse_slo(None) == Slo() and not Slo().is_set()
    for bad in ("ttft", "itl:5", "ttft:abc", "tpot:-1"):
        with pytest.raises(ValueError):
            parse_slo(bad)
    with pytest.raises(ValueError):
        summarize([], 0.0)
