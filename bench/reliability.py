"""Shared parts of the reliability benchmarks (overload.py, soak.py): the server under test,
one classified request, and the watchers that run beside the load.

    ServeUnderTest: `blink serve` on a free port and a private ring -> pids of the
        frontend and the daemon (for resident memory) -> stop() (SIGTERM, exit code)
    send(session, base, kind, ...) -> Outcome: every request ends in exactly one
        class ("ok", "rejected_429", "unavailable_503", "error_event", "bad_request",
        "disconnected_by_us", ...) or in "lost" (no answer within the client timeout,
        a 5xx that is not 503/504, a broken stream the server did not end)
    HealthProbe: GET /health every interval; answered, latency, status
    MemorySampler: VmRSS of the frontend and the daemon from /proc
    settle(base): /metrics once nothing is queued, held or in flight, and the daemon's
        KV-block words in the ring header (layout v2) say every block is free -> the leak check

Everything here is plain asyncio + aiohttp and /proc; nothing is mocked.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]

# Outcome classes. LOST ones are failures of the server: it never ended the request properly.
OK = "ok"
LOST = ("lost_timeout", "lost_5xx", "lost_broken_stream", "lost_connection")


def blink_cmd() -> list[str]:
    script = pathlib.Path(sys.executable).parent / "blink"
    return [str(script)] if script.exists() else [sys.executable, "-m", "dpu_frontend.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout_s: float = 5.0, headers: dict | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def rss_mib(pid: int) -> float | None:
    """Resident set size of `pid` in MiB (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def children_of(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the direct children of `pid`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    out.append((int(entry), f.read().replace(b"\0", b" ").decode(errors="replace")))
        except (OSError, ValueError, IndexError):
            continue
    return out


class ServeUnderTest:
    """`blink serve` as the user runs it, on a free port and a private ring."""

    def __init__(self, ring: str, args: list[str], log_path: pathlib.Path, ready_timeout_s: float = 600.0,
                 headers: dict[str, str] | None = None):
        self.headers = headers or {}   # sent with /health and /metrics (an API key on every route)
        self.port = free_port()
        self.ring = ring
        self.base = f"http://127.0.0.1:{self.port}"
        self.argv = [*blink_cmd(), "serve", "--port", str(self.port), "--ring", ring, *args]
        self.log_path = log_path
        self._log = open(log_path, "w")
        from dpu_frontend.serve import _die_with_parent   # the server goes when this process goes
        self.proc = subprocess.Popen(self.argv, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + ready_timeout_s
        while http_get(self.base + "/health", 2, self.headers)[0] != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"blink serve did not become healthy; see {log_path}")
            time.sleep(0.2)
        kids = children_of(self.proc.pid)
        self.frontend_pid = next(p for p, cmd in kids if " frontend " in cmd + " ")
        self.daemon_pid = next(p for p, cmd in kids if " gpu-daemon " in cmd + " ")

    def rss(self) -> dict[str, float | None]:
        return {"frontend": rss_mib(self.frontend_pid), "daemon": rss_mib(self.daemon_pid)}

    def metrics(self) -> dict[str, float]:
        status, body = http_get(self.base + "/metrics", headers=self.headers)
        return parse_metrics(body.decode()) if status == 200 else {}

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = self.proc.wait()
        self._log.close()
        return rc


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


def backend_kv_blocks(ring: str) -> tuple[int, int] | None:
    """(total, free) KV blocks as the daemon publishes them in the ring header; None where the
    ring has no such words (layout v1) or the daemon reports none."""
    from shared_layout.layout import HEADER, HEADER_DTYPE
    if "kv_blocks_total" not in HEADER_DTYPE.names:
        return None
    try:
        with open(f"/dev/shm/{ring}", "rb") as f:
            header = np.frombuffer(f.read(HEADER.size), HEADER_DTYPE, 1)[0]
    except OSError:
        return None
    total, free = int(header["kv_blocks_total"]), int(header["kv_blocks_free"])
    return (total, free) if total else None


def leak_check(m: dict[str, float], geometry: dict[str, int], kv: tuple[int, int] | None = None) -> dict:
    """What /metrics (and the ring header's KV words) say is still held once the server is idle;
    `clean` when nothing is."""
    slots = {k[len('blink_slots{state="'):-2]: v for k, v in m.items() if k.startswith("blink_slots{")}
    held = {
        "non_empty_slots": sum(v for s, v in slots.items() if s != "EMPTY"),
        "held_slots": m.get("blink_held_slots", -1),
        "inflight": m.get("blink_requests_inflight", -1),
        "queue_depth": m.get("blink_queue_depth", -1),
        "prompt_arena_used_tokens": geometry["prompt_arena_tokens"] - m.get("blink_prompt_arena_free_tokens", -1),
        "output_arena_used_tokens": geometry["output_arena_tokens"] - m.get("blink_output_arena_free_tokens", -1),
    }
    if kv is not None:
        held["kv_blocks_used"] = kv[0] - kv[1]
    return {"slots_by_state": slots, **held, "kv_blocks_total": kv[0] if kv else None,
            "clean": all(v == 0 for v in held.values())}


async def settle(serve: ServeUnderTest, geometry: dict[str, int], timeout_s: float = 60.0) -> tuple[dict, float]:
    """Wait until /metrics shows nothing held; (leak check, seconds it took)."""
    t0 = time.monotonic()
    while True:
        check = leak_check(await asyncio.to_thread(serve.metrics), geometry, backend_kv_blocks(serve.ring))
        if check["clean"] or time.monotonic() - t0 > timeout_s:
            return check, time.monotonic() - t0
        await asyncio.sleep(0.25)


@dataclasses.dataclass
class Outcome:
    kind: str                 # what was asked (stream, plain, disconnect, ...)
    outcome: str              # the class it ended in
    t_send_s: float           # loop clock
    e2e_s: float | None = None
    ttft_s: float | None = None
    status: int = 0
    retry_after: str | None = None
    detail: str = ""

    @property
    def lost(self) -> bool:
        return self.outcome in LOST


def _error_class(status: int) -> str:
    return {400: "bad_request", 401: "unauthorized", 404: "bad_request", 413: "too_large",
            429: "rejected_429", 503: "unavailable_503", 504: "deadline_504", 408: "deadline_408"
            }.get(status, "lost_5xx" if status >= 500 else f"status_{status}")


async def send(session: aiohttp.ClientSession, base: str, kind: str, body: dict | bytes, *, path: str = "/v1/completions",
               timeout_s: float = 300.0, disconnect_after_chunks: int | None = None) -> Outcome:
    """One request, classified. Never raises. `disconnect_after_chunks`: hang up after that many
    SSE events (0: right after the headers)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    out = Outcome(kind, "lost_timeout", t0)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(base + path, data=data, headers={"Content-Type": "application/json"}) as r:
                out.status = r.status
                out.retry_after = r.headers.get("Retry-After")
                if r.status != 200:
                    await r.read()
                    out.outcome = _error_class(r.status)
                    if r.status in (429, 503) and out.retry_after is None:
                        out.outcome = "no_retry_after"
                elif r.headers.get("Content-Type", "").startswith("text/event-stream"):
                    await _read_stream(r, out, loop, t0, disconnect_after_chunks)
                else:
                    reply = await r.json()
                    out.outcome = OK if reply["choices"][0]["finish_reason"] in ("stop", "length") else "odd_finish"
        out.e2e_s = loop.time() - t0
    except TimeoutError:
        out.outcome = "lost_timeout"
    except (ValueError, KeyError, IndexError, TypeError) as e:   # a reply that is not what the API promises
        out.outcome, out.detail = "lost_broken_stream", f"{type(e).__name__}: {e}"[:120]
    except (aiohttp.ClientError, ConnectionError) as e:
        if out.outcome != "disconnected_by_us":
            out.outcome, out.detail = "lost_connection", type(e).__name__
    return out


async def _read_stream(r: aiohttp.ClientResponse, out: Outcome, loop, t0: float, disconnect_after: int | None) -> None:
    events = 0
    buf = b""
    finish = None
    error = None
    done = False
    if disconnect_after == 0:
        out.outcome = "disconnected_by_us"
        r.close()
        return
    async for chunk in r.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if not event.startswith(b"data: "):
                continue
            payload = event[6:]
            if payload == b"[DONE]":
                done = True
                continue
            obj = json.loads(payload)
            if "error" in obj:
                error = obj["error"]
                continue
            if out.ttft_s is None:
                out.ttft_s = loop.time() - t0
            events += 1
            for c in obj.get("choices") or ():
                finish = c.get("finish_reason") or finish
            if disconnect_after is not None and events >= disconnect_after:
                out.outcome = "disconnected_by_us"
                r.close()
                return
    if not done:
        out.outcome = "lost_broken_stream"
    elif error is not None:
        code = error.get("code")
        out.outcome = {503: "error_event_503", 504: "deadline_504"}.get(code, "error_event_other")
        out.detail = str(error.get("message", ""))[:120]
    else:
        out.outcome = OK if finish in ("stop", "length") else "odd_finish"


class _Periodic:
    """Calls `_sample` every `interval_s` until stop(); subclasses append to `samples`."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._stop = asyncio.Event()

    async def _every(self, sample) -> None:
        while not self._stop.is_set():
            await sample()
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval_s)
            except TimeoutError:
                pass

    def stop(self) -> None:
        self._stop.set()


class HealthProbe(_Periodic):
    """GET /health every `interval_s` in a thread (the event loop's own load must not delay it)."""

    def __init__(self, base: str, interval_s: float = 0.5, timeout_s: float = 5.0):
        super().__init__(interval_s)
        self.base, self.timeout_s = base, timeout_s
        self.samples: list[tuple[float, int, float]] = []   # (t, status, latency_s)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()

        async def probe() -> None:
            t = loop.time()
            status, _ = await asyncio.to_thread(http_get, self.base + "/health", self.timeout_s)
            self.samples.append((t, status, loop.time() - t))
        await self._every(probe)

    def summary(self) -> dict:
        lat = np.array([s[2] for s in self.samples]) if self.samples else np.zeros(1)
        statuses = {}
        for _, st, _ in self.samples:
            statuses[str(st)] = statuses.get(str(st), 0) + 1
        return {"probes": len(self.samples), "by_status": statuses,
                "unanswered": statuses.get("0", 0), "latency_p50_s": float(np.percentile(lat, 50)),
                "latency_p99_s": float(np.percentile(lat, 99)), "latency_max_s": float(lat.max())}


class MemorySampler(_Periodic):
    """Resident memory of the frontend and the daemon every `interval_s`."""

    def __init__(self, serve: ServeUnderTest, interval_s: float = 2.0):
        super().__init__(interval_s)
        self.serve = serve
        self.samples: list[tuple[float, float | None, float | None]] = []   # (t, frontend MiB, daemon MiB)

    async def run(self, t0: float) -> None:
        loop = asyncio.get_running_loop()

        async def sample() -> None:
            r = self.serve.rss()
            self.samples.append((loop.time() - t0, r["frontend"], r["daemon"]))
        await self._every(sample)

    def summary(self, warmup_s: float) -> dict:
        """Peak, and the growth from the end of warm-up to the end (MiB) per process."""
        out = {}
        for i, name in ((1, "frontend"), (2, "daemon")):
            series = [(t, s[i]) for s in self.samples for t in [s[0]] if s[i] is not None]
            if not series:
                continue
            after = [v for t, v in series if t >= warmup_s] or [series[-1][1]]
            first = after[:max(1, len(after) // 10)]
            last = after[-max(1, len(after) // 10):]
            t_end = series[-1][0]
            thirds = [[v for t, v in series if lo <= t <= hi] or [series[-1][1]]
                      for lo, hi in ((warmup_s, warmup_s + (t_end - warmup_s) / 3),
                                     (t_end - (t_end - warmup_s) / 3, t_end))]
            out[name] = {"start_mib": round(series[0][1], 1), "after_warmup_mib": round(float(np.median(first)), 1),
                         "end_mib": round(float(np.median(last)), 1), "peak_mib": round(max(v for _, v in series), 1),
                         "growth_after_warmup_mib": round(float(np.median(last) - np.median(first)), 1),
                         # growth within the first and the last third after warm-up: a cache filling up
                         # slows down (last << first), a leak keeps its pace
                         "growth_first_third_mib": round(float(thirds[0][-1] - thirds[0][0]), 1),
                         "growth_last_third_mib": round(float(thirds[1][-1] - thirds[1][0]), 1)}
        return out


def count_outcomes(outcomes: list[Outcome]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.outcome] = counts.get(o.outcome, 0) + 1
    return dict(sorted(counts.items()))


def percentiles(values: list[float], ps=(50, 90, 99)) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in ps}
    arr = np.array(values)
    return {f"p{p}": round(float(np.percentile(arr, p)), 4) for p in ps}


def new_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=None))


def prompt_ids(n: int, seed: int, vocab: int = 49152) -> list[int]:
    """`n` token ids of ordinary text-ish range (no special tokens: ids >= 100)."""
    rng = np.random.default_rng(seed)
    return rng.integers(100, min(vocab, 20000), n).tolist()


def ring_geometry(args_slots: int | None, prompt_arena: int | None, output_arena: int | None) -> dict[str, int]:
    from shared_layout.layout import DEFAULT_OUTPUT_ARENA_TOKENS, DEFAULT_PROMPT_ARENA_TOKENS
    return {"prompt_arena_tokens": prompt_arena or DEFAULT_PROMPT_ARENA_TOKENS,
            "output_arena_tokens": output_arena or DEFAULT_OUTPUT_ARENA_TOKENS, "slots": args_slots or 0}


def write_result(result: dict, out: pathlib.Path, markdown) -> int:
    """<out>.json + <out>.md (markdown(result)), the summary printed; exit 0 when every check passed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    text = markdown(result)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0 if result["verdict"]["all_passed"] else 1

