"""Offered load: arrival schedules and one level of a sweep.

    LoadConfig (mode, levels, duration per level, timeout, warm-up)
    level (req/s or concurrency) -> arrival_offsets() -> send times in seconds
    run_level(): requests from the workload, sent on schedule (rate modes) or by
        N closed-loop workers (concurrency mode) through client.send_completion,
        all awaited -> LevelResult (records + duration)

Rate modes send round(rate * duration_s) requests (at least `min_requests`):
Poisson (exponential gaps; gamma gaps with shape `burstiness` when it is not 1,
as vLLM's --burstiness) or constant (gaps of exactly 1/rate). Concurrency mode
keeps N requests in flight for duration_s, then lets the last ones finish.
Every request is bounded by timeout_s, and the level by duration_s + drain_s:
requests still running then are cancelled (the connection closes, so the server
drops them) and count as timeouts. The level's duration is first send -> last
completion (or the cut), as `vllm bench serve` measures its benchmark duration.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable, Sequence

import aiohttp
import numpy as np

from .client import Endpoint, send_completion
from .metrics import RequestRecord
from .workload import WorkRequest

MODES = ("poisson", "constant", "concurrency")


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    mode: str = "poisson"
    levels: tuple[float, ...] = (1.0, 2.0, 4.0)
    duration_s: float = 20.0          # per level
    timeout_s: float = 60.0           # per request; counted as a failure
    drain_s: float | None = None      # after duration_s, wait this long for stragglers, then cut
                                      # them (counted as timeouts); None: up to timeout_s
    warmup_requests: int = 4          # sent before the sweep, not measured
    min_requests: int = 4             # per level, rate modes
    burstiness: float = 1.0           # gamma shape of Poisson gaps (1 = Poisson)
    seed: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got '{self.mode}'")
        if not self.levels:
            raise ValueError("at least one load level is needed")
        if any(not lv > 0 for lv in self.levels):
            raise ValueError(f"load levels must be > 0, got {list(self.levels)}")
        if self.mode == "concurrency" and any(int(lv) != lv for lv in self.levels):
            raise ValueError(f"concurrency levels must be whole numbers, got {list(self.levels)}")
        for name in ("duration_s", "timeout_s", "burstiness"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.drain_s is not None and self.drain_s < 0:
            raise ValueError(f"drain_s must be >= 0, got {self.drain_s}")
        if self.warmup_requests < 0 or self.min_requests < 1:
            raise ValueError("warmup_requests must be >= 0 and min_requests >= 1")

    def requests_for(self, level: float) -> int:
        """How many requests a level sends (rate modes) or an upper bound to prepare (concurrency)."""
        if self.mode == "concurrency":
            # Enough for N workers that each finish a request every ~0.05 s; cycled if short.
            return max(self.min_requests, int(level) * 4)
        return max(self.min_requests, int(round(level * self.duration_s)))


def arrival_offsets(mode: str, rate: float, n: int, rng: np.random.Generator, burstiness: float = 1.0) -> np.ndarray:
    """Send times (s from the level start) of n requests at `rate` req/s."""
    if mode == "constant":
        return np.arange(n, dtype=np.float64) / rate
    if mode != "poisson":
        raise ValueError(f"no arrival schedule for mode '{mode}'")
    # Gamma(shape=k, scale=1/(k*rate)) has mean 1/rate; k = 1 is the exponential (Poisson).
    gaps = rng.gamma(burstiness, 1.0 / (burstiness * rate), size=n)
    gaps[0] = 0.0  # the first request goes at the level start
    return np.cumsum(gaps)


@dataclasses.dataclass
class LevelResult:
    level: float
    records: list[RequestRecord]
    duration_s: float
    t_start_unix: float


async def run_level(session: aiohttp.ClientSession, ep: Endpoint, cfg: LoadConfig, level: float,
                    work: Sequence[WorkRequest], count_tokens: Callable[[str], int] | None = None,
                    on_done: Callable[[RequestRecord], None] | None = None) -> LevelResult:
    """Drive one offered-load level to completion."""
    rng = np.random.default_rng(cfg.seed + int(level * 1000))
    t_unix = time.time()
    t0 = time.perf_counter()
    records: list[RequestRecord] = []

    async def one(req: WorkRequest) -> None:
        t_send = time.perf_counter()
        try:
            rec = await send_completion(session, ep, req, cfg.timeout_s, count_tokens)
        except asyncio.CancelledError:
            rec = RequestRecord(prompt_tokens=req.prompt_tokens, max_tokens=req.output_tokens, t_send_s=t_send,
                                timed_out=True, error=f"cut at the end of the level (drain {cfg.drain_s:g} s)")
        rec.t_send_s -= t0
        records.append(rec)
        if on_done:
            on_done(rec)

    if cfg.mode == "concurrency":
        deadline = t0 + cfg.duration_s
        next_i = 0

        async def worker() -> None:
            nonlocal next_i
            while time.perf_counter() < deadline:
                req = work[next_i % len(work)]
                next_i += 1
                await one(req)

        tasks = [asyncio.create_task(worker()) for _ in range(int(level))]
    else:
        n = cfg.requests_for(level)
        offsets = arrival_offsets(cfg.mode, level, n, rng, cfg.burstiness)
        tasks = []
        for i, off in enumerate(offsets):
            delay = t0 + float(off) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(work[i % len(work)])))
    if cfg.drain_s is None:
        await asyncio.gather(*tasks)
    else:
        cut = t0 + cfg.duration_s + cfg.drain_s - time.perf_counter()
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, cut))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    duration = time.perf_counter() - t0
    records.sort(key=lambda r: r.t_send_s)
    return LevelResult(level, records, duration, t_unix)


async def warm_up(session: aiohttp.ClientSession, ep: Endpoint, cfg: LoadConfig, work: Sequence[WorkRequest],
                  count_tokens: Callable[[str], int] | None = None) -> list[RequestRecord]:
    """Send cfg.warmup_requests (two at a time) and discard their timings."""
    out: list[RequestRecord] = []
    for i in range(0, cfg.warmup_requests, 2):
        batch = [work[j % len(work)] for j in range(i, min(i + 2, cfg.warmup_requests))]
        out += await asyncio.gather(*(send_completion(session, ep, r, cfg.timeout_s, count_tokens)
                                      for r in batch))
    return out


def new_session(max_connections: int = 1024) -> aiohttp.ClientSession:
    """A client session without connection limits below the sweep's own concurrency.

    One connection per request (force_close): servers differ in how they expire idle
    keep-alive connections (llama-server closes them under a reusing client, which
    then fails with "Server disconnected"); a fresh loopback connection costs every
    system the same fraction of a millisecond.
    """
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max_connections, force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=None))
