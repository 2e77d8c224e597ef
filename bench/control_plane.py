"""Control-plane cost of the frontend: blink (frontend + null daemon over the ring) vs a bare aiohttp
SSE server that streams the same chunks with no ring behind it, measured in the same run.

    orchestrator: start `blink gpu-daemon --model null` + `blink frontend --expose-backend-timing`
        and `python -m bench.control_plane --role bare` (aiohttp, one token per event, no ring)
    for each concurrency (1, 16, 64), servers alternating: a client process streams closed-loop
        /v1/completions (token-id prompt, max_tokens, ignore_eos) for --duration-s after a warm-up
        -> events/s, tokens/s, and per event t_recv - t_last_ns (both sides stamp
           time.monotonic_ns: the daemon when it publishes a token, the bare server when it
           builds the chunk; the client reads the same clock on this machine)
    -> bench/results/<date>-<machine>-control-plane.json and .md

Added latency per token: for blink, `t_last_ns` is the daemon's stamp of the newest token in the
chunk, so t_recv - t_last_ns is a lower bound for every token of the chunk; the older tokens of a
chunk were published after the previous chunk's t_last_ns, which gives an upper bound
(t_recv - previous t_last_ns). Both are reported. Pinned by default (>= 2 cores; --no-pin turns it
off): the daemon on the last core, the server under test (frontend or bare) on the others, the
client where --client-cpus says (default: wherever the scheduler puts it), so the daemon's busy
polling never takes the HTTP side's core.

    python -m bench.control_plane [--concurrency 1,16,64] [--duration-s 6] [--repeats 2] [--max-tokens 256]
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

def run_bare_server(port: int) -> None:
    """aiohttp, /v1/completions streaming one token per event, chunks shaped exactly as blink's."""
    from aiohttp import web

    from dpu_frontend import openai_api as api
    from dpu_frontend.tokenizer import load_tokenizer

    tok = load_tokenizer("default")
    texts: dict[tuple[int, ...], str] = {}

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt, n = body["prompt"], body["max_tokens"]
        per_event = max(1, int(body.get("bench_tokens_per_event", 1)))
        rid, created = api.request_id("cmpl"), int(time.time())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            for i in range(0, n, per_event):
                ids = [prompt[j % len(prompt)] for j in range(i, min(n, i + per_event))]   # the null daemon's echo
                key = tuple(ids)
                text = texts.get(key)
                if text is None:
                    text = texts[key] = tok.decode(ids)
                last = i + per_event >= n
                chunk = api.completion_chunk(rid, created, "null", text, "length" if last else None)
                t_ns = time.monotonic_ns()
                chunk["blink_timing"] = {"t_last_ns": t_ns, "t_frontend_ns": t_ns, "n_tokens": len(ids)}
                await resp.write(api.sse(chunk))
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
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, handler_cancellation=True)


# -- the client --------------------------------------------------------------------

_TIMING = re.compile(rb'"blink_timing":\{"t_last_ns":(\d+),"t_frontend_ns":(\d+),"n_tokens":(\d+)\}')

async def drive(url: str, concurrency: int, warmup_s: float, duration_s: float, max_tokens: int,
                prompt_tokens: int, tokens_per_event: int = 1) -> dict:
    """Closed loop: `concurrency` workers, each streaming one request after another."""
    import aiohttp

    t0 = time.monotonic_ns()
    print("started", flush=True)   # the orchestrator times its CPU samples from this line
    start_ns = t0 + int(warmup_s * 1e9)
    end_ns = start_ns + int(duration_s * 1e9)
    events = tokens = requests = failures = 0
    lat_lo: list[int] = []
    lat_hi: list[int] = []
    lat_ring: list[int] = []   # daemon publish -> frontend handler has the batch
    lat_http: list[int] = []   # frontend handler -> client receipt

    async def worker(w: int, session: aiohttp.ClientSession):
        nonlocal events, tokens, requests, failures
        k = 0
        while time.monotonic_ns() < end_ns:
            prompt = [1000 + (w * 7919 + k * 104729 + i * 31) % 40000 for i in range(prompt_tokens)]
            k += 1
            body = {"model": "null", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            if tokens_per_event > 1:   # understood by the bare server only
                body["bench_tokens_per_event"] = tokens_per_event
            prev_last = None
            try:
                async with session.post(url, json=body) as r:
                    if r.status != 200:
                        failures += 1
                        await asyncio.sleep(0.01)
                        continue
                    buf = b""
                    async for data in r.content.iter_any():
                        t_recv = time.monotonic_ns()
                        buf += data
                        while b"\n\n" in buf:
                            ev, buf = buf.split(b"\n\n", 1)
                            # Token events only (the usage chunk and [DONE] carry no timing); a regex,
                            # not json.loads, so the client takes as little CPU from the servers as it can.
                            m = _TIMING.search(ev)
                            if m is None:
                                continue
                            t_last, t_front, n_tok = int(m[1]), int(m[2]), int(m[3])
                            if start_ns <= t_recv < end_ns:
                                events += 1
                                tokens += n_tok
                                lat_lo.append(t_recv - t_last)
                                lat_hi.append(t_recv - (prev_last if prev_last is not None else t_last))
                                lat_ring.append(t_front - t_last)
                                lat_http.append(t_recv - t_front)
                            prev_last = t_last
                        if t_recv >= end_ns:
                            break
                    else:
                        if time.monotonic_ns() < end_ns:
                            requests += 1
            except aiohttp.ClientError:
                failures += 1

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*(worker(w, session) for w in range(concurrency)))

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


def orchestrate(args: argparse.Namespace) -> dict:
    cores = sorted(os.sched_getaffinity(0))
    pin = args.pin and len(cores) >= 2
    daemon_cpus = {cores[-1]} if pin else None
    http_cpus = set(cores[:-1]) if pin else None
    client_cpus = {"http": http_cpus, "daemon": daemon_cpus, "any": None}[args.client_cpus] if pin else None
    ring = f"blink-bench-cp-{os.getpid()}"
    blink_port, bare_port = _free_port(), _free_port()
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    procs = []
    try:
        procs.append(subprocess.Popen([*_blink(), "gpu-daemon", "--ring", ring, "--model", "null",
                                       "--log-level", "warning"], preexec_fn=_affinity(daemon_cpus), **quiet))
        procs.append(subprocess.Popen([*_blink(), "frontend", "--ring", ring, "--model", "null", "--port",
                                       str(blink_port), "--expose-backend-timing", "--log-level", "warning"],
                                      preexec_fn=_affinity(http_cpus), **quiet))
        procs.append(subprocess.Popen([sys.executable, "-m", "bench.control_plane", "--role", "bare", "--port",
                                       str(bare_port)], preexec_fn=_affinity(http_cpus), **quiet))
        _wait_healthy(blink_port, procs[1])
        _wait_healthy(bare_port, procs[2])
        runs = []

        def client(server: str, port: int, c: int, per_event: int = 1) -> dict:
            cmd = [sys.executable, "-m", "bench.control_plane", "--role", "client",
                   "--url", f"http://127.0.0.1:{port}/v1/completions", "--concurrency", str(c),
                   "--warmup-s", str(args.warmup_s), "--duration-s", str(args.duration_s),
                   "--max-tokens", str(args.max_tokens), "--prompt-tokens", str(args.prompt_tokens),
                   "--tokens-per-event", str(per_event)]
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, preexec_fn=_affinity(client_cpus))
            assert proc.stdout.readline().strip() == "started"
            time.sleep(args.warmup_s)
            watched = {"server": procs[1].pid if server == "blink" else procs[2].pid, "daemon": procs[0].pid}
            cpu0 = {k: _cpu_s(pid) for k, pid in watched.items()}
            time.sleep(args.duration_s)
            cpu1 = {k: _cpu_s(pid) for k, pid in watched.items()}
            out, _ = proc.communicate(timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"client failed ({proc.returncode})")
            res = json.loads(out.strip().splitlines()[-1])
            res["server"] = server
            res["cpu_s"] = {k: cpu1[k] - cpu0[k] for k in watched}
            res["server_cpu_us_per_event"] = 1e6 * res["cpu_s"]["server"] / res["events"] if res["events"] else None
            res["server_cpu_us_per_token"] = 1e6 * res["cpu_s"]["server"] / res["tokens"] if res["tokens"] else None
            res["bare_tokens_per_event"] = per_event if server != "blink" else None
            runs.append(res)
            print(f"{server:10s} c={c:3d}: {res['events_per_s']:9.0f} events/s {res['tokens_per_s']:9.0f} tok/s "
                  f"({res['tokens_per_event'] or 0:.1f} tok/event) latency p50 {res['latency_ms']['p50']} ms "
                  f"p99 {res['latency_ms']['p99']} ms; server CPU {res['cpu_s']['server']:.2f} s "
                  f"({res['server_cpu_us_per_event'] or 0:.0f} us/event)", flush=True)
            return res

        for rep in range(args.repeats):
            for c in args.concurrency:
                # blink first: the bare server then streams chunks of the same size ("the same chunks")
                b = client("blink", blink_port, c)
                client("bare", bare_port, c, max(1, round(b["tokens_per_event"] or 1)))
                client("bare-1tok", bare_port, c, 1)
        return {"runs": runs, "pinned": pin, "daemon_cpus": sorted(daemon_cpus or []),
                "http_cpus": sorted(http_cpus or []), "client_cpus": sorted(client_cpus or [])}
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(15)
            if p.poll() is None:
                p.kill()
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


def summarize(result: dict, args: argparse.Namespace) -> dict:
    by = {key: _median_run([r for r in result["runs"] if (r["server"], r["concurrency"]) == key])
          for key in {(r["server"], r["concurrency"]) for r in result["runs"]}}
    rows = []
    for c in args.concurrency:
        blink, bare, one = by[("blink", c)], by[("bare", c)], by[("bare-1tok", c)]

        def ratio(a, b):
            return a / b if b else None
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
        })
    return {"rows": rows,
            "targets": {"events_ratio_min": 0.5, "latency_p99_ms_max": 2.0},
            "met": {str(r["concurrency"]): {"events_ratio": (r["events_ratio"] or 0) >= 0.5,
                                            "latency_p99": (r["blink_latency_p99_ms"] or 1e9) <= 2.0}
                    for r in rows}}


def write_results(result: dict, summary: dict, args: argparse.Namespace) -> pathlib.Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"{args.date}-{args.machine}-control-plane"
    cmd = "python -m bench.control_plane " + " ".join(sys.argv[1:])
    info = result["machine_info"]
    payload = {"benchmark": "control_plane", "date": args.date, "machine": args.machine, "command": cmd.strip(),
               "params": {"concurrency": args.concurrency, "warmup_s": args.warmup_s, "duration_s": args.duration_s,
                          "repeats": args.repeats,
                          "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens},
               **result, "summary": summary}
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")

    def f(x, nd=2):
        return "n/a" if x is None else f"{x:.{nd}f}"
    lines = [f"# Control-plane cost: blink frontend + null daemon vs bare aiohttp SSE ({args.date}, {args.machine})",
             "", f"Command: `{cmd.strip()}`", "",
             f"Machine: {info['cpu']}, {info['cores']} cores; load average at start "
             f"{', '.join(f'{x:.1f}' for x in info['loadavg_at_start'])} (other work was running).", "",
             f"Closed loop, {args.duration_s:g} s per point after {args.warmup_s:g} s warm-up, {args.repeats} "
             f"rounds (medians shown); each request "
             f"{args.prompt_tokens} prompt token ids, max_tokens {args.max_tokens}, ignore_eos, streamed with usage. "
             f"Pinned: {result['pinned']} (daemon on CPUs {result['daemon_cpus']}, the HTTP server under test on "
             f"{result['http_cpus']}, the client on {result['client_cpus'] or 'any'}). The null daemon publishes tokens as fast as it can, so the "
             "frontend sends each stream's new tokens in one event per ring read; 'bare' streams the same "
             "chunks (blink's mean tokens per event at that concurrency) without a ring, 'bare 1tok' one token "
             "per event.", "",
             "| streams | blink events/s | blink tok/s | tok/event | bare events/s | bare tok/s | events ratio "
             "| tok ratio | bare 1tok events/s | tok ratio vs 1tok |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary["rows"]:
        lines.append(f"| {r['concurrency']} | {r['blink_events_per_s']:.0f} | {r['blink_tokens_per_s']:.0f} | "
                     f"{f(r['blink_tokens_per_event'], 1)} | {r['bare_events_per_s']:.0f} | "
                     f"{r['bare_tokens_per_s']:.0f} | {f(r['events_ratio'])} | {f(r['tokens_ratio'])} | "
                     f"{r['bare_1tok_events_per_s']:.0f} | {f(r['tokens_ratio_vs_1tok'])} |")
    lines += ["", "Added latency (ms): client receipt minus the stamp of the newest token in the event (the daemon's "
              "publish time for blink, chunk creation for bare; both time.monotonic_ns). 'upper' is receipt minus "
              "the previous event's stamp, which bounds the oldest token of a multi-token event. When a server "
              "outruns the client the bare numbers are socket-buffer queueing, not server cost.", "",
              "Split of blink's latency: ring -> handler (daemon publish until the request's handler holds the "
              "batch: reader poll cadence and wake-up) and handler -> client (detokenize, encode, write, client).",
              "",
              "| streams | blink p50 | blink p99 | blink upper p50 | blink upper p99 | ring->handler p50 / p99 "
              "| handler->client p50 / p99 | bare p50 | bare p99 |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary["rows"]:
        lines.append(f"| {r['concurrency']} | {f(r['blink_latency_p50_ms'], 3)} | {f(r['blink_latency_p99_ms'], 3)} | "
                     f"{f(r['blink_latency_upper_p50_ms'], 3)} | {f(r['blink_latency_upper_p99_ms'], 3)} | "
                     f"{f(r['blink_ring_to_handler_p50_ms'], 3)} / {f(r['blink_ring_to_handler_p99_ms'], 3)} | "
                     f"{f(r['blink_handler_to_client_p50_ms'], 3)} / {f(r['blink_handler_to_client_p99_ms'], 3)} | "
                     f"{f(r['bare_latency_p50_ms'], 3)} | {f(r['bare_latency_p99_ms'], 3)} |")
    lines += ["", "Server CPU inside the measured window (/proc/PID/stat): per event, per token, and the share of "
              "the window each process was on a CPU (the daemon's listed apart: it polls the ring on its own core). "
              "Far below 100% means the process waited: for tokens (the null daemon set the pace), for the client, "
              "or for a CPU (other work on the machine).",
              "", "| streams | blink frontend us/event | us/token | busy | daemon busy | bare us/event | us/token | busy "
              "| bare 1tok us/event |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary["rows"]:
        lines.append(f"| {r['concurrency']} | {f(r['blink_frontend_cpu_us_per_event'], 0)} | "
                     f"{f(r['blink_frontend_cpu_us_per_token'], 1)} | {100 * r['blink_frontend_busy']:.0f}% | "
                     f"{100 * r['blink_daemon_busy']:.0f}% | {f(r['bare_cpu_us_per_event'], 0)} | "
                     f"{f(r['bare_cpu_us_per_token'], 1)} | {100 * r['bare_busy']:.0f}% | "
                     f"{f(r['bare_1tok_cpu_us_per_event'], 0)} |")
    lines += ["", "Targets: events ratio >= 0.5 (vs bare with the same chunks), blink p99 added latency <= 2 ms.", ""]
    for c, met in summary["met"].items():
        lines.append(f"- {c} streams: events ratio {'met' if met['events_ratio'] else 'NOT met'}, "
                     f"p99 latency {'met' if met['latency_p99'] else 'NOT met'}")
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
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--machine", default=socket.gethostname())
    ap.add_argument("--tokens-per-event", type=int, default=1, help="client role: ask the bare server for this")
    args = ap.parse_args(argv)
    if args.role == "bare":
        run_bare_server(args.port)
        return 0
    if args.role == "client":
        res = asyncio.run(drive(args.url, int(args.concurrency), args.warmup_s, args.duration_s, args.max_tokens,
                                args.prompt_tokens, args.tokens_per_event))
        print(json.dumps(res))
        return 0
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    info = _machine()   # load average before this benchmark adds its own
    result = orchestrate(args)
    result["machine_info"] = info
    summary = summarize(result, args)
    stem = write_results(result, summary, args)
    print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
