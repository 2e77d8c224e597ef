"""Prometheus text of the frontend metrics: counters, cumulative histograms, gauges from ring stats."""
from __future__ import annotations

import math

from dpu_frontend.backend_health import BackendHealth
from dpu_frontend.metrics import FrontendMetrics, Histogram
from frontend_procs import metric


def test_histogram_is_cumulative_with_inf_sum_and_count():
    h = Histogram("x_seconds", "help", (0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    page = "\n".join(h.render())
    assert metric(page, "x_seconds_bucket", le="0.1") == 2   # le is inclusive
    assert metric(page, "x_seconds_bucket", le="1") == 3
    assert metric(page, "x_seconds_bucket", le="+Inf") == 4
    assert metric(page, "x_seconds_count") == 4 and math.isclose(metric(page, "x_seconds_sum"), 3.65)


def test_page_has_requests_histograms_and_ring_gauges():
    m = FrontendMetrics("m")
    m.outcome("chat", "stop")
    m.outcome("chat", "stop")
    m.outcome("completions", "invalid")
    m.ttft.observe(0.02)
    stats = {"slots": {"EMPTY": 3, "DECODE_PROCESSING": 1}, "queue_depth": 2, "inflight": 1}
    page = m.render(stats, BackendHealth("READY", True, 0.03, 4))
    assert metric(page, "blink_requests_total", endpoint="chat", outcome="stop") == 2
    assert metric(page, "blink_requests_total", endpoint="completions", outcome="invalid") == 1
    assert metric(page, "blink_slots", state="DECODE_PROCESSING") == 1
    assert metric(page, "blink_queue_depth") == 2 and metric(page, "blink_requests_inflight") == 1
    assert metric(page, "blink_backend_up") == 1 and metric(page, "blink_backend_heartbeat_age_seconds") == 0.03
    assert metric(page, "blink_time_to_first_token_seconds_count") == 1
    assert "# TYPE blink_requests_total counter" in page and page.endswith("\n")
    down = m.render(None, BackendHealth("DOWN", False, None, 0, "no ring"))
    assert metric(down, "blink_backend_up") == 0 and "blink_backend_heartbeat_age_seconds +Inf" in down


def test_label_values_are_escaped():
    m = FrontendMetrics("m")
    m.outcome('we"ird\\', "stop")
    assert 'endpoint="we\\"ird\\\\"' in m.render(None, None)
