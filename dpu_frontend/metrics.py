"""Frontend metrics in the Prometheus text format (exposition 0.0.4), no client library.

    handlers -> FrontendMetrics.observe_*(...) (counters, histograms; O(buckets))
    finished request -> observe_stages(slot timestamps) -> queue wait / prefill / decode
    GET /metrics -> render(ring stats, backend health, supervisor restarts) -> text

Counters and histograms live here; gauges (slots by state, queue depth,
in-flight requests, backend heartbeat age) are sampled from the ring client
when scraped, so they can never drift from the ring.
"""
from __future__ import annotations

import bisect
import math
import time
from typing import Iterable

# Buckets in seconds, vLLM's choices for the same quantities.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                  0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS_S = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
TOKENIZE_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                      0.25, 0.5, 1.0)
# Queue wait is sub-millisecond on an idle ring and seconds under overload: finer low end than TTFT.
QUEUE_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# Request outcomes (the `outcome` label): how each accepted or rejected request ended.
OUTCOMES = ("stop", "length", "abort", "error", "client_disconnect", "stalled", "timeout",
            "invalid", "unauthorized", "rate_limited", "unavailable", "internal_error")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in pairs)
    return "{" + inner + "}" if inner else ""


def _num(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


class Counter:
    def __init__(self, name: str, help_text: str, label_names: tuple[str, ...] = ()):
        self.name, self.help, self.label_names = name, help_text, label_names
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, *labels: str, by: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + by

    def get(self, *labels: str) -> float:
        return self.values.get(labels, 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for labels, v in sorted(self.values.items()):
            lines.append(f"{self.name}{_labels(zip(self.label_names, labels))} {_num(v)}")
        return lines


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...],
                 label_names: tuple[str, ...] = ()):
        self.name, self.help, self.label_names = name, help_text, label_names
        self.buckets = tuple(sorted(buckets))
        self.series: dict[tuple[str, ...], list] = {}   # labels -> [bucket counts..., sum, count]

    def observe(self, value: float, *labels: str) -> None:
        s = self.series.get(labels)
        if s is None:
            s = self.series[labels] = [0] * len(self.buckets) + [0.0, 0]
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.buckets):
            s[i] += 1
        s[-2] += value
        s[-1] += 1

    def count(self, *labels: str) -> int:
        s = self.series.get(labels)
        return 0 if s is None else s[-1]

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for labels, s in sorted(self.series.items()):
            base = list(zip(self.label_names, labels))
            cumulative = 0
            for le, n in zip(self.buckets, s):
                cumulative += n
                lines.append(f"{self.name}_bucket{_labels(base + [('le', _num(le))])} {cumulative}")
            lines.append(f"{self.name}_bucket{_labels(base + [('le', '+Inf')])} {s[-1]}")
            lines.append(f"{self.name}_sum{_labels(base)} {_num(s[-2])}")
            lines.append(f"{self.name}_count{_labels(base)} {s[-1]}")
        return lines


def _gauge(name: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
    for labels, v in samples:
        lines.append(f"{name}{_labels(labels.items())} {_num(v)}")
    return lines


class FrontendMetrics:
    """Everything /metrics reports that the HTTP layer observes itself."""

    def __init__(self, model: str):
        self.model = model
        self.requests = Counter("blink_requests_total", "Requests by endpoint and outcome.",
                                ("endpoint", "outcome"))
        self.prompt_tokens = Counter("blink_prompt_tokens_total", "Prompt tokens of accepted requests.")
        self.generation_tokens = Counter("blink_generation_tokens_total", "Output tokens delivered.")
        self.ttft = Histogram("blink_time_to_first_token_seconds",
                              "From request arrival to the first token sent.", TTFT_BUCKETS_S)
        self.tpot = Histogram("blink_time_per_output_token_seconds",
                              "Mean gap between output tokens after the first, per request.", TPOT_BUCKETS_S)
        self.e2e = Histogram("blink_e2e_request_latency_seconds",
                             "From request arrival to the last byte, per finished request.", E2E_BUCKETS_S)
        self.tokenize = Histogram("blink_tokenization_seconds",
                                  "Time to render the chat template and tokenize a prompt.", TOKENIZE_BUCKETS_S)
        # Per-stage budget from the slot's timestamps (bench/stages.py reads these three by name).
        self.queue_wait = Histogram("blink_queue_wait_seconds",
                                    "Slot submitted -> backend claims it (t_picked - t_submit); only with a "
                                    "backend on this host's monotonic clock (shm transport).", QUEUE_BUCKETS_S)
        self.prefill = Histogram("blink_prefill_seconds",
                                 "Backend claims the slot -> first token (t_first - t_picked, backend clock).",
                                 TTFT_BUCKETS_S)
        self.decode = Histogram("blink_decode_seconds",
                                "First token -> latest token the frontend saw (t_last - t_first, backend clock).",
                                E2E_BUCKETS_S)

    def outcome(self, endpoint: str, outcome: str) -> None:
        self.requests.inc(endpoint, outcome)

    def observe_stages(self, t_submit_ns: int, t_picked_ns: int, t_first_ns: int, t_last_ns: int,
                       shares_clock: bool) -> None:
        """Queue wait, prefill and decode of one finished request, from its slot's timestamps.

        A zero stamp means the stage never happened (cancelled before the claim, no token yet)
        and a negative span means the stamps are not comparable: neither is observed. Queue wait
        mixes the frontend's clock (t_submit) with the backend's (t_picked), so it is observed
        only when both are this host's CLOCK_MONOTONIC (`shares_clock`: shm transport); with a
        remote backend (verbs) the difference of two machines' clocks is meaningless.
        """
        if t_picked_ns <= 0:
            return
        if shares_clock and 0 < t_submit_ns <= t_picked_ns:
            self.queue_wait.observe((t_picked_ns - t_submit_ns) / 1e9)
        if t_first_ns < t_picked_ns:   # also t_first_ns == 0: no token was generated
            return
        self.prefill.observe((t_first_ns - t_picked_ns) / 1e9)
        if t_last_ns >= t_first_ns:
            self.decode.observe((t_last_ns - t_first_ns) / 1e9)

    def render(self, stats: dict | None, health, supervisor: dict | None = None) -> str:
        """Prometheus text; `stats` from RingClient.stats(), `health` a BackendHealth (or None),
        `supervisor` {process name: supervisor_state.ChildState} from `blink serve` (or None)."""
        lines: list[str] = []
        for metric in (self.requests, self.prompt_tokens, self.generation_tokens,
                       self.ttft, self.tpot, self.e2e, self.tokenize, self.queue_wait, self.prefill,
                       self.decode):
            lines += metric.render()
        stats = stats or {}
        slots = stats.get("slots") or {}
        lines += _gauge("blink_slots", "Ring slots by state.",
                        [({"state": str(k)}, float(v)) for k, v in sorted(slots.items())])
        for key, name, help_text in (
                ("queue_depth", "blink_queue_depth", "Requests waiting for a free slot."),
                ("inflight", "blink_requests_inflight", "Requests with a listener, holding a slot."),
                ("held_slots", "blink_held_slots", "Slots this frontend submitted and has not reset yet."),
                ("output_arena_free_tokens", "blink_output_arena_free_tokens", "Output arena tokens free."),
                ("prompt_arena_free_tokens", "blink_prompt_arena_free_tokens", "Prompt arena tokens free."),
                ("kv_blocks_total", "blink_kv_blocks_total", "KV cache blocks in the daemon's pool (0: not reported)."),
                ("kv_blocks_free", "blink_kv_blocks_free", "KV cache blocks free after the daemon's latest step.")):
            if key in stats:
                lines += _gauge(name, help_text, [({}, float(stats[key]))])
        if stats.get("prefix_cache"):
            lines += _prefix_cache(stats["prefix_cache"])
        if "polls_total" in stats:
            lines += ["# HELP blink_ring_polls_total Token reader polls of the ring (each one bulk read).",
                      "# TYPE blink_ring_polls_total counter",
                      f"blink_ring_polls_total {_num(float(stats['polls_total']))}"]
        if health is not None:
            up = 1.0 if health.healthy else 0.0
            lines += _gauge("blink_backend_up", "1 when the backend is READY with a fresh heartbeat.", [({}, up)])
            age = health.heartbeat_age_s
            lines += _gauge("blink_backend_heartbeat_age_seconds", "Seconds since the backend's last beat.",
                            [({}, age if age is not None else math.inf)])
            lines += _gauge("blink_backend_epoch", "Daemon restarts seen (backend_epoch).",
                            [({}, float(health.backend_epoch))])
        if supervisor:
            lines += _restarts(supervisor)
        return "\n".join(lines) + "\n"


def _prefix_cache(pc: dict) -> list[str]:
    """The daemon's prefix cache (ring header counters since it started): admitted tokens and
    blocks found cached (hits) or computed (misses), and the blocks holding a cache entry."""
    lines = []
    for outcome in ("hits", "misses"):
        name = f"blink_prefix_cache_{outcome}_total"
        what = "found in the prefix cache" if outcome == "hits" else "not found in the prefix cache (computed)"
        lines += [f"# HELP {name} Admitted tokens / KV blocks {what}, by unit.", f"# TYPE {name} counter"]
        key = "hit" if outcome == "hits" else "miss"
        lines += [f'{name}{{unit="{unit}"}} {int(pc[f"{key}_{unit}"])}' for unit in ("tokens", "blocks")]
    return lines + _gauge("blink_prefix_cache_blocks", "KV blocks holding a prefix-cache entry (held or evictable).",
                          [({}, float(pc["kv_blocks_cached"]))])


def _restarts(children: dict) -> list[str]:
    """`blink serve`'s restart counters, and seconds since each child's latest (re)start."""
    lines = []
    for process, name in (("gpu-daemon", "blink_daemon_restarts_total"), ("frontend", "blink_frontend_restarts_total")):
        if process in children:
            lines += [f"# HELP {name} Restarts of the {process} by blink serve after it died.",
                      f"# TYPE {name} counter", f"{name} {children[process].restarts}"]
    now = time.time()
    lines += _gauge("blink_seconds_since_last_restart",
                    "Seconds since blink serve last started this process (its first start counts).",
                    [({"process": p}, max(0.0, now - c.started_unix_s)) for p, c in sorted(children.items())])
    return lines
