"""Arrival schedules, load config validation and the /metrics stage budget."""
import math

import numpy as np
import pytest

from bench.load import LoadConfig, arrival_offsets
from bench.stages import missing_stages, parse_histograms, stage_budget


def test_constant_arrivals_are_evenly_spaced():
    off = arrival_offsets("constant", 4.0, 5, np.random.default_rng(0))
    assert off.tolist() == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])


def test_poisson_arrivals_have_the_offered_rate_and_exponential_gaps():
    off = arrival_offsets("poisson", 8.0, 20001, np.random.default_rng(1))
    gaps = np.diff(off)
    assert off[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)    # exponential: CV 1
    bursty = np.diff(arrival_offsets("poisson", 8.0, 20001, np.random.default_rng(1), burstiness=0.25))
    assert bursty.mean() == pytest.approx(1 / 8.0, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)  # gamma k=0.25: CV 1/sqrt(k)


def test_load_config_validation_and_request_counts():
    cfg = LoadConfig(mode="poisson", levels=(0.5, 4.0), duration_s=10.0, min_requests=3)
    assert cfg.requests_for(4.0) == 40 and cfg.requests_for(0.1) == 3
    for bad in (dict(mode="ramp"), dict(levels=()), dict(levels=(0.0,)), dict(duration_s=0),
                dict(mode="concurrency", levels=(1.5,)), dict(timeout_s=-1), dict(warmup_requests=-1)):
        with pytest.raises(ValueError):
            LoadConfig(**bad)


METRICS_BEFORE = """# HELP blink_tokenization_seconds x
# TYPE blink_tokenization_seconds histogram
blink_tokenization_seconds_bucket{le="0.001"} 3
blink_tokenization_seconds_bucket{le="+Inf"} 4
blink_tokenization_seconds_sum 0.004
blink_tokenization_seconds_count 4
blink_time_to_first_token_seconds_sum{model="a"} 1.0
blink_time_to_first_token_seconds_count{model="a"} 10
blink_time_to_first_token_seconds_sum{model="b"} 1.0
blink_time_to_first_token_seconds_count{model="b"} 10
blink_requests_total{endpoint="completions",outcome="stop"} 14
"""
METRICS_AFTER = METRICS_BEFORE.replace("_sum 0.004", "_sum 0.014").replace("_count 4", "_count 14").replace(
    'blink_time_to_first_token_seconds_sum{model="a"} 1.0', 'blink_time_to_first_token_seconds_sum{model="a"} 4.0'
).replace('blink_time_to_first_token_seconds_count{model="a"} 10', 'blink_time_to_first_token_seconds_count{model="a"} 20')


def test_stage_budget_is_the_mean_per_request_between_scrapes():
    before, after = parse_histograms(METRICS_BEFORE), parse_histograms(METRICS_AFTER)
    assert before["blink_tokenization_seconds"] == (0.004, 4.0)
    assert before["blink_time_to_first_token_seconds"] == (2.0, 20.0)   # label sets summed
    b = stage_budget(before, after)
    assert b["tokenize"]["mean_ms"] == pytest.approx(1.0) and b["tokenize"]["count"] == 10
    assert b["server_ttft"]["mean_ms"] == pytest.approx(300.0)
    assert b["queue_wait"] is None and b["prefill"] is None and b["decode"] is None
    assert missing_stages([b]) == ["queue_wait", "prefill", "decode", "server_e2e"]
    idle = stage_budget(after, after)
    assert math.isnan(idle["tokenize"]["mean_ms"])


def test_stage_budget_reads_the_frontends_own_stage_histograms():
    """bench/stages.py and dpu_frontend/metrics.py agree on the names and the text format."""
    from dpu_frontend.metrics import FrontendMetrics
    m = FrontendMetrics("m")
    before = parse_histograms(m.render(None, None))
    ms = 1_000_000
    m.tokenize.observe(0.001)
    m.observe_stages(100 * ms, 102 * ms, 112 * ms, 142 * ms, shares_clock=True)
    m.observe_stages(100 * ms, 104 * ms, 114 * ms, 154 * ms, shares_clock=True)
    b = stage_budget(before, parse_histograms(m.render(None, None)))
    assert b["queue_wait"]["metric"] == "blink_queue_wait_seconds" and b["queue_wait"]["count"] == 2
    assert b["queue_wait"]["mean_ms"] == pytest.approx(3.0)
    assert b["prefill"]["metric"] == "blink_prefill_seconds" and b["prefill"]["mean_ms"] == pytest.approx(10.0)
    assert b["decode"]["metric"] == "blink_decode_seconds" and b["decode"]["mean_ms"] == pytest.approx(35.0)
    assert b["tokenize"]["count"] == 1
    assert missing_stages([b]) == ["server_ttft", "server_e2e"]
