"""Two A/Bs of the quantized CPU kernels, each alternating in one process (issue 21: decode batches of
8-64 streams), the numbers behind the README's X16 and G16 figures:

    python -m bench.quant_layout_ab
    -> projections: per row count, the median ms of 15 layers of SmolLM2's Q4_1 projection shapes
       (960 / 576 / 3072 x 576, 576 x 1536; random weights, 53 MB a layout: past L3, as a step reads
       them) in the X8 layout (ymm tiles) and the X16 layout (zmm tiles), on the avx512 path
    -> head: per row count, the median ms of the embedded model's tied Q8_0 head on its blocks (1-32 rows;
       the bf16 table above) and on its G16 copy (q8_bf16.cc), the two toggled on one FloatActHead

Needs AVX512-VNNI (projections) and AVX512-BF16 (head); says so and skips the part otherwise. ROUNDS
(default 9) rounds, THREADS (default 2) threads. Timing only, not a test.
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from gpu_backend import cpu_kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]     # SmolLM2's fused qkv, o, gate|up, down
LAYERS = 15
PROJECTION_ROWS = (1, 2, 4, 8, 16, 32, 64)
HEAD_ROWS = (1, 4, 8, 16, 32, 64)


def _median_ms(fns: dict[str, callable], rounds: int) -> dict[str, float]:
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def projections(kernels: cpu_kernels.CpuKernels, rounds: int, threads: int) -> None:
    if kernels.quant_isa < 2:
        print("projections: no avx512 path on this CPU (or BLINK_CPU_ISA narrows it): skipped")
        return
    rng = np.random.default_rng(0)
    layouts: dict[str, list] = {"x8": [], "x16": []}
    for _ in range(LAYERS):
        for n, k in SHAPES:
            w = np.ascontiguousarray(quants.quantize(rng.standard_normal((n, k)).astype(np.float32), Q.Q4_1))
            blocks = torch.from_numpy(w)
            for name in layouts:
                wtype, packed = kernels.repack(int(Q.Q4_1), blocks, k, x16=name == "x16")
                layouts[name].append((wtype, packed, n, k))
    matmul = kernels.raw("quant_matmul")
    print(f"projections: {LAYERS} layers of {SHAPES}, Q4_1, {threads} threads, median of {rounds} alternating")
    for m in PROJECTION_ROWS:
        acts = {k: kernels.quantize_activations(torch.randn(m, k)) for k in {k for _, k in SHAPES}}
        y = torch.empty(m, max(n for n, _ in SHAPES))

        def run(mats):
            for wtype, packed, n, k in mats:
                qs, d, s = acts[k]
                matmul(wtype, packed.data_ptr(), qs.data_ptr(), d.data_ptr(), s.data_ptr(), None, y.data_ptr(), 0, n,
                       m, n, k, 2, threads)

        ms = _median_ms({name: (lambda mats=mats: run(mats)) for name, mats in layouts.items()}, rounds)
        print(f"  {m:3d} rows: x8 {ms['x8']:.2f} ms, x16 {ms['x16']:.2f} ms ({ms['x16'] / ms['x8']:.3f})", flush=True)


def head(rounds: int) -> None:
    from gpu_backend.executors import ExecutorOptions
    from gpu_backend.executors.cpu import CpuExecutor
    ex = CpuExecutor(ExecutorOptions(model="default", dtype="auto", kv_cache_mb=128))
    h = ex.model.logits_head
    g16 = getattr(h, "g16", None)
    if g16 is None:
        print("head: no G16 copy (no AVX512-BF16 here, or BLINK_CPU_ISA narrows it): skipped")
        return
    print(f"head: {h}, median of {rounds} alternating")
    with torch.inference_mode():
        for m in HEAD_ROWS:
            x = torch.randn(m, h.in_features).to(ex.model.dtype)

            def way(copy):
                def fn():
                    h.g16 = copy
                    h(x)
                return fn

            ms = _median_ms({"blocks": way(None), "g16": way(g16)}, rounds)
            h.g16 = g16
            print(f"  {m:3d} rows: blocks (table past 32 rows) {ms['blocks']:.2f} ms, g16 {ms['g16']:.2f} ms",
                  flush=True)


def main() -> int:
    threads = int(os.environ.get("THREADS", 2))
    rounds = int(os.environ.get("ROUNDS", 9))
    torch.set_num_threads(threads)
    kernels = cpu_kernels.load()
    if kernels is None:
        print("no CPU kernels here (no g++)")
        return 1
    projections(kernels, rounds, threads)
    head(rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
