"""Kill-to-served: how long `blink serve` takes to serve again after `kill -9` of one child.

    start blink serve -> for each victim in --kills (gpu-daemon | frontend, in turn):
        `streams` streams running (first token out) -> kill -9 the victim
        -> a small request every 50 ms until one is served (503 / refused before that)
        -> seconds from the kill to that reply; the streams' ends; settle (no slot,
           arena or KV block leaked)
    -> one line per kill, and JSON with --out

    python -m bench.restart_latency --model null
    python -m bench.restart_latency --model default --kills gpu-daemon,frontend,gpu-daemon
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request

import aiohttp

from .reliability import ServeUnderTest, children_of, http_get, ring_geometry, settle

PROMPT = [1000, 1001, 1002, 1003]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.restart_latency", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="null", help="null (echo) | default (SmolLM2 on the CPU executor) | path")
    p.add_argument("--kills", default="gpu-daemon,frontend", help="victims in turn, comma-separated")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=4000, help="per stream: long enough to be killed mid-way")
    p.add_argument("--out", type=pathlib.Path, default=None, help="write the results here as JSON")
    p.add_argument("serve_args", nargs="*", help="more `blink serve` arguments (after --)")
    return p.parse_args(argv)


def served_again(base: str, t_kill: float, timeout_s: float = 300.0) -> tuple[float, int]:
    """(seconds from the kill to the first 200, requests answered otherwise before it)."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}).encode()
    refused = 0
    while time.monotonic() - t_kill < timeout_s:
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                if r.status == 200:
                    return time.monotonic() - t_kill, refused
        except (urllib.error.URLError, OSError):
            pass
        refused += 1
        time.sleep(0.05)
    raise RuntimeError(f"not served again within {timeout_s:g} s")


async def one_kill(serve: ServeUnderTest, victim: str, args, geometry) -> dict:
    pid = next(p for p, cmd in children_of(serve.proc.pid) if f" {victim} " in cmd + " ")
    firsts = [asyncio.Event() for _ in range(args.streams)]

    async def stream(session, first):
        body = {"prompt": PROMPT, "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True}
        text = b""
        try:
            async with session.post(serve.base + "/v1/completions", json=body) as r:
                async for chunk in r.content.iter_any():
                    text += chunk
                    first.set()
        except aiohttp.ClientError:
            return "cut"
        return "error_and_done" if b'"error"' in text and text.endswith(b"data: [DONE]\n\n") else "other"

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks = [asyncio.ensure_future(stream(session, f)) for f in firsts]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        took_s, refused = await asyncio.to_thread(served_again, serve.base, t_kill)
        ends = await asyncio.gather(*tasks)
    check, settle_s = await settle(serve, geometry)
    return {"victim": victim, "kill_to_served_s": round(took_s, 3), "refused_meanwhile": refused,
            "stream_ends": {e: ends.count(e) for e in sorted(set(ends))}, "clean": check["clean"],
            "settle_s": round(settle_s, 2)}


async def main_async(args) -> list[dict]:
    work = pathlib.Path(tempfile.mkdtemp(prefix="blink-restart-"))
    ring = f"blink-restart-{os.getpid()}"
    serve_args = ["--model", args.model, "--max-batch-size", str(max(16, args.streams)), *args.serve_args]
    geometry = ring_geometry(None, None, None)
    serve = ServeUnderTest(ring, serve_args, work / "serve.log")
    out = []
    try:
        for victim in args.kills.split(","):
            r = await one_kill(serve, victim, args, geometry)
            out.append(r)
            print(f"kill -9 {victim} under {args.streams} streams ({args.model}): served again after "
                  f"{r['kill_to_served_s']:.2f} s; streams {r['stream_ends']}; leak-free {r['clean']}", flush=True)
    finally:
        serve.stop()
    status, _ = http_get(serve.base + "/health", 1)
    assert status == 0, "serve left its frontend behind"
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    results = asyncio.run(main_async(args))
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "streams": args.streams, "kills": results}, indent=1))
    return 0 if all(r["clean"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
