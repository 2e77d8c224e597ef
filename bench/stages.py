"""The per-stage time budget, read from a server's Prometheus /metrics.

    GET /metrics before a level -> parse_histograms() -> {name: (sum_s, count)}
    GET /metrics after it       -> same
    stage_budget(before, after) -> {stage: mean seconds per request in the level,
                                    or None when the server exposes no such histogram}

Stages and the histogram names that measure them (the first one present wins):
tokenize, queue wait (request accepted -> backend picks it up), prefill (picked
up -> first token), decode (first token -> last token), plus TTFT and E2E as the
server itself sees them, for comparison with the client's numbers.
"""
from __future__ import annotations

import math
import re

STAGES: dict[str, tuple[str, ...]] = {
    "tokenize": ("blink_tokenization_seconds", "vllm:request_tokenization_seconds"),
    "queue_wait": ("blink_queue_wait_seconds", "blink_request_queue_time_seconds", "blink_queue_time_seconds",
                   "vllm:request_queue_time_seconds"),
    "prefill": ("blink_prefill_seconds", "blink_request_prefill_time_seconds", "blink_prefill_time_seconds",
                "vllm:request_prefill_time_seconds"),
    "decode": ("blink_decode_seconds", "blink_request_decode_time_seconds", "blink_decode_time_seconds",
               "vllm:request_decode_time_seconds"),
    "server_ttft": ("blink_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
    "server_e2e": ("blink_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds"),
}

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_histograms(text: str) -> dict[str, tuple[float, float]]:
    """{histogram name: (sum, count)} summed over label sets, from Prometheus text."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        name, value = m.group(1), m.group(3)
        try:
            v = float(value)
        except ValueError:
            continue
        if name.endswith("_sum"):
            base = name[:-4]
            sums[base] = sums.get(base, 0.0) + v
        elif name.endswith("_count"):
            base = name[:-6]
            counts[base] = counts.get(base, 0.0) + v
    return {k: (sums[k], counts[k]) for k in sums if k in counts}


def stage_budget(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict:
    """Mean seconds per observation of each stage between two scrapes; None where not exposed."""
    out: dict[str, dict | None] = {}
    for stage, names in STAGES.items():
        name = next((n for n in names if n in after), None)
        if name is None:
            out[stage] = None
            continue
        s1, c1 = after[name]
        s0, c0 = before.get(name, (0.0, 0.0))
        n = c1 - c0
        out[stage] = {"metric": name, "count": n, "mean_ms": (s1 - s0) / n * 1000.0 if n > 0 else math.nan}
    return out


def missing_stages(budgets: list[dict]) -> list[str]:
    """Stages no scrape in `budgets` exposed."""
    return [s for s in STAGES if all(b.get(s) is None for b in budgets)] if budgets else list(STAGES)
