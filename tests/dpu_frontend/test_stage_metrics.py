"""End to end: one request against `blink serve --model null` shows up once in each per-stage
histogram of /metrics (queue wait, prefill, decode), and bench/stages.py reads them."""
from __future__ import annotations

import os

import openai
import pytest

from bench.stages import parse_histograms, stage_budget
from frontend_procs import Serve, metric

pytestmark = pytest.mark.timeout(120)


def test_one_request_is_observed_once_per_stage():
    with Serve(f"blink-test-stages-{os.getpid()}", "--model", "null") as server:
        before = parse_histograms(server.metrics())
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model="null", prompt=[9906, 1001, 2002], max_tokens=8,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 8
        page = server.metrics()
        for name in ("blink_queue_wait_seconds", "blink_prefill_seconds", "blink_decode_seconds"):
            assert metric(page, f"{name}_count") == 1, name
            assert metric(page, f"{name}_bucket", le="+Inf") == 1
            assert 0 <= metric(page, f"{name}_sum") < 30
        b = stage_budget(before, parse_histograms(page))
        for stage in ("queue_wait", "prefill", "decode"):
            assert b[stage]["count"] == 1 and b[stage]["mean_ms"] >= 0, (stage, b[stage])
