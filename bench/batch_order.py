"""Makespan of one mixed offline batch through `blink serve`, `--order file` vs `--order blend`.

    build_batch(): a batch file of three kinds of work (real text from the corpus, exact token
        lengths by the served tokenizer, ignore_eos so every run does the same work):
          prefix groups   GROUPS groups of GROUP_SIZE chat requests sharing a long system prompt
                          (SYSTEM_TOKENS), a short question each, GROUP_OUTPUT tokens out
          long prompts    completions over a distinct DOC_TOKENS document, DOC_OUTPUT tokens out
          long outputs    chat requests with a short prompt, STORY_OUTPUT tokens out
        file order: the rows in a seeded random order, tasks interleaved, as a file written
        while walking a mixed dataset is (not grouped by task, not sorted by length)
    -> for each order: a fresh `blink serve` (dpu_frontend.batch.server.ServeChild: nothing
       cached from the other run) with --max-batch-size = --concurrency, the batch through
       dpu_frontend.batch.runner.run_batch (what `blink run-batch` runs), makespan = first
       request sent to last response, server stopped
    -> NAME.json (machine, load average at start, per-order makespan and outputs) and NAME.md

    python -m bench.batch_order --out bench/results/<date>-<machine>-batch-order
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time

import numpy as np

from dpu_frontend.batch.batch_file import read_requests
from dpu_frontend.batch.runner import run_batch
from dpu_frontend.batch.server import ServeChild
from dpu_frontend.tokenizer import load_tokenizer

from . import machine
from .workload import PromptMaker

GROUPS, GROUP_SIZE, SYSTEM_TOKENS, GROUP_OUTPUT = 3, 8, 320, 12
DOCS, DOC_TOKENS, DOC_OUTPUT = 8, 320, 8
STORIES, STORY_OUTPUT = 16, 128
TOPICS = ("a lighthouse", "a lost key", "the first snow", "a robot cook", "an old map", "a night train",
          "a small dragon", "a chess match", "the last bus", "a garden", "a storm at sea", "a radio",
          "a paper boat", "a broken clock", "a quiet library", "a long bridge")


def build_batch(tokenizer, seed: int = 0) -> list[dict]:
    """The batch's rows in file order."""
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer)
    rows = []
    for g in range(GROUPS):
        system, _ = maker.make(SYSTEM_TOKENS, rng)
        for q in range(GROUP_SIZE):
            rows.append({"custom_id": f"manual{g}-q{q}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "system", "content": system},
                                               {"role": "user", "content": f"Question {q}: what does part {q + 1} say?"}],
                                  "max_tokens": GROUP_OUTPUT, "ignore_eos": True, "temperature": 0}})
    for d in range(DOCS):
        doc, _ = maker.make(DOC_TOKENS, rng)
        rows.append({"custom_id": f"doc{d}", "method": "POST", "url": "/v1/completions",
                     "body": {"prompt": f"Summarize in one line:\n{doc}\nSummary:", "max_tokens": DOC_OUTPUT,
                              "ignore_eos": True, "temperature": 0}})
    for s in range(STORIES):
        rows.append({"custom_id": f"story{s}", "method": "POST", "url": "/v1/chat/completions",
                     "body": {"messages": [{"role": "user", "content": f"Write a long story about {TOPICS[s]}."}],
                              "max_tokens": STORY_OUTPUT, "ignore_eos": True, "temperature": 0}})
    random.Random(seed).shuffle(rows)
    return rows


def run_order(src: pathlib.Path, order: str, concurrency: int, serve_args: list[str], workdir: pathlib.Path,
              tokenizer) -> dict:
    out = workdir / f"out-{order}.jsonl"
    with ServeChild(["--max-batch-size", str(concurrency), *serve_args], ready_timeout_s=600) as server:
        load = os.getloadavg()
        summary = asyncio.run(run_batch(read_requests(src), set(), server.url, str(out), order=order,
                                        concurrency=concurrency, tokenizer=tokenizer, show_progress=False))
    records = [json.loads(t) for t in out.read_text().splitlines()]
    completion = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in records if r["error"] is None)
    prompt = sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in records if r["error"] is None)
    return {"order": order, "makespan_s": round(summary.makespan_s, 2), "ok": summary.ok, "failed": summary.failed,
            "prompt_tokens": prompt, "completion_tokens": completion, "loadavg_at_start": load,
            "completion_order": [r["custom_id"] for r in records]}


def _git_head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu_flags() -> list[str]:
    want = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16")
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return []
    return [w for w in want if w in flags]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight = the server's batch size")
    ap.add_argument("--orders", default="file,blend")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", default="", help="more blink serve flags, e.g. '--threads 2'")
    ap.add_argument("--out", type=pathlib.Path, help="write NAME.json and NAME.md")
    args = ap.parse_args(argv)
    info = machine.machine_info()
    info["cpu_flags"] = _cpu_flags()
    info["git_head"] = _git_head()
    tokenizer = load_tokenizer("default")
    rows = build_batch(tokenizer, args.seed)
    runs = []
    with tempfile.TemporaryDirectory(prefix="blink-batch-order-") as tmp:
        workdir = pathlib.Path(tmp)
        src = workdir / "in.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        for order in args.orders.split(","):
            t0 = time.monotonic()
            runs.append(run_order(src, order, args.concurrency, args.serve_args.split(), workdir, tokenizer))
            print(f"{order}: makespan {runs[-1]['makespan_s']:.1f} s ({time.monotonic() - t0:.0f} s with the "
                  f"server's start), {runs[-1]['ok']} ok, {runs[-1]['failed']} failed", file=sys.stderr, flush=True)
    by = {r["order"]: r for r in runs}
    ratio = by["file"]["makespan_s"] / by["blend"]["makespan_s"] if {"file", "blend"} <= set(by) else None
    result = {"machine": info, "concurrency": args.concurrency, "seed": args.seed, "serve_args": args.serve_args,
              "batch": {"groups": GROUPS, "group_size": GROUP_SIZE, "system_tokens": SYSTEM_TOKENS,
                        "group_output": GROUP_OUTPUT, "docs": DOCS, "doc_tokens": DOC_TOKENS,
                        "doc_output": DOC_OUTPUT, "stories": STORIES, "story_output": STORY_OUTPUT,
                        "file_order": [r["custom_id"] for r in rows]},
              "runs": runs, "speedup_blend_over_file": round(ratio, 3) if ratio else None}
    cmd = "python -m bench.batch_order " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"machine: {info['cpu_model']} ({', '.join(info['cpu_flags'])}), {info['logical_cpus']} CPUs, "
             f"load average at start {info['loadavg_at_start']}, git {info['git_head']}",
             f"batch: {len(rows)} requests: {GROUPS} groups of {GROUP_SIZE} chat requests sharing a "
             f"{SYSTEM_TOKENS}-token system prompt ({GROUP_OUTPUT} tokens out), {DOCS} completions over distinct "
             f"{DOC_TOKENS}-token documents ({DOC_OUTPUT} out), {STORIES} short chat prompts ({STORY_OUTPUT} out); "
             f"ignore_eos; file order: the rows shuffled with seed {args.seed} (tasks interleaved)",
             f"server: blink serve, embedded SmolLM2-135M, CPU executor, --max-batch-size {args.concurrency} = "
             f"requests in flight; a fresh server per order"]
    for r in runs:
        lines.append(f"--order {r['order']}: makespan {r['makespan_s']:.1f} s, {r['ok']} ok / {r['failed']} failed, "
                     f"{r['prompt_tokens']} prompt + {r['completion_tokens']} completion tokens, "
                     f"load average at its start {tuple(round(x, 2) for x in r['loadavg_at_start'])}")
    if ratio:
        lines.append(f"blend / file: {ratio:.2f}x shorter makespan")
    print("\n".join(lines))
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        args.out.with_suffix(".md").write_text(f"# bench.batch_order\n\n`{cmd}`\n\n" + "\n".join(
            f"- {x}" for x in lines) + "\n")


if __name__ == "__main__":
    main()
