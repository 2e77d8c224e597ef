"""Control-plane cost of the frontend: blink (frontend + null daemon over the ring) vs a bare aiohttp
SSE server that streams the same chunks with no ring behind it, measured in the same run, both
servers on the same event loop (--loop, default auto = uvloop when installed).

    orchestrator: `python -m bench.control_plane --role bare --loop L` (aiohttp, no ring) and
        saturated phase: `blink gpu-daemon --model null` + `blink frontend --loop L --expose-backend-timing`
        for each concurrency (1, 16, 64), servers alternating: a client process streams closed-loop
            /v1/completions (token-id prompt, max_tokens, ignore_eos) for --duration-s after a warm-up
            -> events/s, tokens/s, server CPU (/proc/PID/stat), and per event t_recv - t_last_ns (both
               sides stamp time.monotonic_ns: the daemon when it publishes a token, the bare server when
               it builds the chunk, or paced, at the tick that made it; the client reads the same clock)
        turnaround phase (unless --no-turnaround): the same, max_tokens 1 -> requests/s, server CPU
            per request: a request's whole round trip through each server
        paced phase (--paced-step-ms S > 0): a fresh daemon with `--step-ms S` (one token per stream
            every S ms, a real model's decode cadence) and the bare server ticking every S ms
            -> added latency per token where nothing runs at saturation
    -> bench/results/<date>-<machine>-control-plane.json and .md

Added latency per token: for blink, `t_last_ns` is the daemon's stamp of the newest token in the
chunk, so t_recv - t_last_ns is a lower bound for every token of the chunk; the older tokens of a
chunk were published after the previous chunk's t_last_ns, which gives an upper bound
(t_recv - previous t_last_ns). Both are reported (paced: one token per event, so exact). Pinned by
default (>= 2 cores; --no-pin turns it off): the daemon on the last core, the server under test
(frontend or bare) on the others, the client where --client-cpus says (default: wherever the
scheduler puts it), so the daemon's busy polling never takes the HTTP side's core.

    python -m bench.control_plane [--concurrency 1,16,64] [--duration-s 6] [--repeats 2] [--max-tokens 256]
        [--paced-step-ms 20] [--loop auto|asyncio|uvloop]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import pathlib
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


# -- the bare baseline server ------------------------------------------------------

class Ticker:
    """The bare server's stand-in for a model step: every waiting stream wakes at the same
    instant, `period_s` after the previous tick (ticks run only while someone waits), as the
    paced null daemon publishes one token to every running stream per step."""

    def __init__(self, period_s: float):
        self.period_s = period_s
        self._event: asyncio.Event | None = None

    async def wait(self) -> int:
        """Wait for the next tick; its time (time.monotonic_ns), the moment every waiting stream's
        token exists, as the daemon's publish stamp is for blink."""
        if self._event is None:
            self._event = asyncio.Event()
            asyncio.get_running_loop().call_later(self.period_s, self._fire)
        event = self._event
        await event.wait()
        return event.fired_ns

    def _fire(self) -> None:
        event, self._event = self._event, None
        event.fired_ns = time.monotonic_ns()
        event.set()


def run_bare_server(port: int, loop: str = "auto") -> None:
    """aiohttp on the same event loop as the frontend (`loop`), /v1/completions streaming
    `bench_tokens_per_event` tokens per event, chunks shaped exactly as blink's; with
    `bench_step_ms` one event per stream per shared tick of that period (paced), else as fast
    as the client takes them."""
    from aiohttp import web

    from dpu_frontend import openai_api as api
    from dpu_frontend.http_server import loop_factory
    from dpu_frontend.tokenizer import load_tokenizer

    tok = load_tokenizer("default")
    texts: dict[tuple[int, ...], str] = {}
    tickers: dict[float, Ticker] = {}

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt, n = body["prompt"], body["max_tokens"]
        per_event = max(1, int(body.get("bench_tokens_per_event", 1)))
        step_ms = float(body.get("bench_step_ms", 0))
        ticker = tickers.setdefault(step_ms, Ticker(step_ms / 1e3)) if step_ms > 0 else None
        rid, created = api.request_id("cmpl"), int(time.time())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            for i in range(0, n, per_event):
                t_tick = await ticker.wait() if ticker is not None else 0
                ids = [prompt[j % len(prompt)] for j in range(i, min(n, i + per_event))]   # the null daemon's echo
                key = tuple(ids)
                text = texts.get(key)
                if text is None:
                    text = texts[key] = tok.decode(ids)
                last = i + per_event >= n
                chunk = api.completion_chunk(rid, created, "null", text, "length" if last else None)
                t_ns = time.monotonic_ns()
                # Paced: the token exists from the tick (the wait behind the other streams' handlers
                # counts, as the wait behind the other streams' deliveries counts for blink).
                chunk["blink_timing"] = {"t_last_ns": t_tick or t_ns, "t_frontend_ns": t_ns, "n_tokens": len(ids)}
                await resp.write(api.sse(chunk))
                if ticker is None:
                    await asyncio.sleep(0)   # a streaming server yields between events
            await resp.write(api.sse(api.usage_chunk("text_completion", rid, created, "null",
                                                     api.usage(len(prompt), n))) + api.SSE_DONE)
        except ConnectionError:
            pass
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    _, factory = loop_factory(loop)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, handler_cancellation=True,
                loop=factory())


# -- the client --------------------------------------------------------------------

_TIMING = re.compile(rb'"blink_timing":\{"t_last_ns":(\d+),"t_frontend_ns":(\d+),"n_tokens":(\d+)\}')

class _SseStream(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection of the load generator, as cheap per event as Python
    allows so that the client takes as little CPU from the servers as it can: each read is
    stamped on arrival and scanned for the chunks' timing fields with one regex, without
    de-chunking or JSON parsing; a response ends at the chunked body's terminating zero-size
    chunk. Both servers under test send chunked text/event-stream bodies only."""

    TAIL = 256   # bytes kept between reads: more than one timing field, so a split one is found whole

    def __init__(self, on_event):
        self.on_event = on_event   # (t_recv_ns, t_last_ns, t_frontend_ns, n_tokens)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future | None = None
        self.buf = b""
        self.status = 0

    def connection_made(self, transport):
        self.transport = transport

    def request(self, raw: bytes) -> asyncio.Future:
        self.done = asyncio.get_running_loop().create_future()
        self.buf, self.status = b"", 0
        self.transport.write(raw)
        return self.done

    def data_received(self, data: bytes):
        t_recv = time.monotonic_ns()
        buf = self.buf + data
        if not self.status:
            head_end = buf.find(b"\r\n\r\n")
            if head_end < 0:
                self.buf = buf
                return
            self.status = int(buf[9:12])
            if self.status != 200:   # an error body: not an SSE stream; the caller counts it and reconnects
                self._finish(False)
                return
            buf = buf[head_end + 4:]
        end = 0
        for m in _TIMING.finditer(buf):
            self.on_event(t_recv, int(m[1]), int(m[2]), int(m[3]))
            end = m.end()
        if buf.endswith(b"\r\n0\r\n\r\n") or buf == b"0\r\n\r\n":
            self._finish(True)
            return
        self.buf = buf[max(end, len(buf) - self.TAIL):]

    def _finish(self, ok: bool):
        if self.done is not None and not self.done.done():
            self.done.set_result(ok)
        self.buf = b""

    def connection_lost(self, exc):
        if self.done is not None and not self.done.done():
            self.done.set_result(False)


async def drive(url: str, concurrency: int, warmup_s: float, duration_s: float, max_tokens: int,
                prompt_tokens: int, tokens_per_event: int = 1, step_ms: float = 0.0) -> dict:
    """Closed loop: `concurrency` workers, each streaming one request after another over its own
    keep-alive connection (_SseStream)."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    host, port, path = u.hostname, u.port or 80, u.path or "/"
    loop = asyncio.get_running_loop()
    t0 = time.monotonic_ns()
    print("started", flush=True)   # the orchestrator times its CPU samples from this line
    start_ns = t0 + int(warmup_s * 1e9)
    end_ns = start_ns + int(duration_s * 1e9)
    events = tokens = requests = failures = 0
    lat_lo: list[int] = []
    lat_hi: list[int] = []
    lat_ring: list[int] = []   # daemon publish -> frontend handler has the batch
    lat_http: list[int] = []   # frontend handler -> client receipt

    async def worker(w: int):
        nonlocal requests, failures
        prev_last = None   # the previous event's t_last_ns in this request

        def on_event(t_recv: int, t_last: int, t_front: int, n_tok: int):
            nonlocal events, tokens, prev_last
            if start_ns <= t_recv < end_ns:
                events += 1
                tokens += n_tok
                lat_lo.append(t_recv - t_last)
                lat_hi.append(t_recv - (prev_last if prev_last is not None else t_last))
                lat_ring.append(t_front - t_last)
                lat_http.append(t_recv - t_front)
            prev_last = t_last

        conn: _SseStream | None = None
        k = 0
        try:
            while time.monotonic_ns() < end_ns:
                if conn is None or conn.transport.is_closing():
                    try:
                        _, conn = await loop.create_connection(lambda: _SseStream(on_event), host, port)
                    except OSError:
                        failures += 1
                        conn = None
                        await asyncio.sleep(0.01)
                        continue
                prompt = [1000 + (w * 7919 + k * 104729 + i * 31) % 40000 for i in range(prompt_tokens)]
                k += 1
                body = {"model": "null", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}
                if tokens_per_event > 1:   # understood by the bare server only
                    body["bench_tokens_per_event"] = tokens_per_event
                if step_ms > 0:            # the bare server's pacing (blink's daemon paces itself)
                    body["bench_step_ms"] = step_ms
                data = json.dumps(body).encode()
                raw = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                       f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data
                prev_last = None
                remaining = (end_ns - time.monotonic_ns()) / 1e9
                try:
                    ok = await asyncio.wait_for(asyncio.shield(conn.request(raw)), max(0.0, remaining))
                except asyncio.TimeoutError:
                    break   # the window is over mid-stream
                if ok:
                    if time.monotonic_ns() < end_ns:
                        requests += 1
                else:
                    failures += 1
                    conn.transport.close()
                    conn = None
                    await asyncio.sleep(0.01)
        finally:
            if conn is not None:
                conn.transport.close()

    await asyncio.gather(*(worker(w) for w in range(concurrency)))

    def pct(xs: list[int], q: float) -> float | None:
        if not xs:
            return None
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] / 1e6

    return {"concurrency": concurrency, "duration_s": duration_s, "events": events, "tokens": tokens,
            "requests_completed": requests, "failures": failures,
            "events_per_s": events / duration_s, "tokens_per_s": tokens / duration_s,
            "tokens_per_event": tokens / events if events else None,
            "latency_ms": {"p50": pct(lat_lo, 0.5), "p99": pct(lat_lo, 0.99),
                           "mean": statistics.fmean(lat_lo) / 1e6 if lat_lo else None},
            "latency_upper_ms": {"p50": pct(lat_hi, 0.5), "p99": pct(lat_hi, 0.99)},
            "latency_ring_to_handler_ms": {"p50": pct(lat_ring, 0.5), "p99": pct(lat_ring, 0.99)},
            "latency_handler_to_client_ms": {"p50": pct(lat_http, 0.5), "p99": pct(lat_http, 0.99)}}


# -- orchestration -------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _blink() -> list[str]:
    script = pathlib.Path(sys.executable).parent / "blink"
    return [str(script)] if script.exists() else [sys.executable, "-m", "dpu_frontend.cli"]


def _wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    import http.client
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"port {port} not healthy after {timeout_s} s")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy so far, all cores (/proc/stat: user, nice, system,
    irq, softirq; not idle, iowait or steal)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")


def _affinity(cpus: set[int] | None):
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def _machine() -> dict:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"hostname": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(), "python": sys.version.split()[0],
            "loadavg_at_start": os.getloadavg()}


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(15)
        if p.poll() is None:
            p.kill()


def orchestrate(args: argparse.Namespace) -> dict:
    """Saturated phase (null daemon as fast as it goes: blink, bare with blink's chunk size, bare
    one token per event), then with --paced-step-ms the paced phase (a fresh daemon that takes
    step_ms per step, and the bare server ticking at the same period)."""
    from dpu_frontend.http_server import loop_factory
    loop_name, _ = loop_factory(args.loop)   # resolved once here: both servers run exactly this loop
    client_loop, _ = loop_factory(args.client_loop or loop_name)
    cores = sorted(os.sched_getaffinity(0))
    pin = args.pin and len(cores) >= 2
    daemon_cpus = {cores[-1]} if pin else None
    http_cpus = set(cores[:-1]) if pin else None
    client_cpus = {"http": http_cpus, "daemon": daemon_cpus, "any": None}[args.client_cpus] if pin else None
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    runs = []
    rings = []

    def start_blink(step_ms: float) -> tuple[list[subprocess.Popen], int]:
        ring = f"blink-bench-cp-{os.getpid()}-{len(rings)}"
        rings.append(ring)
        port = _free_port()
        daemon = subprocess.Popen([*_blink(), "gpu-daemon", "--ring", ring, "--model", "null", "--step-ms",
                                   str(step_ms), "--log-level", "warning"], preexec_fn=_affinity(daemon_cpus), **quiet)
        frontend = subprocess.Popen([*_blink(), "frontend", "--ring", ring, "--model", "null", "--port", str(port),
                                     "--loop", loop_name, "--expose-backend-timing", "--log-level", "warning"],
                                    preexec_fn=_affinity(http_cpus), **quiet)
        _wait_healthy(port, frontend)
        return [daemon, frontend], port

    def client(phase: str, rnd: int, server: str, port: int, pids: dict[str, int], c: int, per_event: int = 1,
               step_ms: float = 0.0, max_tokens: int | None = None) -> dict:
        cmd = [sys.executable, "-m", "bench.control_plane", "--role", "client",
               "--url", f"http://127.0.0.1:{port}/v1/completions", "--concurrency", str(c),
               "--warmup-s", str(args.warmup_s), "--duration-s", str(args.duration_s),
               "--max-tokens", str(max_tokens or args.max_tokens), "--prompt-tokens", str(args.prompt_tokens),
               "--tokens-per-event", str(per_event), "--client-step-ms", str(step_ms if server != "blink" else 0),
               "--loop", client_loop]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, preexec_fn=_affinity(client_cpus))
        assert proc.stdout.readline().strip() == "started"
        time.sleep(args.warmup_s)
        watched = dict(pids, client=proc.pid)
        cpu0, busy0 = {k: _cpu_s(pid) for k, pid in watched.items()}, _machine_busy_s()
        time.sleep(args.duration_s)
        cpu1, busy1 = {k: _cpu_s(pid) for k, pid in watched.items()}, _machine_busy_s()
        out, _ = proc.communicate(timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"client failed ({proc.returncode})")
        res = json.loads(out.strip().splitlines()[-1])
        res["phase"], res["round"], res["server"], res["step_ms"] = phase, rnd, server, step_ms
        res["cpu_s"] = {k: cpu1[k] - cpu0[k] for k in watched}
        # Everything else on the machine in the window (other work, the kernel's share, this orchestrator).
        res["cpu_s"]["others"] = max(0.0, busy1 - busy0 - sum(res["cpu_s"].values()))
        res["requests_per_s"] = res["requests_completed"] / res["duration_s"]
        res["server_cpu_us_per_request"] = (1e6 * res["cpu_s"]["server"] / res["requests_completed"]
                                            if res["requests_completed"] else None)
        res["server_cpu_us_per_event"] = 1e6 * res["cpu_s"]["server"] / res["events"] if res["events"] else None
        res["server_cpu_us_per_token"] = 1e6 * res["cpu_s"]["server"] / res["tokens"] if res["tokens"] else None
        res["bare_tokens_per_event"] = per_event if server != "blink" else None
        runs.append(res)
        print(f"{phase:9s} {server:10s} c={c:3d}: {res['events_per_s']:9.0f} events/s {res['tokens_per_s']:9.0f} "
              f"tok/s ({res['tokens_per_event'] or 0:.1f} tok/event) latency p50 {res['latency_ms']['p50']} ms "
              f"p99 {res['latency_ms']['p99']} ms; server CPU {res['cpu_s']['server']:.2f} s "
              f"({res['server_cpu_us_per_event'] or 0:.0f} us/event)", flush=True)
        return res

    bare_port = _free_port()
    bare = subprocess.Popen([sys.executable, "-m", "bench.control_plane", "--role", "bare", "--port",
                             str(bare_port), "--loop", loop_name], preexec_fn=_affinity(http_cpus), **quiet)
    procs = [bare]
    try:
        _wait_healthy(bare_port, bare)
        def launch(step_ms: float):
            """blink (daemon + frontend) with this step pacing -> procs, port, which pid is what."""
            blink_procs, blink_port = start_blink(step_ms)
            daemon, frontend = blink_procs
            return (blink_procs, blink_port, {"server": frontend.pid, "daemon": daemon.pid},
                    {"server": bare.pid, "daemon": daemon.pid})

        blink_procs, blink_port, on_blink, on_bare = launch(0.0)
        procs += blink_procs
        for rep in range(args.repeats):
            for c in args.concurrency:
                # blink first: the bare server then streams chunks of the same size ("the same chunks")
                b = client("saturated", rep, "blink", blink_port, on_blink, c)
                client("saturated", rep, "bare", bare_port, on_bare, c, max(1, round(b["tokens_per_event"] or 1)))
                client("saturated", rep, "bare-1tok", bare_port, on_bare, c, 1)
        if args.turnaround:
            for rep in range(args.repeats):
                for c in args.concurrency:
                    client("turnaround", rep, "blink", blink_port, on_blink, c, max_tokens=1)
                    client("turnaround", rep, "bare", bare_port, on_bare, c, 1, max_tokens=1)
        if args.paced_step_ms > 0:
            _stop(blink_procs)   # the paced phase gets a fresh daemon; nothing of the first one keeps running
            blink_procs, blink_port, on_blink, on_bare = launch(args.paced_step_ms)
            procs = [bare] + blink_procs
            for rep in range(args.repeats):
                for c in args.concurrency:
                    client("paced", rep, "blink", blink_port, on_blink, c, step_ms=args.paced_step_ms)
                    client("paced", rep, "bare", bare_port, on_bare, c, 1, step_ms=args.paced_step_ms)
        return {"runs": runs, "loop": loop_name, "client_loop": client_loop, "pinned": pin, "daemon_cpus": sorted(daemon_cpus or []),
                "http_cpus": sorted(http_cpus or []), "client_cpus": sorted(client_cpus or [])}
    finally:
        _stop(procs)
        for ring in rings:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{ring}")


def _median_run(runs: list[dict]) -> dict:
    """One run whose every number is the median over the repeats (nested dicts included)."""
    def med(values):
        if all(isinstance(v, dict) for v in values):
            return {k: med([v[k] for v in values]) for k in values[0]}
        nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if nums and len(nums) == len(values):
            return statistics.median(nums)
        return values[0]
    return med(runs)


def _ratio_by_round(runs: list[dict], phase: str, c: int) -> list[float | None]:
    """blink events/s over bare's (same chunks) in each round: the two ran back to back."""
    out = []
    for rnd in sorted({r["round"] for r in runs if r["phase"] == phase}):
        pick = {r["server"]: r for r in runs if (r["phase"], r["round"], r["concurrency"]) == (phase, rnd, c)}
        if "blink" in pick and "bare" in pick:
            bare = pick["bare"]["events_per_s"]
            out.append(pick["blink"]["events_per_s"] / bare if bare else None)
    return out


def summarize(result: dict, args: argparse.Namespace) -> dict:
    by = {key: _median_run([r for r in result["runs"] if (r["phase"], r["server"], r["concurrency"]) == key])
          for key in {(r["phase"], r["server"], r["concurrency"]) for r in result["runs"]}}

    def ratio(a, b):
        return a / b if b else None
    rows, paced = [], []
    for c in args.concurrency:
        blink, bare, one = by[("saturated", "blink", c)], by[("saturated", "bare", c)], by[("saturated", "bare-1tok", c)]
        rows.append({
            "concurrency": c,
            "blink_events_per_s": blink["events_per_s"], "blink_tokens_per_s": blink["tokens_per_s"],
            "blink_tokens_per_event": blink["tokens_per_event"],
            "bare_tokens_per_event": bare["bare_tokens_per_event"],
            "bare_events_per_s": bare["events_per_s"], "bare_tokens_per_s": bare["tokens_per_s"],
            "events_ratio": ratio(blink["events_per_s"], bare["events_per_s"]),
            "tokens_ratio": ratio(blink["tokens_per_s"], bare["tokens_per_s"]),
            "bare_1tok_events_per_s": one["events_per_s"],
            "events_ratio_vs_1tok": ratio(blink["events_per_s"], one["events_per_s"]),
            "tokens_ratio_vs_1tok": ratio(blink["tokens_per_s"], one["tokens_per_s"]),
            "blink_latency_p50_ms": blink["latency_ms"]["p50"], "blink_latency_p99_ms": blink["latency_ms"]["p99"],
            "blink_latency_upper_p50_ms": blink["latency_upper_ms"]["p50"],
            "blink_latency_upper_p99_ms": blink["latency_upper_ms"]["p99"],
            "bare_latency_p50_ms": bare["latency_ms"]["p50"], "bare_latency_p99_ms": bare["latency_ms"]["p99"],
            "blink_ring_to_handler_p50_ms": blink["latency_ring_to_handler_ms"]["p50"],
            "blink_ring_to_handler_p99_ms": blink["latency_ring_to_handler_ms"]["p99"],
            "blink_handler_to_client_p50_ms": blink["latency_handler_to_client_ms"]["p50"],
            "blink_handler_to_client_p99_ms": blink["latency_handler_to_client_ms"]["p99"],
            "blink_frontend_cpu_us_per_event": blink["server_cpu_us_per_event"],
            "blink_frontend_cpu_us_per_token": blink["server_cpu_us_per_token"],
            "blink_daemon_cpu_s": blink["cpu_s"]["daemon"],
            "blink_frontend_busy": blink["cpu_s"]["server"] / blink["duration_s"],
            "blink_daemon_busy": blink["cpu_s"]["daemon"] / blink["duration_s"],
            "bare_busy": bare["cpu_s"]["server"] / bare["duration_s"],
            "bare_cpu_us_per_event": bare["server_cpu_us_per_event"],
            "bare_cpu_us_per_token": bare["server_cpu_us_per_token"],
            "bare_1tok_cpu_us_per_event": one["server_cpu_us_per_event"],
            "failures": blink["failures"] + bare["failures"] + one["failures"],
            "events_ratio_by_round": _ratio_by_round(result["runs"], "saturated", c),
            "blink_client_busy": blink["cpu_s"]["client"] / blink["duration_s"],
            "blink_others_busy": blink["cpu_s"]["others"] / blink["duration_s"],
            "bare_client_busy": bare["cpu_s"]["client"] / bare["duration_s"],
            "bare_others_busy": bare["cpu_s"]["others"] / bare["duration_s"],
        })
        if ("paced", "blink", c) in by:
            blink, bare = by[("paced", "blink", c)], by[("paced", "bare", c)]
            paced.append({
                "concurrency": c, "step_ms": args.paced_step_ms,
                "blink_events_per_s": blink["events_per_s"], "blink_tokens_per_s": blink["tokens_per_s"],
                "blink_tokens_per_event": blink["tokens_per_event"],
                "bare_events_per_s": bare["events_per_s"], "bare_tokens_per_s": bare["tokens_per_s"],
                "blink_latency_p50_ms": blink["latency_ms"]["p50"], "blink_latency_p99_ms": blink["latency_ms"]["p99"],
                "blink_latency_mean_ms": blink["latency_ms"]["mean"],
                "blink_ring_to_handler_p50_ms": blink["latency_ring_to_handler_ms"]["p50"],
                "blink_ring_to_handler_p99_ms": blink["latency_ring_to_handler_ms"]["p99"],
                "blink_handler_to_client_p50_ms": blink["latency_handler_to_client_ms"]["p50"],
                "blink_handler_to_client_p99_ms": blink["latency_handler_to_client_ms"]["p99"],
                "bare_latency_p50_ms": bare["latency_ms"]["p50"], "bare_latency_p99_ms": bare["latency_ms"]["p99"],
                "blink_frontend_cpu_us_per_event": blink["server_cpu_us_per_event"],
                "blink_frontend_busy": blink["cpu_s"]["server"] / blink["duration_s"],
                "blink_daemon_busy": blink["cpu_s"]["daemon"] / blink["duration_s"],
                "bare_cpu_us_per_event": bare["server_cpu_us_per_event"],
                "bare_busy": bare["cpu_s"]["server"] / bare["duration_s"],
                "failures": blink["failures"] + bare["failures"],
                "blink_p99_by_round": [r["latency_ms"]["p99"] for r in result["runs"]
                                       if (r["phase"], r["server"], r["concurrency"]) == ("paced", "blink", c)],
                "blink_others_busy": blink["cpu_s"]["others"] / blink["duration_s"],
                "bare_others_busy": bare["cpu_s"]["others"] / bare["duration_s"],
            })
    turnaround = []
    for c in args.concurrency:
        if ("turnaround", "blink", c) in by:
            blink, bare = by[("turnaround", "blink", c)], by[("turnaround", "bare", c)]
            turnaround.append({
                "concurrency": c, "blink_requests_per_s": blink["requests_per_s"],
                "bare_requests_per_s": bare["requests_per_s"],
                "requests_ratio": ratio(blink["requests_per_s"], bare["requests_per_s"]),
                "blink_frontend_cpu_us_per_request": blink["server_cpu_us_per_request"],
                "bare_cpu_us_per_request": bare["server_cpu_us_per_request"],
                "blink_daemon_busy": blink["cpu_s"]["daemon"] / blink["duration_s"],
                "failures": blink["failures"] + bare["failures"],
            })
    met = {}
    for r in rows:
        m = met[str(r["concurrency"])] = {"events_ratio": (r["events_ratio"] or 0) >= 0.5,
                                          "latency_p99_saturated": (r["blink_latency_p99_ms"] or 1e9) <= 2.0}
        pr = next((x for x in paced if x["concurrency"] == r["concurrency"]), None)
        if pr is not None:
            m["latency_p99_paced"] = (pr["blink_latency_p99_ms"] or 1e9) <= 2.0
    return {"rows": rows, "paced_rows": paced, "turnaround_rows": turnaround,
            "targets": {"events_ratio_min": 0.5, "latency_p99_ms_max": 2.0}, "met": met}


def write_results(result: dict, summary: dict, args: argparse.Namespace) -> pathlib.Path:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{args.date}-{args.machine}-control-plane"
    cmd = "python -m bench.control_plane " + " ".join(sys.argv[1:])
    info = result["machine_info"]
    payload = {"benchmark": "control_plane", "date": args.date, "machine": args.machine, "command": cmd.strip(),
               "params": {"concurrency": args.concurrency, "warmup_s": args.warmup_s, "duration_s": args.duration_s,
                          "repeats": args.repeats, "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
                          "paced_step_ms": args.paced_step_ms, "loop": result["loop"]},
               **result, "summary": summary}
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")

    def f(x, nd=2):
        return "n/a" if x is None else f"{x:.{nd}f}"

    def load(key):
        return ", ".join(f"{x:.2f}" for x in info[key]) if key in info else "n/a"
    step = args.paced_step_ms
    lines = [f"# Control-plane cost: blink frontend + null daemon vs bare aiohttp SSE ({args.date}, {args.machine})",
             "", f"Command: `{cmd.strip()}`", "",
             f"Machine: {info['cpu']}, {info['cores']} cores; load average (1, 5, 15 min) at start {load('loadavg_at_start')}, "
             f"at the end {load('loadavg_at_end')} (the benchmark's own processes included at the end).", "",
             f"Event loop: **{result['loop']}** in both servers (blink frontend `--loop {result['loop']}`, and the bare "
             f"aiohttp server); the load generator (raw asyncio protocol client, bench.control_plane._SseStream) on {result['client_loop']}. Closed loop, {args.duration_s:g} s per point after {args.warmup_s:g} s warm-up, "
             f"{args.repeats} rounds (medians shown); each request {args.prompt_tokens} prompt token ids, max_tokens "
             f"{args.max_tokens}, ignore_eos, streamed with usage. Pinned: {result['pinned']} (daemon on CPUs "
             f"{result['daemon_cpus']}, the HTTP server under test on {result['http_cpus']}, the client on "
             f"{result['client_cpus'] or 'any'}).", "",
             "Two kinds of numbers, measured separately:", "",
             "- **Saturated** (throughput): the null daemon publishes tokens as fast as it can, so the servers and "
             "the load generator share the two cores flat out. This is where the events/s target is judged. Its "
             "latency numbers are queueing at saturation (mostly the client and the server waiting for a CPU), not "
             "the per-token cost of the frontend.",
             ]
    if summary["paced_rows"]:
        lines.append(f"- **Paced** (latency): the null daemon takes {step:g} ms per engine step (`blink gpu-daemon "
                     f"--model null --step-ms {step:g}`: one token per stream every {step:g} ms, "
                     f"{1000 / step:.0f} tokens/s per stream, the cadence of a small model decoding on a CPU), and "
                     f"the bare server sends one token per stream on a shared {step:g} ms tick. Added latency per token "
                     "is judged here.")
    lines += ["", "## Saturated: throughput", "",
              "The frontend sends each stream's new tokens in one event per ring read; 'bare' streams the same chunks "
              "(blink's mean tokens per event at that concurrency) without a ring, 'bare 1tok' one token per event.",
              "",
              "| streams | blink events/s | blink tok/s | tok/event | bare events/s | bare tok/s | events ratio "
              "| by round | tok ratio | bare 1tok events/s | tok ratio vs 1tok |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary["rows"]:
        lines.append(f"| {r['concurrency']} | {r['blink_events_per_s']:.0f} | {r['blink_tokens_per_s']:.0f} | "
                     f"{f(r['blink_tokens_per_event'], 1)} | {r['bare_events_per_s']:.0f} | "
                     f"{r['bare_tokens_per_s']:.0f} | {f(r['events_ratio'])} | "
                     f"{' / '.join(f(x) for x in r['events_ratio_by_round'])} | {f(r['tokens_ratio'])} | "
                     f"{r['bare_1tok_events_per_s']:.0f} | {f(r['tokens_ratio_vs_1tok'])} |")
    lines += ["", "Server CPU inside the measured window (/proc/PID/stat): per event, per token, and the share of "
              "the window each process was on a CPU (the daemon's listed apart: it polls the ring on its own core; "
              "the load generator and everything else on the machine, /proc/stat minus the processes named, "
              "as well: 200% is both cores). Far below 100% means the process waited: for tokens, for the client, "
              "or for a CPU.",
              "", "| streams | blink frontend us/event | us/token | busy | daemon busy | client busy | others "
              "| bare us/event | us/token | busy | client busy | others | bare 1tok us/event |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary["rows"]:
        lines.append(f"| {r['concurrency']} | {f(r['blink_frontend_cpu_us_per_event'], 0)} | "
                     f"{f(r['blink_frontend_cpu_us_per_token'], 1)} | {100 * r['blink_frontend_busy']:.0f}% | "
                     f"{100 * r['blink_daemon_busy']:.0f}% | {100 * r['blink_client_busy']:.0f}% | "
                     f"{100 * r['blink_others_busy']:.0f}% | {f(r['bare_cpu_us_per_event'], 0)} | "
                     f"{f(r['bare_cpu_us_per_token'], 1)} | {100 * r['bare_busy']:.0f}% | "
                     f"{100 * r['bare_client_busy']:.0f}% | {100 * r['bare_others_busy']:.0f}% | "
                     f"{f(r['bare_1tok_cpu_us_per_event'], 0)} |")
    lines += ["", "Latency at saturation (ms; queueing, see above): client receipt minus the stamp of the newest "
              "token in the event (the daemon's publish time for blink, chunk creation for bare; both "
              "time.monotonic_ns). 'upper' is receipt minus the previous event's stamp, which bounds the oldest token "
              "of a multi-token event. Split: ring -> handler (daemon publish until the request's handler holds the "
              "batch) and handler -> client (detokenize, encode, write, client).", "",
              "| streams | blink p50 | blink p99 | blink upper p50 | blink upper p99 | ring->handler p50 / p99 "
              "| handler->client p50 / p99 | bare p50 | bare p99 |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary["rows"]:
        lines.append(f"| {r['concurrency']} | {f(r['blink_latency_p50_ms'], 3)} | {f(r['blink_latency_p99_ms'], 3)} | "
                     f"{f(r['blink_latency_upper_p50_ms'], 3)} | {f(r['blink_latency_upper_p99_ms'], 3)} | "
                     f"{f(r['blink_ring_to_handler_p50_ms'], 3)} / {f(r['blink_ring_to_handler_p99_ms'], 3)} | "
                     f"{f(r['blink_handler_to_client_p50_ms'], 3)} / {f(r['blink_handler_to_client_p99_ms'], 3)} | "
                     f"{f(r['bare_latency_p50_ms'], 3)} | {f(r['bare_latency_p99_ms'], 3)} |")
    if summary["paced_rows"]:
        lines += ["", f"## Paced ({step:g} ms per step): added latency per token", "",
                  "Added latency (ms) = client receipt minus the daemon's publish stamp of the token (blink) or the "
                  "tick that made every stream's token (bare): both include the wait behind the other streams. "
                  "With one token per event this is exact per token. Split as above (bare: tick -> its handler "
                  "builds the chunk -> client).", "",
                  "| streams | blink tok/s | tok/event | blink p50 | blink p99 | p99 by round | blink mean "
                  "| ring->handler p50 / p99 | handler->client p50 / p99 | bare tok/s | bare p50 | bare p99 |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in summary["paced_rows"]:
            lines.append(f"| {r['concurrency']} | {r['blink_tokens_per_s']:.0f} | {f(r['blink_tokens_per_event'], 2)} | "
                         f"{f(r['blink_latency_p50_ms'], 3)} | {f(r['blink_latency_p99_ms'], 3)} | "
                         f"{' / '.join(f(x, 3) for x in r['blink_p99_by_round'])} | "
                         f"{f(r['blink_latency_mean_ms'], 3)} | "
                         f"{f(r['blink_ring_to_handler_p50_ms'], 3)} / {f(r['blink_ring_to_handler_p99_ms'], 3)} | "
                         f"{f(r['blink_handler_to_client_p50_ms'], 3)} / {f(r['blink_handler_to_client_p99_ms'], 3)} | "
                         f"{r['bare_tokens_per_s']:.0f} | {f(r['bare_latency_p50_ms'], 3)} | "
                         f"{f(r['bare_latency_p99_ms'], 3)} |")
        lines += ["", "| streams | blink frontend us/event | busy | daemon busy | others | bare us/event | busy "
                  "| others |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in summary["paced_rows"]:
            lines.append(f"| {r['concurrency']} | {f(r['blink_frontend_cpu_us_per_event'], 0)} | "
                         f"{100 * r['blink_frontend_busy']:.0f}% | {100 * r['blink_daemon_busy']:.0f}% | "
                         f"{100 * r['blink_others_busy']:.0f}% | {f(r['bare_cpu_us_per_event'], 0)} | "
                         f"{100 * r['bare_busy']:.0f}% | {100 * r['bare_others_busy']:.0f}% |")
    if summary.get("turnaround_rows"):
        lines += ["", "## Turnaround: one-token requests", "",
                  "Closed loop as above with max_tokens 1 (the saturated daemon): each request's whole round trip, "
                  "request in, submission to the ring, the daemon's pick-up and step, the token back, the reply, "
                  "then the client's next request. No target; the per-request cost of the control plane.", "",
                  "| streams | blink req/s | bare req/s | ratio | blink frontend CPU us/request | bare us/request "
                  "| daemon busy |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in summary["turnaround_rows"]:
            lines.append(f"| {r['concurrency']} | {r['blink_requests_per_s']:.0f} | {r['bare_requests_per_s']:.0f} | "
                         f"{f(r['requests_ratio'])} | {f(r['blink_frontend_cpu_us_per_request'], 0)} | "
                         f"{f(r['bare_cpu_us_per_request'], 0)} | {100 * r['blink_daemon_busy']:.0f}% |")
    lines += ["", "## Targets", "",
              "Throughput: blink events/s >= 0.5x the bare server's with the same chunks, judged on the saturated rows. "
              "Latency: blink p99 added latency per token <= 2 ms, reported for both phases; the paced rows are the "
              "measurement of per-token latency, the saturated ones show queueing at full load.", ""]

    def verdict(ok):
        return "met" if ok else "NOT met"
    for c, met in summary["met"].items():
        line = (f"- {c} streams: events ratio (saturated) {verdict(met['events_ratio'])}; "
                f"p99 latency paced {verdict(met['latency_p99_paced']) if 'latency_p99_paced' in met else 'not run'}, "
                f"saturated {verdict(met['latency_p99_saturated'])}")
        lines.append(line)
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return stem


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.control_plane", description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=("orchestrate", "bare", "client"), default="orchestrate")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--url", default="")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--warmup-s", type=float, default=1.5)
    ap.add_argument("--duration-s", type=float, default=6.0)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="rounds over all points; the summary takes medians")
    ap.add_argument("--no-pin", dest="pin", action="store_false")
    ap.add_argument("--client-cpus", choices=("http", "daemon", "any"), default="any",
                    help="where the load generator runs when pinned: with the server under test, "
                         "with the daemon, or anywhere (default: the scheduler decides)")
    ap.add_argument("--client-loop", choices=("asyncio", "uvloop"), default=None,
                    help="event loop of the load generator (default: the servers' loop)")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--machine", default=socket.gethostname())
    ap.add_argument("--out", default=str(RESULTS), help="folder for the JSON and markdown (default bench/results)")
    ap.add_argument("--tokens-per-event", type=int, default=1, help="client role: ask the bare server for this")
    ap.add_argument("--client-step-ms", type=float, default=0.0, help="client role: ask the bare server to pace")
    ap.add_argument("--paced-step-ms", type=float, default=0.0,
                    help="also run the paced phase: the null daemon takes this long per step (20: 50 tokens/s "
                         "per stream, a CPU model's decode) and the bare server ticks at the same period; "
                         "added latency per token is measured there (0: saturated phase only)")
    ap.add_argument("--no-turnaround", dest="turnaround", action="store_false",
                    help="skip the one-token-request phase (request turnaround)")
    ap.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                    help="event loop of BOTH servers (blink frontend --loop, and the bare aiohttp server); "
                         "auto: uvloop when installed")
    args = ap.parse_args(argv)
    if args.role == "bare":
        run_bare_server(args.port, args.loop)
        return 0
    if args.role == "client":
        from dpu_frontend.http_server import run as run_on_loop
        res = run_on_loop(drive(args.url, int(args.concurrency), args.warmup_s, args.duration_s, args.max_tokens,
                                args.prompt_tokens, args.tokens_per_event, args.client_step_ms), args.loop)
        print(json.dumps(res))
        return 0
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    info = _machine()   # load average before this benchmark adds its own
    result = orchestrate(args)
    info["loadavg_at_end"] = os.getloadavg()
    result["machine_info"] = info
    summary = summarize(result, args)
    stem = write_results(result, summary, args)
    print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
