"""The fused decode step over a float32 KV pool against a bf16 one: the same model, the same step,
rounds alternating in one process (issue 21: the KV bytes a CPU without bf16 math reads).

    python -m bench.kv_dtype_ab                      (on an AVX512-BF16 CPU: BLINK_CPU_ISA=avx2 first,
                                                      so the model computes in float32 as there)
    -> per (rows, context): the median ms of the 30 layers' fused decode (embedding and RoPE table
       included, not the head or sampling) over ROUNDS rounds of 20 steps, each pool

The default model through CpuExecutor (the served Q4_1 blocks, --dtype auto), two KVPools of its
shape with random K/V, every row at its whole context over its own blocks. A session harness
made permanent so the numbers in bench/results reproduce; not a test (timing only).
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from gpu_backend.executors import ExecutorOptions
from gpu_backend.executors.cpu import CpuExecutor
from gpu_backend.executors.cpu_forward import KernelForward
from gpu_backend.kv_pool import KVPool
from gpu_backend.paged_attention import PagedBatch

SHAPES = [(1, 256), (1, 1024), (8, 512)]      # (rows, context)
STEPS = 20


def main() -> int:
    torch.set_num_threads(int(os.environ.get("THREADS", 2)))
    rounds = int(os.environ.get("ROUNDS", 7))
    ex = CpuExecutor(ExecutorOptions(model="default", dtype="auto", kv_cache_mb=512))
    m = ex.model
    print(f"BLINK_CPU_ISA={os.environ.get('BLINK_CPU_ISA', '')} model {m.dtype}, the executor's pool "
          f"{ex.pool.k.dtype}", flush=True)
    pools = {"float32": KVPool(ex.pool.config, dtype=torch.float32),
             "bfloat16": KVPool(ex.pool.config, dtype=torch.bfloat16)}
    for p in pools.values():
        p.k.normal_(0, 1)
        p.v.normal_(0, 1)
    forwards = {k: KernelForward(m, p, ex.kernels) for k, p in pools.items()}
    bs = ex.pool.config.block_size
    for rows, ctx in SHAPES:
        per = -(-ctx // bs)
        batch = PagedBatch.build([(ctx - 1, 1, list(range(r * per, (r + 1) * per))) for r in range(rows)], bs)
        ids = torch.randint(0, m.config.vocab_size, (rows,))
        pos = torch.full((rows,), ctx - 1)
        ms = {k: [] for k in forwards}
        with torch.inference_mode():
            for f in forwards.values():
                for _ in range(3):
                    f(ids, pos, batch)
            for _ in range(rounds):
                for k, f in forwards.items():
                    t0 = time.perf_counter()
                    for _ in range(STEPS):
                        f(ids, pos, batch)
                    ms[k].append((time.perf_counter() - t0) / STEPS * 1e3)
        print(f"rows {rows} ctx {ctx}: " + ", ".join(f"{k} {statistics.median(v):.3f} ms (min {min(v):.3f})"
                                                      for k, v in ms.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
