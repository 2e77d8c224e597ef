"""Where one stream's decode step goes on this CPU: the 30 layers' fused decode against the logits
head, at 1 and 2 threads (issue 21: 1-stream decode as a fraction of the bandwidth bound).

    python -m bench.decode_split [--cpus 0,1]
    -> per context: the median ms of the layers (KernelForward: embedding, RoPE table, the fused
       layers over the served Q4_1 blocks, the paged attention over the executor's pool), of the
       head (the model's logits head on their last row: on a CPU without AVX512-BF16 the tied Q8_0
       head on float activations, `quant_matmul_fx`) and of the attention alone (the 30 layers'
       decode attention kernel over the same pool, one raw ctypes call a layer: a part of the layers' time),
       then the head alone at 1 and 2 threads with its bytes: a head that halves with twice the
       threads is compute-bound, not bandwidth-bound; then the head's largest logit error against
       the float64 product with its dequantized table, one row a call over the hidden states of a
       96-token prompt (what the served head computes per decode row: on AVX2 int16 activation codes)

The default model through CpuExecutor (--dtype auto, what `blink serve` serves), one row over its own
blocks at each context. A session harness made permanent so the numbers in bench/results reproduce;
not a test (timing only). Sampling and the serving path are not in it: the rest of a served TPOT.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from gpu_backend.executors import ExecutorOptions
from gpu_backend.executors.cpu import CpuExecutor
from gpu_backend.executors.cpu_forward import KernelForward
from gpu_backend.paged_attention import PagedBatch

CONTEXTS = (64, 192, 256)
STEPS = 20
ROUNDS = 7


def _median_ms(fn, n: int) -> float:
    ts = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        ts.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(ts)


def _attention(ex: CpuExecutor, batch: PagedBatch):
    """One step's decode attention alone: the kernel once a layer over that layer's pool, one query row."""
    cfg, pool = ex.model.config, ex.pool
    h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = torch.randn(1, h + 2 * kvh, d, dtype=ex.model.dtype)
    out = torch.empty(1, h, d, dtype=ex.model.dtype)
    tables, lens = batch.decode_block_tables.contiguous(), batch.decode_context_lens.contiguous()
    fn = ex.kernels.raw("decode_attention", ex.model.dtype, pool.k.dtype)      # no checks: ~1 us a call
    _, num_blocks, bs, _ = pool.k[0].shape
    layers = [(pool.k[i].data_ptr(), pool.v[i].data_ptr()) for i in range(cfg.num_layers)]

    def step():
        for kc, vc in layers:
            fn(qkv.data_ptr(), (h + 2 * kvh) * d, kc, vc, tables.data_ptr(), None, tables.shape[1], lens.data_ptr(),
               out.data_ptr(), 1, h, kvh, d, num_blocks, bs, d ** -0.5, torch.get_num_threads())
    return step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpus", default=None,
                    help="pin to these CPUs first (e.g. 0,1: two cores of a bigger machine, as on our 2-core ones)")
    args = ap.parse_args(argv)
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    from .cpu_executor import cpu_description
    cpu = cpu_description()
    print(f"cpu: {cpu['model']}, quant path {cpu['quant_isa']}, on CPUs {sorted(os.sched_getaffinity(0))}; "
          f"flags {' '.join(cpu['simd_flags'])}", flush=True)
    torch.set_num_threads(2)
    ex = CpuExecutor(ExecutorOptions(model="default", dtype="auto", kv_cache_mb=512))
    m = ex.model
    forward = KernelForward(m, ex.pool, ex.kernels)
    head = m.logits_head
    print(f"head: {head}", flush=True)
    bs = ex.pool.config.block_size
    with torch.inference_mode():
        for ctx in CONTEXTS:
            per = -(-ctx // bs)
            batch = PagedBatch.build([(ctx - 1, 1, list(range(per)))], bs)
            ids = torch.randint(0, m.config.vocab_size, (1,))
            pos = torch.full((1,), ctx - 1)
            h = forward(ids, pos, batch)
            for _ in range(3):
                forward(ids, pos, batch)
                m.compute_logits(h[-1:])
            layers = _median_ms(lambda: forward(ids, pos, batch), STEPS)
            logits = _median_ms(lambda: m.compute_logits(h[-1:]), STEPS)
            attention = _median_ms(_attention(ex, batch), STEPS)
            print(f"ctx {ctx}: layers {layers:.3f} ms, head {logits:.3f} ms, attention alone {attention:.3f} ms "
                  f"(2 threads)", flush=True)
        x = torch.randn(1, m.config.hidden_size)
        nbytes = sum(t.numel() * t.element_size() for t in getattr(head, "block_tensors", lambda: [])())
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for _ in range(3):
                m.compute_logits(x)
            ms = _median_ms(lambda: m.compute_logits(x), STEPS)
            rate = f", {nbytes / ms / 1e6:.1f} GB/s of its blocks" if nbytes else ""
            print(f"head alone, {threads} thread(s): {ms:.3f} ms{rate}", flush=True)
        table = getattr(head, "table", None)
        if table is not None:
            n = 96
            batch = PagedBatch.build([(0, n, list(range(-(-n // bs))))], bs)
            ids = torch.randint(0, m.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
            h = forward(ids, torch.arange(n), batch)
            err = max(float((m.compute_logits(h[i:i + 1]).double() - h[i:i + 1].double() @ table.double().T)
                            .abs().max()) for i in range(n))
            print(f"head error: max |logit - float64 product| {err:.2e} over {n} rows, one a call", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
