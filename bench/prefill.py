"""Prefill benchmark: time to first token for one long prompt, and where a prefill's time goes.

    serve:   for each checkout (the code before a change, and after): `blink serve` with default
             settings from that checkout, all running -> one streamed /v1/completions request per
             prompt length (real text of exact token length, max_tokens 1), TTFT = send to first
             chunk, alternating between the checkouts -> the minimum per (checkout, length), the
             scaling exponent (least-squares slope of log TTFT on log length), the load average
             -> bench/results/<date>-<machine>-prefill.json + .md (CPU model and flags named)
    profile: in process, the CPU executor's KernelForward over one prompt, in chunks of the
             policy's max_prefill_tokens, every kernel call timed -> CPU-ms per component
             (attention, matmuls, rope/norms/silu, other) for each length

    peers:   --peer vllm / --peer llamaserver (bench.servers, installed by bench/peers/): each peer
             alone after the checkouts, default settings, the same prompts' lengths and the same
             request, so blink's TTFT stands beside what users would run instead

    python -m bench.prefill serve --checkout before=/tmp/blink-base --checkout after=. \\
        --lengths 360,1600,3500 --repeats 3 --out bench/results/<date>-<machine>-prefill
    python -m bench.prefill serve --checkout blink=. --peer vllm --lengths 1600,3500 --out ...
    python -m bench.prefill profile --lengths 360,1600,3500

The exponent is what survives a loaded machine: other tenants slow every length by about the
same factor, so the slope stays where the absolute times do not.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
REPO = pathlib.Path(__file__).resolve().parent.parent


def scaling_exponent(lengths: list[int], seconds: list[float]) -> float:
    """b in t = a * n^b, least squares on the logs."""
    xs, ys = [math.log(n) for n in lengths], [math.log(t) for t in seconds]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


# ---- profile: in process, per component ----

class _Timed:
    """A callable wrapped so that the process CPU time it takes (all threads) adds to totals[name]:
    CPU time, not wall time, so that other tenants of a shared machine do not count."""

    def __init__(self, fn, name: str, totals: dict[str, float]):
        self.fn, self.name, self.totals = fn, name, totals

    def __call__(self, *args):
        t = time.process_time()
        out = self.fn(*args)
        self.totals[self.name] = self.totals.get(self.name, 0.0) + time.process_time() - t
        return out


def profile(lengths: list[int], chunk: int, repeats: int) -> dict:
    """CPU-ms per component of one prefill of each length through the CPU executor's kernel layer
    (the fastest of `repeats` by total CPU time; wall time alongside)."""
    import torch

    from gpu_backend.executors import ExecutorOptions
    from gpu_backend.executors.cpu import CpuExecutor, DEFAULT_MAX_PREFILL_TOKENS
    from gpu_backend.paged_attention import PagedBatch

    ex = CpuExecutor(ExecutorOptions(model="default"))
    chunk = chunk or DEFAULT_MAX_PREFILL_TOKENS
    runner_forward = _kernel_forward(ex)
    totals: dict[str, float] = {}
    for name in ("add_rms_norm", "rope_cache", "silu_mul", "decode_attention", "prefill_attention"):
        if hasattr(runner_forward, name):
            setattr(runner_forward, name, _Timed(getattr(runner_forward, name), name, totals))
    for p in runner_forward.plans:
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(p, name, _Timed(getattr(p, name), f"matmul_{name}", totals))
    bs = ex.pool.config.block_size
    vocab = ex.model.config.vocab_size
    out = {}
    for n in lengths:
        best = None
        for _ in range(repeats):
            table = list(range((n + bs - 1) // bs))
            ids = torch.randint(100, vocab, (n,))
            totals.clear()
            t0, c0 = time.perf_counter(), time.process_time()
            with torch.inference_mode():
                for start in range(0, n, chunk):
                    m = min(chunk, n - start)
                    batch = PagedBatch.build([(start, m, table)], bs)
                    hidden = runner_forward(ids[start:start + m], torch.arange(start, start + m), batch)
                ex.model.compute_logits(hidden[-1:])
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if best is None or cpu < best["cpu_ms"] / 1e3:
                best = {"wall_ms": wall * 1e3, "cpu_ms": cpu * 1e3, **{k: v * 1e3 for k, v in sorted(totals.items())}}
        attn = best.get("decode_attention", 0.0) + best.get("prefill_attention", 0.0)
        mm = sum(v for k, v in best.items() if k.startswith("matmul_"))
        small = sum(best.get(k, 0.0) for k in ("add_rms_norm", "rope_cache", "silu_mul"))
        best.update(attention_ms=attn, matmuls_ms=mm, small_kernels_ms=small,
                    other_ms=best["cpu_ms"] - attn - mm - small)
        out[str(n)] = best
        print(f"{n:5d} tokens: {best['cpu_ms']:8.1f} CPU-ms (wall {best['wall_ms']:8.1f})  attention {attn:8.1f}  "
              f"matmuls {mm:8.1f}  norm/rope/silu {small:6.1f}  other {best['other_ms']:6.1f}", flush=True)
    return {"chunk_tokens": chunk, "threads": torch.get_num_threads(), "by_length": out}


def _kernel_forward(ex):
    from gpu_backend.executors.cpu_forward import KernelForward
    if not KernelForward.applicable(ex.model, ex.kernels):
        raise SystemExit("the fused kernel layer does not apply here (no g++?)")
    return KernelForward(ex.model, ex.pool, ex.kernels)


# ---- serve: TTFT through `blink serve`, one checkout after another ----

def _ttft(base_url: str, model: str, prompt: str, timeout_s: float = 900.0) -> float:
    """Seconds from sending one streamed completion (max_tokens 1) to its first data chunk."""
    from bench.client import first_token_seconds
    return first_token_seconds(base_url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1,
                                                             "temperature": 0.0}, timeout_s)


def _commit_of(path: pathlib.Path) -> str:
    marker = path / ".commit"
    if marker.is_file():
        return marker.read_text().strip()
    out = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (out.stdout.strip() or "unknown") + ("+changes" if dirty else "")


def serve_sweep(checkouts: dict[str, pathlib.Path], lengths: list[int], repeats: int, log_dir: pathlib.Path) -> dict:
    """TTFT of one prompt per length through `blink serve` (default settings) from each checkout.

    Every checkout's server runs for the whole sweep (an idle one waits passively), and the
    requests alternate between them: repeat -> length -> checkout, so a shift in the other
    tenants' load falls on both sides, not on whichever ran second."""
    from bench.interference import stop_group
    from bench.servers import SERVED_NAME, free_port, wait_ready
    from bench.workload import PromptMaker, load_tokenizer
    import numpy as np
    maker = PromptMaker(load_tokenizer("default"))
    rng = np.random.default_rng(0)
    procs, urls, ready = {}, {}, {}
    try:
        for label, path in checkouts.items():          # one at a time: start-up is measured alone
            port = free_port()
            argv = [sys.executable, "-m", "dpu_frontend.cli", "serve", "--model", "default", "--port", str(port),
                    "--ring", f"blink-prefill-{os.getpid()}-{port}", "--served-model-name", SERVED_NAME]
            env = dict(os.environ, PYTHONPATH=str(path))
            t0 = time.monotonic()
            with open(log_dir / f"prefill-serve-{os.getpid()}-{label}.log", "wb") as log:
                procs[label] = subprocess.Popen(argv, cwd=str(path), env=env, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)
            urls[label] = f"http://127.0.0.1:{port}"
            wait_ready(None, urls[label], SERVED_NAME, timeout_s=600.0, health_path="/health")
            ready[label] = time.monotonic() - t0
            _ttft(urls[label], SERVED_NAME, maker.make(16, rng)[0])          # warm-up: first request's costs
        runs = {label: {n: [] for n in lengths} for label in checkouts}
        tokens: dict[int, int] = {}
        for _ in range(repeats):
            for n in lengths:
                for label in checkouts:
                    text, tokens[n] = maker.make(n, rng)                    # unique text each request
                    # a long prefill step can outlast the frontend's heartbeat timeout (it then answers
                    # 503 until the daemon beats again): wait for health before each measurement
                    wait_ready(None, urls[label], SERVED_NAME, timeout_s=900.0, health_path="/health")
                    runs[label][n].append(_ttft(urls[label], SERVED_NAME, text))
                    print(f"{label}: {tokens[n]} tokens, TTFT {runs[label][n][-1] * 1e3:.0f} ms", flush=True)
    finally:
        for proc in procs.values():
            stop_group(proc, 20.0)
    out = {}
    for label, path in checkouts.items():
        best = {n: min(v) for n, v in runs[label].items()}
        out[label] = {"checkout": _commit_of(path), "ready_s": ready[label],
                      "prompt_tokens": {str(n): tokens[n] for n in lengths},
                      "ttft_s": {str(n): best[n] for n in lengths},
                      "ttft_all_s": {str(n): runs[label][n] for n in lengths},
                      "exponent": scaling_exponent([tokens[n] for n in lengths], [best[n] for n in lengths])}
        print(f"{label}: ready in {ready[label]:.1f} s, exponent {out[label]['exponent']:.2f}", flush=True)
    return out


def peer_sweep(systems: list[str], lengths: list[int], repeats: int, log_dir: pathlib.Path) -> dict:
    """TTFT of one prompt per length through each peer server (bench.servers: default settings, the
    machine's cores as threads), each alone: started, warmed up, measured, stopped, then the next."""
    from bench.servers import SERVED_NAME, server_spec, start_server, wait_ready
    from bench.workload import PromptMaker, load_tokenizer
    import numpy as np
    maker = PromptMaker(load_tokenizer("default"))
    rng = np.random.default_rng(1)
    context = max(4096, 1024 * math.ceil((max(lengths) + 256) / 1024))
    out = {}
    for system in systems:
        spec = server_spec(system, model="default", cpus=None, threads=os.cpu_count() or 1, max_model_len=context)
        server = start_server(spec, log_dir / f"prefill-peer-{os.getpid()}-{system}.log")
        try:
            ready = wait_ready(server, spec.base_url, spec.model_name, timeout_s=900.0, health_path=spec.health_path)
            _ttft(spec.base_url, spec.model_name, maker.make(16, rng)[0])
            runs, tokens = {n: [] for n in lengths}, {}
            for _ in range(repeats):
                for n in lengths:
                    text, tokens[n] = maker.make(n, rng)
                    runs[n].append(_ttft(spec.base_url, spec.model_name, text))
                    print(f"{system}: {tokens[n]} tokens, TTFT {runs[n][-1] * 1e3:.0f} ms", flush=True)
        finally:
            server.stop()
        best = {n: min(v) for n, v in runs.items()}
        out[system] = {"checkout": spec.version, "command": " ".join(spec.argv), "env": dict(spec.env),
                       "ready_s": ready, "prompt_tokens": {str(n): tokens[n] for n in lengths},
                       "ttft_s": {str(n): best[n] for n in lengths},
                       "ttft_all_s": {str(n): runs[n] for n in lengths},
                       "exponent": scaling_exponent([tokens[n] for n in lengths], [best[n] for n in lengths])}
        print(f"{system}: ready in {ready:.1f} s, exponent {out[system]['exponent']:.2f}", flush=True)
    return out


def write_serve_results(result: dict, out: pathlib.Path, argv: list[str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    cpu = result["cpu"]
    lines = [f"# Prefill: TTFT of one prompt through `blink serve` ({result['date']})", "",
             f"CPU: {cpu['model']} ({os.cpu_count()} cores), flags {' '.join(cpu['simd_flags'])}; "
             f"attention path {cpu['attention_isa']}, quantized matmuls {cpu['quant_isa']}. "
             f"Load average at start: {result['loadavg_start']} (end: {result['loadavg_end']}); the machine "
             "is shared, so absolute times carry the others' load; the exponent is the robust number.", "",
             "Command: `" + " ".join(argv) + "`", "",
             "Default settings (`blink serve --model default`), the servers of both checkouts up for the "
             "whole sweep, one streamed /v1/completions request at a time alternating between them "
             "(an idle server waits passively), max_tokens 1; the minimum over the repeats. Peers (if any) "
             "ran after them, each alone, with bench.servers' default command (in the JSON).", "",
             "| checkout | " + " | ".join(f"{n} tok" for n in result["runs"][next(iter(result["runs"]))]["prompt_tokens"].values())
             + " | exponent | ready (s) |", "|---|" + "---|" * (len(result["lengths"]) + 2)]
    for label, r in result["runs"].items():
        lines.append(f"| {label} ({r['checkout']}) | " + " | ".join(f"{v * 1e3:,.0f} ms" for v in r["ttft_s"].values())
                     + f" | {r['exponent']:.2f} | {r['ready_s']:.1f} |")
    labels = [k for k in result["runs"] if k not in result.get("peers", ())]
    for peer in result.get("peers", ()):
        theirs = result["runs"][peer]["ttft_s"]
        for label in labels:
            mine = result["runs"][label]["ttft_s"]
            lines += ["", f"TTFT of {label} / {peer}: " + ", ".join(
                f"{mine[n] / theirs[n]:.2f}x at {n}" for n in theirs if n in mine) + " (below 1: faster)"]
    if result.get("notes"):
        lines += ["", *result["notes"]]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.prefill", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("profile", help="ms per component of one prefill, in process")
    pp.add_argument("--lengths", default="360,1600,3500")
    pp.add_argument("--chunk", type=int, default=0, help="tokens a prefill step (default: the policy's)")
    pp.add_argument("--repeats", type=int, default=2)
    pp.add_argument("--out", default=None, help="write the profile as JSON here")
    sp = sub.add_parser("serve", help="TTFT through blink serve from one or more checkouts")
    sp.add_argument("--checkout", action="append", required=True, metavar="LABEL=PATH",
                    help="a source tree to serve from (git archive of a commit, or this repo)")
    sp.add_argument("--peer", action="append", default=[], choices=("vllm", "llamaserver", "llamacpp"),
                    help="a peer server measured alone after the checkouts (bench/peers/ installs them)")
    sp.add_argument("--lengths", default="360,1600,3500")
    sp.add_argument("--repeats", type=int, default=2)
    sp.add_argument("--out", required=True, help="results path without suffix (.json and .md are written)")
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        from bench.cpu_executor import cpu_description
        from gpu_backend import cpu_kernels
        checkouts = {c.split("=", 1)[0]: pathlib.Path(c.split("=", 1)[1]).resolve() for c in args.checkout}
        lengths = [int(x) for x in args.lengths.split(",")]
        load_start = os.getloadavg()
        runs = serve_sweep(checkouts, lengths, args.repeats, pathlib.Path(tempfile.gettempdir()))   # server logs
        runs.update(peer_sweep(args.peer, lengths, args.repeats, pathlib.Path(tempfile.gettempdir())))
        kernels = cpu_kernels.load()
        cpu = dict(cpu_description(), attention_isa=cpu_kernels.ISA_NAMES[kernels.attention_isa] if kernels else None)
        result = {"date": datetime.date.today().isoformat(), "cpu": cpu, "lengths": lengths, "repeats": args.repeats,
                  "loadavg_start": [round(x, 2) for x in load_start],
                  "loadavg_end": [round(x, 2) for x in os.getloadavg()], "runs": runs, "peers": args.peer}
        write_serve_results(result, pathlib.Path(args.out), ["python", "-m", "bench.prefill", *(argv or sys.argv[1:])])
        return
    if args.cmd == "profile":
        from gpu_backend.cli import GOMP_SPINCOUNT               # as the daemon runs; read before torch loads
        os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
        result = profile([int(x) for x in args.lengths.split(",")], args.chunk, args.repeats)
        if args.out:
            pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
