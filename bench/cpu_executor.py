"""CPU executor benchmark: decode tokens/s at several batch sizes and TTFT for
several prompt lengths, against the plain unbatched generate loop
(gpu_backend.model.reference.greedy_generate) on the same model in the same run.

    load_model(spec) -> baseline: greedy_generate timings
                     -> executor: Engine + CpuRunner over a real Ring (in memory),
                        requests submitted through FrontendPort, tokens read back
    -> bench/results/<date>-<machine>-cpu_executor.json + .md

    python -m bench.cpu_executor [--model default] [--threads N] [--machine cpu2]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import random
import time

import numpy as np
import torch

from gpu_backend.engine import Engine
from gpu_backend.executors import ExecutorOptions
from gpu_backend.executors.cpu import CpuExecutor
from gpu_backend.model import greedy_generate
from gpu_backend.model.loader import load_model
from shared_layout import FrontendPort, Ring, RingGeometry, SlotRequest, SlotState

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


class Submitter:
    """Frontend stand-in: one request per slot, arenas laid out by slot index."""

    def __init__(self, ring: Ring, max_prompt: int, max_out: int):
        self.ring, self.port = ring, FrontendPort(ring)
        self.max_prompt, self.max_out, self.seq = max_prompt, max_out, 0

    def submit(self, slot: int, prompt: list[int], max_tokens: int) -> None:
        if self.ring.state[slot] == SlotState.DECODE_COMPLETED:
            self.port.reset(slot)
        self.seq += 1
        req = SlotRequest(seq=self.seq, prompt_offset=slot * self.max_prompt, prompt_len=len(prompt),
                          output_offset=slot * self.max_out, max_tokens=max_tokens, ignore_eos=True,
                          t_submit_ns=time.monotonic_ns())
        self.port.submit(slot, req, np.asarray(prompt, np.int32))

    def generated(self, slots) -> np.ndarray:
        return self.ring.generated[list(slots)].astype(np.int64)


def prompt_of(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def baseline(model, rng, vocab, prompt_lens, decode_tokens) -> dict:
    out = {"ttft_s": {}, "decode_tok_s": None}
    for n in prompt_lens:
        p = prompt_of(rng, n, vocab)
        t = time.perf_counter()
        greedy_generate(model, p, 1)
        out["ttft_s"][n] = time.perf_counter() - t
    p = prompt_of(rng, 128, vocab)
    t = time.perf_counter()
    greedy_generate(model, p, 1)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    greedy_generate(model, p, decode_tokens + 1)
    tn = time.perf_counter() - t
    out["decode_tok_s"] = decode_tokens / (tn - t1)
    return out


def executor_decode(engine: Engine, sub: Submitter, rng, vocab, batch: int, decode_tokens: int) -> float:
    """Aggregate decode tokens/s with `batch` requests decoding together (prefill excluded)."""
    slots = list(range(batch))
    for s in slots:
        sub.submit(s, prompt_of(rng, 128, vocab), decode_tokens + 1)
    while (sub.generated(slots) < 1).any():         # prefill everyone first
        engine.step()
    start_tokens = int(sub.generated(slots).sum())
    t = time.perf_counter()
    while engine.has_work():
        engine.step()
    dt = time.perf_counter() - t
    return (int(sub.generated(slots).sum()) - start_tokens) / dt


def executor_ttft(engine: Engine, sub: Submitter, rng, vocab, n: int) -> float:
    sub.submit(0, prompt_of(rng, n, vocab), 1)
    while engine.has_work() or sub.ring.state[0] == SlotState.PREFILL_PENDING:
        engine.step()
    r = sub.ring.slots[0]
    return (int(r["t_first_ns"]) - int(r["t_submit_ns"])) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--prompts", default="128,512,2048")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--machine", default="cpu2")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    prompt_lens = [int(p) for p in args.prompts.split(",")]
    rng = random.Random(0)
    model = load_model(args.model).model
    vocab = model.config.vocab_size
    load_before = os.getloadavg()
    wall0, cpu0 = time.perf_counter(), time.process_time()

    base = baseline(model, rng, vocab, prompt_lens, args.decode_tokens)
    max_batch = max(batches)
    ex = CpuExecutor(ExecutorOptions(model=args.model, max_batch_size=max_batch, max_prefill_tokens=2048,
                                     kv_cache_mb=1024, threads=args.threads), model=model)
    geom = RingGeometry(max_batch, max_batch * max(prompt_lens), max_batch * (args.decode_tokens + 1))
    ring = Ring.create(bytearray(geom.total_size), geom)
    engine = ex.engine(ring)
    sub = Submitter(ring, max(prompt_lens), args.decode_tokens + 1)
    executor_ttft(engine, sub, rng, vocab, 16)                     # warm-up
    decode = {b: executor_decode(engine, sub, rng, vocab, b, args.decode_tokens) for b in batches}
    ttft = {n: executor_ttft(engine, sub, rng, vocab, n) for n in prompt_lens}

    cpu_share = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    argv_used = ["--threads", str(torch.get_num_threads()), "--batches", args.batches, "--prompts", args.prompts,
                 "--decode-tokens", str(args.decode_tokens), "--date", args.date, "--machine", args.machine]
    result = {
        "bench": "cpu_executor", "date": args.date, "machine": args.machine,
        "host": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                 "python": platform.python_version(), "loadavg_before": load_before,
                 "loadavg_after": os.getloadavg(),
                 "cpu_seconds_per_wall_second": cpu_share},
        "command": ".venv/bin/python -m bench.cpu_executor " + " ".join(argv_used),
        "model": args.model, "dtype": str(model.dtype), "decode_tokens_per_request": args.decode_tokens,
        "baseline_unbatched": {"decode_tok_s": base["decode_tok_s"],
                               "ttft_s": {str(k): v for k, v in base["ttft_s"].items()}},
        "executor": {"decode_tok_s": {str(b): v for b, v in decode.items()},
                     "ttft_s": {str(k): v for k, v in ttft.items()}},
        "ratios": {
            "decode_vs_batch1": {str(b): decode[b] / decode[batches[0]] for b in batches},
            "decode_vs_baseline": {str(b): decode[b] / base["decode_tok_s"] for b in batches},
            "ttft_baseline_over_executor": {str(n): base["ttft_s"][n] / ttft[n] for n in prompt_lens},
        },
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{args.date}-{args.machine}-cpu_executor"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(result, batches, prompt_lens))
    print(stem.with_suffix(".md").read_text())
    return 0


def markdown(r: dict, batches, prompt_lens) -> str:
    b0 = r["baseline_unbatched"]
    ex = r["executor"]
    lines = [f"# CPU executor, {r['model']} ({r['dtype']}), {r['machine']}, {r['date']}", "",
             f"{r['host']['cpus']} CPUs, {r['host']['torch_threads']} torch threads, load average before "
             f"{r['host']['loadavg_before'][0]:.1f} (the box is shared: this process got "
             f"{r['host']['cpu_seconds_per_wall_second']:.2f} CPU-seconds per second). Baseline: the unbatched greedy_generate loop on the "
             f"same model in the same run. Decode: 128-token prompts, {r['decode_tokens_per_request']} "
             f"tokens each, prefill excluded.", "",
             "| decode batch | tokens/s (aggregate) | vs executor batch 1 | vs unbatched loop |",
             "|---:|---:|---:|---:|"]
    for b in batches:
        lines.append(f"| {b} | {ex['decode_tok_s'][str(b)]:.1f} | {r['ratios']['decode_vs_batch1'][str(b)]:.2f}x "
                     f"| {r['ratios']['decode_vs_baseline'][str(b)]:.2f}x |")
    lines.append(f"| unbatched loop | {b0['decode_tok_s']:.1f} | | 1.00x |")
    lines += ["", "| prompt tokens | TTFT executor (s) | TTFT unbatched loop (s) | loop / executor |",
              "|---:|---:|---:|---:|"]
    for n in prompt_lens:
        lines.append(f"| {n} | {ex['ttft_s'][str(n)]:.3f} | {b0['ttft_s'][str(n)]:.3f} "
                     f"| {r['ratios']['ttft_baseline_over_executor'][str(n)]:.2f}x |")
    lines += ["", f"Reproduce: `{r['command']}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
