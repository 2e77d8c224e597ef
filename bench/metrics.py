"""Client-side serving metrics, defined exactly as `vllm bench serve` defines them.

    RequestRecord (one per request, from client.py) -> summarize(records, duration_s, slo)
        -> LevelSummary (TTFT, TPOT, ITL, E2E in ms: mean/std/p50/p90/p95/p99/p99.9;
           request and token throughput; goodput; failures and timeouts)

Definitions (vllm/benchmarks/serve.py, calculate_metrics):
- TTFT: request sent -> first streamed chunk that carries text.
- ITL: the gaps between successive streamed chunks after the first (all of
  every successful request's gaps, pooled).
- E2E: request sent -> last byte of the stream.
- TPOT of a request: (E2E - TTFT) / (output tokens - 1), only for requests with
  more than one output token; pooled over requests.
- Throughput: completed requests / duration, output tokens / duration, and
  (prompt + output tokens) / duration, where duration runs from the first send
  to the last completion of the level.
- Goodput: completed requests meeting every given SLO (TTFT <= slo, TPOT <= slo,
  E2E <= slo; a one-token request counts TPOT = 0) / duration.
- Percentiles are numpy's linear interpolation (np.percentile), in ms.
Failed requests (HTTP error, broken stream, timeout) count only as failures.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

import numpy as np

PERCENTILES = (50.0, 90.0, 95.0, 99.0, 99.9)


@dataclasses.dataclass
class RequestRecord:
    """What the client saw of one request. Times are seconds on the client's perf_counter."""
    prompt_tokens: int                   # the workload's exact prompt length
    max_tokens: int                      # the requested output length
    t_send_s: float = 0.0                # perf_counter at send (relative to the level start in output)
    ttft_s: float | None = None          # send -> first chunk with text
    e2e_s: float | None = None           # send -> end of stream
    itl_s: list[float] = dataclasses.field(default_factory=list)   # gaps between successive chunks
    output_tokens: int = 0               # usage.completion_tokens, else the re-tokenized text
    server_prompt_tokens: int | None = None   # usage.prompt_tokens, when the server reports it
    success: bool = False
    timed_out: bool = False
    error: str | None = None
    finish_reason: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None for one-token or failed requests."""
        if not self.success or self.output_tokens <= 1 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclasses.dataclass(frozen=True)
class Slo:
    """Goodput SLOs in ms; None leaves that metric unconstrained (vLLM's --goodput ttft:.. tpot:..)."""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))


@dataclasses.dataclass(frozen=True)
class Distribution:
    """mean/std/percentiles of one latency metric, in ms; all NaN when there are no samples."""
    n: int
    mean_ms: float
    std_ms: float
    percentiles_ms: dict[float, float]

    @property
    def p50_ms(self) -> float:
        return self.percentiles_ms[50.0]

    @property
    def p99_ms(self) -> float:
        return self.percentiles_ms[99.0]

    def as_dict(self) -> dict:
        d = {"n": self.n, "mean_ms": self.mean_ms, "std_ms": self.std_ms}
        d.update({f"p{_pname(p)}_ms": v for p, v in self.percentiles_ms.items()})
        return d


def _pname(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def distribution(samples_s: Sequence[float], percentiles: Iterable[float] = PERCENTILES) -> Distribution:
    """Summary of samples given in seconds, reported in ms."""
    percentiles = tuple(percentiles)
    if len(samples_s) == 0:
        nan = math.nan
        return Distribution(0, nan, nan, {p: nan for p in percentiles})
    a = np.asarray(samples_s, dtype=np.float64) * 1000.0
    return Distribution(len(a), float(a.mean()), float(a.std()),
                        {p: float(np.percentile(a, p)) for p in percentiles})


@dataclasses.dataclass(frozen=True)
class LevelSummary:
    """One offered-load level of one run."""
    requests: int                 # sent (measured, after warm-up)
    completed: int
    failed: int                   # includes timeouts
    timeouts: int
    duration_s: float
    total_prompt_tokens: int      # of completed requests
    total_output_tokens: int      # of completed requests
    request_throughput: float     # completed req/s
    output_throughput: float      # output tokens/s
    total_token_throughput: float  # (prompt + output) tokens/s
    goodput: float | None         # req/s meeting the SLOs; None without SLOs
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("requests", "completed", "failed", "timeouts", "duration_s",
                                           "total_prompt_tokens", "total_output_tokens",
                                           "request_throughput", "output_throughput",
                                           "total_token_throughput", "goodput")}
        for name in ("ttft", "tpot", "itl", "e2e"):
            d[name] = getattr(self, name).as_dict()
        return d


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo | None = None) -> LevelSummary:
    """vLLM's calculate_metrics over one level's measured requests."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in records if r.success]
    ttfts = [r.ttft_s for r in ok]
    e2es = [r.e2e_s for r in ok]
    tpots = [t for r in ok if (t := r.tpot_s) is not None]
    itls = [g for r in ok for g in r.itl_s]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    goodput = None
    if slo is not None and slo.is_set():
        goodput = sum(1 for r in ok if meets_slo(r, slo)) / duration_s
    return LevelSummary(
        requests=len(records), completed=len(ok), failed=len(records) - len(ok),
        timeouts=sum(1 for r in records if r.timed_out), duration_s=duration_s,
        total_prompt_tokens=prompt_tokens, total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration_s, output_throughput=output_tokens / duration_s,
        total_token_throughput=(prompt_tokens + output_tokens) / duration_s, goodput=goodput,
        ttft=distribution(ttfts), tpot=distribution(tpots), itl=distribution(itls), e2e=distribution(e2es))


def meets_slo(r: RequestRecord, slo: Slo) -> bool:
    """vLLM's goodput test for one completed request (a one-token request has TPOT 0)."""
    if not r.success:
        return False
    checks = ((slo.ttft_ms, r.ttft_s), (slo.tpot_ms, r.tpot_s or 0.0), (slo.e2e_ms, r.e2e_s))
    return all(limit is None or value * 1000.0 <= limit for limit, value in checks)


def parse_slo(spec: str | None) -> Slo:
    """'ttft:500,tpot:50' (ms; also space separated, like vLLM's --goodput) -> Slo."""
    if not spec:
        return Slo()
    values: dict[str, float] = {}
    for part in spec.replace(",", " ").split():
        key, sep, val = part.partition(":")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "tpot", "e2e", "e2el"):
            raise ValueError(f"bad SLO '{part}': expected ttft:MS, tpot:MS or e2e:MS")
        try:
            ms = float(val)
        except ValueError:
            raise ValueError(f"bad SLO '{part}': '{val}' is not a number of ms") from None
        if not ms > 0:
            raise ValueError(f"bad SLO '{part}': must be > 0 ms")
        values["e2e" if key == "e2el" else key] = ms
    return Slo(values.get("ttft"), values.get("tpot"), values.get("e2e"))
