"""CPU executor benchmark: decode tokens/s at several batch sizes and TTFT for
several prompt lengths, against the plain unbatched generate loop
(gpu_backend.model.reference.greedy_generate) on the same model in the same run,
decode of the same executor without its fused C++ kernels (the PyTorch layer and
oneDNN matmuls, on a second copy of the model), and, for a GGUF source (the
default model included), the executor serving the GGUF's quantized blocks
(quant.cc; what `--dtype auto` serves), all interleaved.

    load_model(spec) -> baseline: greedy_generate timings
                     -> executor: Engine + CpuRunner over a real Ring (in memory),
                        requests submitted through FrontendPort, tokens read back
                     -> the same over load_model(spec, quantized=True)
    -> bench/results/<date>-<machine>-cpu_executor[-dtype].json + .md (CPU model and flags named)

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

from .bandwidth import triad_gb_s, weight_bytes_per_token
from gpu_backend.engine import Engine
from gpu_backend.executors import ExecutorOptions
from gpu_backend.executors.cpu import CpuExecutor
from gpu_backend.model import greedy_generate
from gpu_backend.model.loader import load_model
from shared_layout import FrontendPort, Ring, RingGeometry, SlotRequest, SlotState

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
DECODE_PROMPT_TOKENS = 128     # prompt length of the decode-throughput requests


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


def baseline_ttft(model, rng, vocab, n: int) -> float:
    p = prompt_of(rng, n, vocab)
    t = time.perf_counter()
    greedy_generate(model, p, 1)
    return time.perf_counter() - t


def baseline_decode(model, rng, vocab, decode_tokens: int) -> float:
    """Unbatched decode tokens/s: (time for prefill + N + 1 tokens) - (time for prefill + 1 token)."""
    p = prompt_of(rng, DECODE_PROMPT_TOKENS, vocab)
    t = time.perf_counter()
    greedy_generate(model, p, 1)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    greedy_generate(model, p, decode_tokens + 1)
    tn = time.perf_counter() - t
    return decode_tokens / (tn - t1)


def executor_decode(engine: Engine, sub: Submitter, rng, vocab, batch: int, decode_tokens: int) -> float:
    """Aggregate decode tokens/s with `batch` requests decoding together (prefill excluded)."""
    slots = list(range(batch))
    for s in slots:
        sub.submit(s, prompt_of(rng, DECODE_PROMPT_TOKENS, vocab), decode_tokens + 1)
    while (sub.generated(slots) < 1).any():         # prefill everyone first
        if not engine.step() and not engine.has_work():
            raise RuntimeError("requests ended before their first token (ring too small?)")
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


def cpu_description() -> dict:
    """The CPU model, its SIMD flags that matter here, and the quantized matmul's path."""
    from gpu_backend import cpu_kernels
    model, flags = platform.processor(), []
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), model)
        all_flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
        flags = [f for f in all_flags if f.startswith(("avx", "amx", "fma", "f16c"))]
    except OSError:
        pass
    kernels = cpu_kernels.load()
    isa = cpu_kernels.ISA_NAMES[kernels.quant_isa] if kernels else None
    return {"model": model, "simd_flags": flags, "quant_isa": isa}


def make_engine(model, args, max_batch: int, geom: RingGeometry, max_prompt: int, kernels: bool = True):
    ex = CpuExecutor(ExecutorOptions(model=args.model, max_batch_size=max_batch, max_prefill_tokens=2048,
                                     kv_cache_mb=1024, threads=args.threads), model=model, kernels=kernels)
    ring = Ring.create(bytearray(geom.total_size), geom)
    engine = ex.engine(ring)
    return engine, Submitter(ring, max_prompt, args.decode_tokens + 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16"),
                    help="weights and KV of both the executor and the baseline loop")
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--prompts", default="128,512,2048")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions; the best of each is reported")
    ap.add_argument("--machine", default="cpu2")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    prompt_lens = [int(p) for p in args.prompts.split(",")]
    rng = random.Random(0)
    from gpu_backend.executors.cpu import resolve_dtype
    model = load_model(args.model, dtype=resolve_dtype(args.dtype)).model
    vocab = model.config.vocab_size
    load_before = os.getloadavg()
    wall0, cpu0 = time.perf_counter(), time.process_time()

    max_batch = max(batches)
    max_prompt = max(prompt_lens + [DECODE_PROMPT_TOKENS])
    geom = RingGeometry(max_batch, max_batch * max_prompt, max_batch * (args.decode_tokens + 1))
    engine, sub = make_engine(model, args, max_batch, geom, max_prompt)
    # The same executor without the fused kernels, over its own copy of the model and its own ring.
    engine_plain, sub_plain = make_engine(load_model(args.model, dtype=resolve_dtype(args.dtype)).model, args,
                                          max_batch, geom, max_prompt, kernels=False)
    # The same executor on the GGUF's quantized blocks (None: the source has none, or no kernels).
    quant_model = load_model(args.model, dtype=resolve_dtype(args.dtype), quantized=True).model
    quant = make_engine(quant_model, args, max_batch, geom, max_prompt) if any(
        type(m).__name__ == "QuantLinear" for m in quant_model.modules()) else None
    if quant is not None and quant[0].runner.kernel_forward is None:
        quant = None
    kernels_used = engine.runner.kernel_forward is not None
    bandwidth = triad_gb_s(args.threads)                            # before the runs: the box as they find it
    weight_bytes = {"executor": weight_bytes_per_token(engine.runner.model)}
    if quant is not None:
        weight_bytes["executor_quantized"] = weight_bytes_per_token(quant[0].runner.model)
    executor_ttft(engine, sub, rng, vocab, 16)                     # warm-up
    if quant is not None:
        executor_ttft(*quant, rng, vocab, 16)
    # Interleaved repetitions, best of each: the box is shared, so contention bursts hit
    # single measurements, not the best of several taken side by side.
    runs = {"baseline_decode": [], "baseline_ttft": {n: [] for n in prompt_lens},
            "decode": {b: [] for b in batches}, "decode_pytorch_layer": {b: [] for b in batches},
            "ttft": {n: [] for n in prompt_lens},
            "decode_quantized": {b: [] for b in batches}, "ttft_quantized": {n: [] for n in prompt_lens}}
    for _ in range(args.reps):
        runs["baseline_decode"].append(baseline_decode(model, rng, vocab, args.decode_tokens))
        for b in batches:
            runs["decode"][b].append(executor_decode(engine, sub, rng, vocab, b, args.decode_tokens))
            runs["decode_pytorch_layer"][b].append(
                executor_decode(engine_plain, sub_plain, rng, vocab, b, args.decode_tokens))
            if quant is not None:
                runs["decode_quantized"][b].append(executor_decode(*quant, rng, vocab, b, args.decode_tokens))
        for n in prompt_lens:
            runs["baseline_ttft"][n].append(baseline_ttft(model, rng, vocab, n))
            runs["ttft"][n].append(executor_ttft(engine, sub, rng, vocab, n))
            if quant is not None:
                runs["ttft_quantized"][n].append(executor_ttft(*quant, rng, vocab, n))
    base = {"decode_tok_s": max(runs["baseline_decode"]),
            "ttft_s": {n: min(v) for n, v in runs["baseline_ttft"].items()}}
    decode = {b: max(v) for b, v in runs["decode"].items()}
    decode_plain = {b: max(v) for b, v in runs["decode_pytorch_layer"].items()}
    ttft = {n: min(v) for n, v in runs["ttft"].items()}
    decode_q = {b: max(v) for b, v in runs["decode_quantized"].items()} if quant else {}
    ttft_q = {n: min(v) for n, v in runs["ttft_quantized"].items()} if quant else {}
    one = {"executor": decode.get(1), "executor_quantized": decode_q.get(1)}
    bound = {"triad_gb_s": bandwidth, "threads": torch.get_num_threads(),
             "weight_mb_per_token": {k: v / 2**20 for k, v in weight_bytes.items()},
             "decode_bound_tok_s": {k: bandwidth * 1e9 / v for k, v in weight_bytes.items()},
             "decode_1_fraction_of_bound": {k: one[k] / (bandwidth * 1e9 / v) for k, v in weight_bytes.items()
                                            if one.get(k)}}
    quant_kinds = sorted({s.type_name for mod in quant_model.modules() for s in getattr(mod, "segments", [])})

    cpu_share = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    argv_used = ["--threads", str(torch.get_num_threads()), "--dtype", args.dtype, "--batches", args.batches, "--prompts", args.prompts,
                 "--decode-tokens", str(args.decode_tokens), "--reps", str(args.reps), "--date", args.date, "--machine", args.machine]
    result = {
        "bench": "cpu_executor", "date": args.date, "machine": args.machine,
        "host": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                 "python": platform.python_version(), "loadavg_before": load_before,
                 "loadavg_after": os.getloadavg(),
                 "cpu_seconds_per_wall_second": cpu_share, "cpu": cpu_description()},
        "command": ".venv/bin/python -m bench.cpu_executor " + " ".join(argv_used),
        "model": args.model, "dtype": str(model.dtype), "decode_tokens_per_request": args.decode_tokens,
        "reps": args.reps,
        "baseline_unbatched": {"decode_tok_s": base["decode_tok_s"],
                               "ttft_s": {str(k): v for k, v in base["ttft_s"].items()}},
        "executor": {"decode_tok_s": {str(b): v for b, v in decode.items()},
                     "ttft_s": {str(k): v for k, v in ttft.items()}, "fused_kernels": kernels_used},
        "executor_pytorch_layer": {"decode_tok_s": {str(b): v for b, v in decode_plain.items()}},
        "bandwidth": bound,
        "executor_quantized": None if not quant else {
            "weights": quant_kinds, "decode_tok_s": {str(b): v for b, v in decode_q.items()},
            "ttft_s": {str(k): v for k, v in ttft_q.items()}},
        "all_runs": {"baseline_decode_tok_s": runs["baseline_decode"],
                     "baseline_ttft_s": {str(k): v for k, v in runs["baseline_ttft"].items()},
                     "executor_decode_tok_s": {str(k): v for k, v in runs["decode"].items()},
                     "pytorch_layer_decode_tok_s": {str(k): v for k, v in runs["decode_pytorch_layer"].items()},
                     "executor_ttft_s": {str(k): v for k, v in runs["ttft"].items()},
                     "quantized_decode_tok_s": {str(k): v for k, v in runs["decode_quantized"].items()},
                     "quantized_ttft_s": {str(k): v for k, v in runs["ttft_quantized"].items()}},
        "ratios": {
            "decode_vs_batch1": {str(b): decode[b] / decode[batches[0]] for b in batches},
            "decode_vs_baseline": {str(b): decode[b] / base["decode_tok_s"] for b in batches},
            "decode_vs_pytorch_layer": {str(b): decode[b] / decode_plain[b] for b in batches},
            "ttft_baseline_over_executor": {str(n): base["ttft_s"][n] / ttft[n] for n in prompt_lens},
            "decode_quantized_vs_executor": {str(b): decode_q[b] / decode[b] for b in decode_q},
            "ttft_executor_over_quantized": {str(n): ttft[n] / ttft_q[n] for n in ttft_q},
        },
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if model.dtype == torch.float32 else "-" + str(model.dtype).removeprefix("torch.")
    stem = out / f"{args.date}-{args.machine}-cpu_executor{suffix}"
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
             f"same model in the same run. Decode: {DECODE_PROMPT_TOKENS}-token prompts, {r['decode_tokens_per_request']} "
             f"tokens each, prefill excluded. Best of {r['reps']} interleaved runs. 'PyTorch layer': the same "
             f"executor without the fused C++ kernels (fused kernels in the executor column: "
             f"{'yes' if ex['fused_kernels'] else 'NO, not built here'}).", "",
             "| decode batch | tokens/s (aggregate) | vs executor batch 1 | vs unbatched loop "
             "| PyTorch layer tokens/s | kernels / PyTorch layer |",
             "|---:|---:|---:|---:|---:|---:|"]
    for b in batches:
        lines.append(f"| {b} | {ex['decode_tok_s'][str(b)]:.1f} | {r['ratios']['decode_vs_batch1'][str(b)]:.2f}x "
                     f"| {r['ratios']['decode_vs_baseline'][str(b)]:.2f}x "
                     f"| {r['executor_pytorch_layer']['decode_tok_s'][str(b)]:.1f} "
                     f"| {r['ratios']['decode_vs_pytorch_layer'][str(b)]:.2f}x |")
    lines.append(f"| unbatched loop | {b0['decode_tok_s']:.1f} | | 1.00x | | |")
    lines += ["", "| prompt tokens | TTFT executor (s) | TTFT unbatched loop (s) | loop / executor |",
              "|---:|---:|---:|---:|"]
    for n in prompt_lens:
        lines.append(f"| {n} | {ex['ttft_s'][str(n)]:.3f} | {b0['ttft_s'][str(n)]:.3f} "
                     f"| {r['ratios']['ttft_baseline_over_executor'][str(n)]:.2f}x |")
    q = r.get("executor_quantized")
    if q:
        lines += ["", f"GGUF blocks served as such ({'+'.join(q['weights'])}; what `--dtype auto` serves), "
                  f"the same executor, same run:", "",
                  f"| decode batch | blocks tokens/s | {r['dtype']} tokens/s | blocks / {r['dtype']} |",
                  "|---:|---:|---:|---:|"]
        for b in batches:
            lines.append(f"| {b} | {q['decode_tok_s'][str(b)]:.1f} | {ex['decode_tok_s'][str(b)]:.1f} "
                         f"| {r['ratios']['decode_quantized_vs_executor'][str(b)]:.2f}x |")
        lines += ["", f"| prompt tokens | TTFT blocks (s) | TTFT {r['dtype']} (s) | {r['dtype']} / blocks |",
                  "|---:|---:|---:|---:|"]
        for n in prompt_lens:
            lines.append(f"| {n} | {q['ttft_s'][str(n)]:.3f} | {ex['ttft_s'][str(n)]:.3f} "
                         f"| {r['ratios']['ttft_executor_over_quantized'][str(n)]:.2f}x |")
    bw = r.get("bandwidth")
    if bw:
        lines += ["", f"Memory bandwidth (triad, {bw['threads']} threads): {bw['triad_gb_s']:.1f} GB/s. "
                  "Weights a decode step reads, the 1-stream decode that bandwidth allows, and the "
                  "measured 1-stream decode as a fraction of it:", "",
                  "| executor | MiB / token | bound tok/s | batch 1 / bound |", "|---|---:|---:|---:|"]
        for k, mb in bw["weight_mb_per_token"].items():
            frac = bw["decode_1_fraction_of_bound"].get(k)
            lines.append(f"| {k} | {mb:.1f} | {bw['decode_bound_tok_s'][k]:.0f} | "
                         f"{'-' if frac is None else f'{frac:.2f}'} |")
    cpu = r["host"]["cpu"]
    lines += ["", f"CPU: {cpu['model']} ({' '.join(cpu['simd_flags'])}); quantized matmul path: {cpu['quant_isa']}.",
              "", f"Reproduce: `{r['command']}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
