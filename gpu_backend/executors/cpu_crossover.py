"""The decode batch above which a quantized model's projections multiply float weights instead of their
int8 blocks, measured on this machine once, at load.

    CpuExecutor (after prepare_model) -> decide(model): every layer's QuantKernelLinears, timed at
    PROBE_ROWS rows both ways (matmul_blocks: int8 codes x the blocks; matmul_float: the packed bf16
    copy or dequantized slices into oneDNN's GEMM), alternating, best of REPEATS -> limit
    (choose_limit) -> every QuantKernelLinear's int8_rows (its max_rows) and, through them,
    FusedDecode's largest step (decode steps past the limit take the per-call loop, whose
    projections then multiply float weights). BLINK_INT8_MAX_ROWS=N pins the limit instead.

Why: which side wins depends on the CPU, not on the model. On the 2-core AVX512 EPYC (Zen 4) the blocks
win at every decode batch (SmolLM2's 30 layers at 64 rows, measured at load: 33.7 ms on the X16 tiles
against 40.9 ms for oneDNN's bf16 GEMM); on the 2-core AVX2 EPYC, float32 slices into oneDNN's sgemm
beat the AVX2 blocks from ~32-64 rows (Q4_1 3072 x 576 at 64 rows: 3.6 against 4.7 ms); on a CPU with AMX, oneDNN's bf16
GEMM runs on the tile unit (its bf16 rate is ~8x vpdpbusd's on zmm), where it should win from small
batches on. A fixed limit is right on one of them at most. All the layers, as a step reads them: a
sample of two layers sat in L3, where SmolLM2's bf16 copies (3.5x the blocks' bytes) looked as fast as
the blocks at 64 rows (2.43 / 2.38 ms), which they are not from DRAM. The measurement takes ~0.3 s here.
Float weights are also the more exact side (float activations, no int8 codes), so a lower limit
never costs accuracy.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from .cpu_decode import MAX_DECODE_ROWS
from .cpu_linear import QuantKernelLinear

log = logging.getLogger("blink.gpu_daemon")

ENV = "BLINK_INT8_MAX_ROWS"
PROBE_ROWS = (16, 64)          # a decode batch of 8-16 streams, and of 64
REPEATS = 2
# Float weights must take at most this fraction of the blocks' time to be chosen: the machine's noise
# (a shared 2-core box moves ±10% between identical runs) must not flip the choice.
MARGIN = 0.85
# Models smaller than this (weights in the projections) are not timed: call overhead, not the matmuls.
MIN_SAMPLE_WEIGHTS = 1 << 20


def choose_limit(timings: dict[int, tuple[float, float]]) -> int:
    """{rows: (blocks seconds, float seconds)} -> the largest decode batch the blocks keep: half the
    smallest probe at which float weights win by MARGIN, else MAX_DECODE_ROWS (every decode batch)."""
    for rows in sorted(timings):
        blocks, floats = timings[rows]
        if floats <= MARGIN * blocks:
            return max(1, rows // 2)
    return MAX_DECODE_ROWS


def _seconds(fn, xs: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    fn(xs)
    return time.perf_counter() - t0


def measure(mats: list[QuantKernelLinear], dtype: torch.dtype, threads: int) -> dict[int, tuple[float, float]]:
    """{rows: (blocks, float)}: the best of REPEATS alternating passes over `mats`, each way."""
    timings = {}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in PROBE_ROWS:
            xs = [torch.randn(rows, m.in_features, generator=gen).to(dtype) for m in mats]
            ways = (lambda xs: [m.matmul_blocks(x, threads) for m, x in zip(mats, xs)],
                    lambda xs: [m.matmul_float(x) for m, x in zip(mats, xs)])
            for way in ways:                                   # warm: codes buffers, oneDNN's kernels
                way(xs)
            best = [min(_seconds(way, xs) for _ in range(REPEATS)) for way in ways]
            timings[rows] = (best[0], best[1])
    return timings


def decide(model: torch.nn.Module) -> int | None:
    """Set every QuantKernelLinear's int8_rows (not the logits head's) from BLINK_INT8_MAX_ROWS or a
    measurement; one log line. Returns the limit, or None where nothing was set (no quantized
    projections, or too small to time)."""
    mats = [m for m in model.modules() if isinstance(m, QuantKernelLinear) and not m.float32_out]
    if not mats:
        return None
    pinned = os.environ.get(ENV, "").strip()
    if pinned:
        if not pinned.isdigit() or int(pinned) < 1:
            raise ValueError(f"{ENV}={pinned!r}: a positive number of rows")
        limit, how = int(pinned), ENV
    elif sum(m.in_features * m.out_features for m in mats) < MIN_SAMPLE_WEIGHTS:
        return None
    else:
        t0 = time.perf_counter()
        timings = measure(mats, getattr(model, "dtype", torch.float32), torch.get_num_threads())
        limit = choose_limit(timings)
        how = f"measured in {time.perf_counter() - t0:.2f} s (the projections on the blocks / on float weights): " + \
            ", ".join(f"{r} rows {b * 1e3:.1f} / {f * 1e3:.1f} ms" for r, (b, f) in sorted(timings.items()))
    for m in mats:
        m.int8_rows = limit
    if limit >= MAX_DECODE_ROWS:
        log.info("decode batches stay on the int8 blocks at every size: %s", how)
    else:
        log.info("decode batches above %d rows multiply float weights: %s", limit, how)
    return limit
