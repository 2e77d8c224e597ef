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


def _stage_counts(m: FrontendMetrics) -> tuple[int, int, int]:
    return m.queue_wait.count(), m.prefill.count(), m.decode.count()


def test_stage_histograms_from_slot_timestamps():
    m = FrontendMetrics("m")
    ms = 1_000_000
    m.observe_stages(t_submit_ns=100 * ms, t_picked_ns=103 * ms, t_first_ns=110 * ms, t_last_ns=150 * ms,
                     shares_clock=True)
    page = m.render(None, None)
    assert metric(page, "blink_queue_wait_seconds_count") == 1
    assert math.isclose(metric(page, "blink_queue_wait_seconds_sum"), 0.003)
    assert math.isclose(metric(page, "blink_prefill_seconds_sum"), 0.007)
    assert math.isclose(metric(page, "blink_decode_seconds_sum"), 0.040)
    assert metric(page, "blink_decode_seconds_bucket", le="+Inf") == 1
    assert "# TYPE blink_prefill_seconds histogram" in page
    # One token: decode is 0 s, still observed (the request finished its decode stage).
    m.observe_stages(100 * ms, 101 * ms, 102 * ms, 102 * ms, True)
    assert _stage_counts(m) == (2, 2, 2)


def test_stage_histograms_skip_garbage():
    ms = 1_000_000
    m = FrontendMetrics("m")
    m.observe_stages(100 * ms, 0, 0, 0, True)                 # cancelled before the backend claimed it
    m.observe_stages(0, 0, 0, 0, True)                        # nothing stamped at all
    assert _stage_counts(m) == (0, 0, 0)
    m.observe_stages(100 * ms, 103 * ms, 0, 103 * ms, True)   # claimed, no token (complete() stamps t_last)
    assert _stage_counts(m) == (1, 0, 0)
    m.observe_stages(200 * ms, 103 * ms, 110 * ms, 120 * ms, True)   # picked "before" submit: not comparable
    assert _stage_counts(m) == (1, 1, 1)
    m.observe_stages(100 * ms, 103 * ms, 110 * ms, 105 * ms, True)   # last before first: decode skipped
    assert _stage_counts(m) == (2, 2, 1)
    m.observe_stages(100 * ms, 90 * ms, 80 * ms, 120 * ms, True)     # first before picked: no prefill/decode
    assert _stage_counts(m) == (2, 2, 1)


def test_queue_wait_needs_a_shared_clock():
    """A remote backend (verbs) stamps t_picked on another machine's clock: no queue wait,
    but prefill and decode (both backend stamps) still count."""
    ms = 1_000_000
    m = FrontendMetrics("m")
    m.observe_stages(100 * ms, 5 * ms, 7 * ms, 9 * ms, shares_clock=False)
    assert _stage_counts(m) == (0, 1, 1)
    page = m.render(None, None)
    assert "blink_queue_wait_seconds_count" not in page and "# TYPE blink_queue_wait_seconds histogram" in page


def test_prefix_cache_counters_go_from_the_ring_header_to_the_page():
    """The daemon's prefix-cache words in the ring header -> HealthMonitor -> the ring client's
    stats -> /metrics; a daemon without the cache shows none of them (run-batch's probe)."""
    from dpu_frontend.backend_health import HealthMonitor
    from dpu_frontend.ring_client import RingClient
    from shared_layout import Ring, RingGeometry
    geom = RingGeometry(4, 1024, 1024)
    ring = Ring.create(bytearray(geom.total_size), geom)
    for name, v in (("prefix_caching", 1), ("kv_blocks_cached", 9), ("prefix_hit_tokens", 1504),
                    ("prefix_miss_tokens", 210), ("prefix_hit_blocks", 94), ("prefix_miss_blocks", 14)):
        ring.set(name, v)
    mon = HealthMonitor(1.0, shares_clock=True)
    mon.observe(ring.header)
    client = RingClient.__new__(RingClient)          # only what stats() reads of the health monitor
    client._health = mon
    stats = {"prefix_cache": RingClient.prefix_cache_stats(client)}
    page = FrontendMetrics("m").render(stats, None)
    assert metric(page, "blink_prefix_cache_hits_total", unit="tokens") == 1504
    assert metric(page, "blink_prefix_cache_misses_total", unit="tokens") == 210
    assert metric(page, "blink_prefix_cache_hits_total", unit="blocks") == 94
    assert metric(page, "blink_prefix_cache_misses_total", unit="blocks") == 14
    assert metric(page, "blink_prefix_cache_blocks") == 9
    ring.set("prefix_caching", 0)
    mon.observe(ring.header)
    assert "prefix_cache" not in FrontendMetrics("m").render({"prefix_cache": RingClient.prefix_cache_stats(client)},
                                                             None)
