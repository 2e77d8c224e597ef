"""Prepacked oneDNN linears: the CPU executor's fast path for every projection.

    LlamaModel (loaded) -> fuse_projections() (q|k|v and gate|up: 4 matmuls a layer,
    not 7) -> pack_linears(): every bfloat16 nn.Linear becomes a PackedLinear whose
    weight oneDNN has reordered once into its blocked layout, and the lm_head gets a
    packed copy as model.logits_head -> forward calls _linear_pointwise on it (with the
    CPU kernels, decode-sized batches take their small-batch matmul instead, and the
    logits head keeps float32 sums up to FLOAT32_LOGITS_MAX_ROWS sampled rows)

Why: decode on a CPU streams every weight once per step, and the plain bf16 matmul
re-blocks the weight on each call. Packed once, a 576x1536 decode projection runs in
~35 us instead of ~70 us and SmolLM2's 49152-row lm_head in ~1.5 ms instead of
~3.6 ms (1 thread, batch 1; measured on the 2-core dev machine), with bit-identical
results. PyTorch's own inductor (freezing on CPU) emits the same two ops.

float32 is left alone: there the packed path loses at batch 1 and wins at 8+, and the
auto dtype picks bf16 wherever the CPU has native bf16 math.

Quantized models (loader quantized=True: QuantLinear modules over GGUF blocks) keep
their blocks: fuse_quantized joins q|k|v and gate|up as rows of blocks, and each
QuantLinear becomes a QuantKernelLinear (quant.cc: int8 activations x the blocks, repacked
at load: Q4 matrices 8 or 16 rows a vector (X8, X16), the rest scales first; isa from BLINK_CPU_ISA);
batches above QUANT_MAX_ROWS rows (QUANT_X8_MAX_ROWS for X8 matrices: prompts, steps mixing
prompts and decode rows; or above the decode batch cpu_crossover measured at load, where lower)
meet float weights (float activations keep a prompt's near-ties where the float model has them):
on a bf16 model (CPUs with AVX512-BF16) a bf16 copy of the dequantized weight, packed for oneDNN
once at load (prefill_copies; past PREFILL_COPY_MAX_FRACTION of memory, bf16 slices dequantized per
call), elsewhere float32 slices into the float32 GEMM. A tied Q8_0 logits head (FloatActHead) meets
float activations (from G16_HEAD_MIN_ROWS rows, on AVX512-BF16, through its G16 copy; on AVX2, int16
codes per 32 values: logits within ~2e-3 of the float product). Without the
kernels every QuantLinear is dequantized to a float nn.Linear once, with a log line.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import NamedTuple

import torch
from torch import nn
import torch.nn.functional as F

from .. import cpu_kernels
from ..model.quantized import QuantLinear, dequantize_all, fuse_quantized

log = logging.getLogger("blink.gpu_daemon")


# Rows of x for which the small-batch kernel (cpu_kernels.linear) beats oneDNN's packed matmul:
# from 2 (one row streams at the same speed either way) to 8 (measured with SmolLM2's shapes,
# weights from DRAM, Zen 4, 1 thread: 30 layers at 8 rows 13.8 -> 10.8 ms, lm_head 3.4 -> 2.3 ms).
SMALL_BATCH_ROWS = range(2, cpu_kernels.LINEAR_MAX_ROWS + 1)


# Sampled rows a step up to which the logits head keeps float32 sums (the kernels' matmul, within
# ~10% of oneDNN's time up to 32 rows); past that oneDNN's blocked GEMM is 2x faster (64 rows:
# 9.7 vs 20.8 ms, SmolLM2's 49152 x 576 head, 1 thread) and its bf16 outputs are kept.
FLOAT32_LOGITS_MAX_ROWS = 32


class PackedLinear(nn.Module):
    """y = x @ W^T + b with W prepacked for oneDNN; same shapes and dtype as nn.Linear.

    Given the CPU kernels (AVX512-BF16), decode-sized batches (SMALL_BATCH_ROWS) go to their
    weight-streaming matmul instead, over the plain weight kept beside the packed one."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 kernels: cpu_kernels.CpuKernels | None = None, float32_out: bool = False):
        super().__init__()
        # The logits head: batches of up to FLOAT32_LOGITS_MAX_ROWS through the kernels' matmul
        # with float32 outputs, so sampling sees the unrounded sums, not bf16 logits that lie
        # 0.125 apart near 25 (a near-tie becomes a tie, which argmax breaks by token id).
        self.float32_out = float32_out
        self.out_features, self.in_features = weight.shape
        # The batch-size hint only tunes the blocking; bf16 timings barely depend on it.
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1),
                             persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)
        self.small = kernels if kernels is not None and kernels.linear_fits(weight) else None
        self.register_buffer("weight", weight.detach() if self.small else None, persistent=False)

    def takes_small(self, rows: int) -> bool:
        """Whether `rows` rows of x go to the small-batch kernel rather than oneDNN."""
        return self.small is not None and rows in SMALL_BATCH_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()
        if self.float32_out and self.small is not None and 0 < x2.shape[0] <= FLOAT32_LOGITS_MAX_ROWS:
            y = self.small.linear(x2, self.weight, self.bias, out_dtype=torch.float32)
        elif self.takes_small(x2.shape[0]):
            y = self.small.linear(x2, self.weight, self.bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return y.view(*lead, self.out_features)


# Rows of x up to which a projection runs on the blocks; above, its weight is dequantized a
# slice of DEQUANT_ROWS rows at a time (the float slice stays in L2) into oneDNN's float32 GEMM.
# Measured on the 2-core AVX2 EPYC (bench.cpu_executor, the same run): the blocks decode 2.25x /
# 1.36x / 0.99x / 0.71x the float32 executor's tokens/s at batch 1 / 8 / 16 / 64: quant.cc's AVX2
# path does ~40-48 G int8 ops/s a core and oneDNN's sgemm 50-79 GFLOP/s from ~16 rows on. The
# slices' dequantization (AVX2, into L2) adds ~0.3 ns a weight: Q4_1 3072 x 576, 1 thread, the
# blocks against slices + sgemm took 1.2 / 1.5 ms at 16 rows, 2.4 / 2.3 at 32, 4.7 / 3.6 at 64,
# 18.6 / 11.3 at 256. The logits head (sampled rows only; 49152 x 576) always runs on its blocks.
QUANT_MAX_ROWS = 32
# The same limit for matrices in the X8 layout (every segment Q4_0/Q4_1 with whole groups of 8 rows).
# Their int8 matmul is faster than the dequantized slices + sgemm well past 32 rows (the SmolLM2 Q4_1
# forward of one prompt, 2 threads, the AVX2 EPYC, best of 3, blocks / slices: 48 tokens 94 / 176 ms,
# 128 180 / 252, 512 757 / 831, 2048 4489 / 4482), but a prompt's int8 activation codes flip
# near-ties the float prefill keeps: at 1024 the README's "What is the capital of France?" (a
# ~40-token chat prompt) answered "L'Étoile, la Marseur, ..." instead of "Paris" (the first
# token's top two logits are 0.08 apart in float32). So prompts keep float activations past 32 rows.
QUANT_X8_MAX_ROWS = 32
DEQUANT_ROWS = 256          # 256 x 576 floats: 576 KiB
# A bf16 model's prompts (AVX512-BF16 CPUs; the activations are bf16 already) multiply bf16 weights:
# oneDNN's bf16 GEMM (vdpbf16ps) runs ~2.2x its float32 sgemm (SmolLM2's shapes, 128-1600 rows,
# 2 threads, Zen 4: ~420 against ~190 GFLOP/s). The products of bf16 values are exact in float32,
# so the one new rounding is the weight's, to bf16 (2^-9 relative, far inside Q4's own error): on the
# README's six chat prompts the served Q4_1 model keeps the float32 path's greedy picks (143 / 144
# teacher-forced tokens, against 139 for the float32 slices) and answers "Paris". The copy, packed once
# at load, prefills SmolLM2 (in process, 2 threads, Zen 4) 128 / 512 / 1600 tokens in 88 / 361 / 1565 ms
# against 204 / 728 / 2800 for the float32 slices and 129 / 415 / 1689 for bf16 slices dequantized per
# call; it costs 2 bytes a weight (SmolLM2: 212 MB), so all copies together stay within this fraction
# of the memory the process may use (physical, or a container's cgroup limit), and larger models
# dequantize bf16 slices per call instead.
PREFILL_COPY_MAX_FRACTION = 0.125


class SegmentInfo(NamedTuple):
    """One row segment of a fused quantized matrix: its ggml type, rows, values per row, type name."""
    wtype: int
    n: int
    k: int
    type_name: str


class QuantKernelLinear(nn.Module):
    """A QuantLinear computed by the CPU kernels: x [M, K] -> int8 codes per 32 values -> each
    segment's blocks x codes into its columns of y [M, N] (x's dtype; float32 for the logits)."""

    def __init__(self, quant: QuantLinear, kernels: cpu_kernels.CpuKernels, float32_out: bool = False):
        super().__init__()
        self.in_features, self.out_features = quant.in_features, quant.out_features
        self.float32_out = float32_out
        # What each segment is (type, rows, K), without its GGUF blocks: the repacked copy replaces them.
        self.segments = [SegmentInfo(seg.wtype, seg.n, seg.k, seg.type_name) for seg in quant.segments]
        self.register_buffer("bias", None if quant.bias is None else quant.bias.detach().float().contiguous(),
                             persistent=False)
        self.kernels, self.isa = kernels, kernels.quant_isa
        self._quantize, self._matmul = kernels.raw("quantize_act"), kernels.raw("quant_matmul")
        starts = [0]
        for seg in self.segments:
            starts.append(starts[-1] + seg.n)
        # Each segment's rows rearranged for the kernels (kernels.repack: the same bytes; Q4_0/Q4_1
        # 8 rows a vector, the rest with their scales first), in place of the GGUF copy.
        self._blocks = [kernels.repack(seg.wtype, seg.blocks, seg.k) for seg in quant.segments]
        # (type, blocks pointer, first output column, columns) per segment
        self._plan = [(t, b.data_ptr(), s0, seg.n) for (t, b), seg, s0 in zip(self._blocks, self.segments, starts)]
        self._x8 = all(t & cpu_kernels.GROUPED for t, _ in self._blocks)      # X8 or X16
        # The activation codes of the last row count, kept: a decode step's batch is the same size
        # step after step, and ~500 small allocations a step were ~1.5 ms of a 1-row step's
        # single-threaded time (cProfile, Q4_1 SmolLM2 on the AVX2 EPYC).
        self._codes: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._out: torch.Tensor | None = None
        # Prompts of a bf16 model: True -> bf16 slices per call; after keep_prefill_copy() the packed
        # bf16 weight (prefill_copies decides); False -> float32 slices.
        self.bf16_prefill = False
        self._prefill: torch.Tensor | None = None
        self._prefill_bias: torch.Tensor | None = None
        # The decode batch above which float weights win on this machine (cpu_crossover.decide, at
        # load); None: not measured, the fixed limits alone.
        self.int8_rows: int | None = None

    def max_rows(self) -> int:
        """Rows of x up to which the matmul runs on the blocks (above: float weights, matmul_float)."""
        cap = QUANT_X8_MAX_ROWS if self._x8 else QUANT_MAX_ROWS
        return cap if self.int8_rows is None else min(cap, self.int8_rows)

    def _codes_for(self, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Buffers for m rows' int8 codes [m, K], scales d and d * sum [m, K/32] (reused while m repeats)."""
        if self._codes is None or self._codes[0] != m:
            k = self.in_features
            self._codes = (m, torch.empty((m, k), dtype=torch.int8), torch.empty((m, k // 32)),
                           torch.empty((m, k // 32)))
        return self._codes[1:]

    def block_tensors(self) -> list[torch.Tensor]:
        """The weight bytes a 1-row matmul streams (bench.bandwidth counts them)."""
        return [b for _, b in self._blocks]

    def prefill_copy_bytes(self) -> int:
        """Bytes of the bf16 copy keep_prefill_copy() would make."""
        return 2 * self.in_features * self.out_features

    def keep_prefill_copy(self) -> None:
        """Prompts (above max_rows()) of bf16 activations: the dequantized weight in bf16, packed for
        oneDNN, multiplied by its bf16 GEMM (float32 sums, bf16 out; the bias rounded to bf16 as a
        bf16 model's is)."""
        w = torch.cat([self.kernels.dequantize(t, b, self.in_features) for t, b in self._blocks]).to(torch.bfloat16)
        self._prefill = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        self._prefill_bias = None if self.bias is None else self.bias.to(torch.bfloat16)
        self.bf16_prefill = True

    def extra_repr(self) -> str:
        kinds = "+".join(f"{s.type_name}[{s.n}]" for s in self.segments)
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks={kinds}, isa={self.isa}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.matmul(x.reshape(-1, self.in_features).contiguous(), torch.get_num_threads())
        return y.view(*lead, self.out_features)

    def matmul(self, x: torch.Tensor, threads: int, reuse_output: bool = False) -> torch.Tensor:
        """x [M, K] contiguous f32/bf16 -> y [M, N]. reuse_output: y is this module's buffer from the
        last call with as many rows (KernelForward, which reads each output within its layer)."""
        if x.shape[0] > self.max_rows() and not self.float32_out:
            return self.matmul_float(x)
        return self.matmul_blocks(x, threads, reuse_output)

    def matmul_float(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (bf16 or float32) @ the float weight: the packed bf16 copy (bf16 x, where kept), else
        the blocks dequantized a slice at a time into the float GEMM."""
        if self._prefill is not None and x.dtype == torch.bfloat16:
            return torch.ops.mkldnn._linear_pointwise(x, self._prefill, self._prefill_bias, "none", [], "")
        return self._dequantized_gemm(x)

    def matmul_blocks(self, x: torch.Tensor, threads: int, reuse_output: bool = False) -> torch.Tensor:
        """x [M, K] -> int8 codes per 32 values -> each segment's blocks x codes (quant.cc)."""
        m, k, n = x.shape[0], self.in_features, self.out_features
        out_dtype = torch.float32 if self.float32_out else x.dtype
        qs, d, s = self._codes_for(m)                                   # the codes, scales d and d * sum
        self._quantize(x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, qs.data_ptr(), d.data_ptr(),
                       s.data_ptr(), threads)
        y = self._out if reuse_output and self._out is not None and self._out.shape[0] == m \
            and self._out.dtype == out_dtype else torch.empty((m, n), dtype=out_dtype)
        if reuse_output:
            self._out = y
        size = y.element_size()
        for wtype, ptr, col, cols in self._plan:
            bias = None if self.bias is None else self.bias.data_ptr() + 4 * col
            self._matmul(wtype, ptr, qs.data_ptr(), d.data_ptr(), s.data_ptr(), bias, y.data_ptr() + size * col,
                         int(out_dtype == torch.bfloat16), n, m, cols, k, self.isa, threads)
        return y


    def _dequantized_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """y = x @ W^T (+ bias) in x's dtype, W dequantized DEQUANT_ROWS rows at a time: in float32, or
        (bf16_prefill and bf16 x) in bf16 with float32 sums, the bias added in float32."""
        bf16 = self.bf16_prefill and x.dtype == torch.bfloat16
        xf = x if bf16 else x.float()
        y = torch.empty((x.shape[0], self.out_features), dtype=xf.dtype)
        for (wtype, blocks), seg, (_, _, col, _) in zip(self._blocks, self.segments, self._plan):
            for r0 in range(0, seg.n, DEQUANT_ROWS):
                w = self.kernels.dequantize(wtype, blocks[r0:r0 + DEQUANT_ROWS], self.in_features)
                y[:, col + r0:col + r0 + w.shape[0]] = torch.mm(xf, w.to(xf.dtype).t())
        if self.bias is not None:
            y = y.float() + self.bias if bf16 else y.add_(self.bias)
        return y if y.dtype == x.dtype else y.to(x.dtype)


# Sampled rows up to which the tied logits head multiplies its Q8_0 blocks with float activations;
# above, the float token-embedding table through the float GEMM. SmolLM2's 49152 x 576 head on
# the 2-core AVX2 EPYC, 2 threads, best of 10 (the blocks / the float32 table): 3.1 / 8.5 ms at
# 1 row, 4.8 / 16.4 at 8, 9.2 / 18.3 at 16, 18.2 / 26.7 at 32 (a noisy machine; the float
# table reads 3.8x the bytes and is bandwidth-bound to ~16 rows).
FX_HEAD_MAX_ROWS = 32
# Sampled rows from which a bf16 model's Q8_0 head (CPUs with AVX512-BF16) multiplies its G16 copy
# (q8_bf16.cc: exact bf16 codes, vdpbf16ps, float32 sums) instead of the blocks: SmolLM2's head, 2
# threads, Zen 4, 15 alternating rounds, median (the blocks / G16): 3.94 / 2.25 ms at 4 rows, 5.42 /
# 3.15 at 8, 8.85 / 4.30 at 16, 13.96 / 5.72 at 32, and at 64 9.93 against 11.2 for the bf16 table
# (whose logits are rounded to bf16). At 1-3 rows reading the bytes is the cost, and the copy has
# twice the blocks' (0.83 ms at 1 row on the blocks).
G16_HEAD_MIN_ROWS = 4


class FloatActHead(nn.Module):
    """A tied logits head over its GGUF blocks: x [M, K] -> float32 logits [M, V] = x @ dequant(W)^T,
    the float32 matmul of the dequantized table in another summation order (no int8 activation codes;
    on AVX2 x in int16 codes per 32 values, one part in 65534 of each block's largest value: SmolLM2's
    logits within 2e-3 of the float64 product, 0.65 ms a 1-row step faster on Zen 1, quant.cc's
    matmul_q8_x16; the table then in P8 groups of 8 rows, matmul_p8: another ~0.4 ms).
    A Q8_0 head of a bf16 model on an AVX512-BF16 CPU keeps a G16 copy for batches of
    G16_HEAD_MIN_ROWS rows or more: the same sums from bf16 dot products (every product exact)."""

    def __init__(self, quant: QuantLinear, kernels: cpu_kernels.CpuKernels, table: torch.Tensor):
        super().__init__()
        if len(quant.segments) != 1 or quant.bias is not None:
            raise ValueError("a tied logits head is one unbiased matrix")
        self.in_features, self.out_features = quant.in_features, quant.out_features
        seg = quant.segments[0]
        self.type_name = seg.type_name
        self.table = table.detach()                 # [V, K]: the embedding weight (shared, not a copy)
        self._fn, self.isa = kernels.raw("quant_matmul_fx"), kernels.quant_isa
        # bf16 activations on AVX512-BF16: the G16 copy (None elsewhere, or for other types and shapes).
        self.g16 = kernels.q8bf16_pack(seg.blocks, seg.k) if seg.wtype == 8 and table.dtype == torch.bfloat16 \
            else None
        self._g16_fn = kernels.raw("q8bf16_matmul")
        # scales first; on the AVX2 path a Q8_0 table in groups of 8 rows (P8: matmul_p8's int16 codes)
        self.wtype, self.blocks = kernels.repack(seg.wtype, seg.blocks, seg.k, x8=False, p8=self.isa == 1)
        self._ptr = self.blocks.data_ptr()

    def block_tensors(self) -> list[torch.Tensor]:
        """The bytes a 1-row batch streams: the blocks, not the float table or the G16 copy."""
        return [self.blocks]

    def extra_repr(self) -> str:
        g16 = f", g16 from {G16_HEAD_MIN_ROWS} rows" if self.g16 is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks={self.type_name}{g16}"

    def on_blocks(self, m: int, dtype: torch.dtype) -> bool:
        """Whether m rows of x in `dtype` take the blocks with float32 activations (quant_matmul_fx;
        what forward.cc's head runs for a decode step), not the G16 copy or the float table."""
        return m <= FX_HEAD_MAX_ROWS and not (self.g16 is not None and m >= G16_HEAD_MIN_ROWS
                                              and dtype == torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        m = x2.shape[0]
        if self.on_blocks(m, x2.dtype):
            xf = x2.float().contiguous()
            y = torch.empty((m, self.out_features))
            self._fn(self.wtype, self._ptr, xf.data_ptr(), self.in_features, None, y.data_ptr(), 0,
                     self.out_features, m, self.out_features, self.in_features, self.isa, torch.get_num_threads())
            return y.view(*lead, self.out_features)
        if self.g16 is not None and m >= G16_HEAD_MIN_ROWS and x2.dtype == torch.bfloat16:
            xb = x2.contiguous()
            y = torch.empty((m, self.out_features))
            self._g16_fn(self.g16.data_ptr(), xb.data_ptr(), self.in_features, y.data_ptr(), self.out_features, m,
                         self.out_features, self.in_features, torch.get_num_threads())
            return y.view(*lead, self.out_features)
        return F.linear(x2.to(self.table.dtype), self.table).float().view(*lead, self.out_features)


def serve_quantized(model: nn.Module, kernels: cpu_kernels.CpuKernels | None) -> int:
    """Quantized matrices of `model` (in place): fused and computed on their blocks given the
    kernels, else dequantized to float (one log line). Returns how many stay quantized."""
    if not any(isinstance(m, QuantLinear) for m in model.modules()):
        return 0
    if kernels is None:
        log.warning("no CPU kernels: dequantized %d quantized matrices to %s", dequantize_all(model),
                    str(model.dtype).removeprefix("torch."))
        return 0
    fuse_quantized(model)
    count = 0
    head = getattr(model, "logits_head", None)
    if isinstance(head, QuantLinear) and getattr(model, "lm_head", True) is None:
        # A tied head: float activations keep near-ties apart that int8 activation codes flip
        # (SmolLM2's "The" vs "L", 0.08 apart in float32, answering the README's question: the
        # int8 codes put "L" 0.05 ahead), so its blocks meet float activations (quant.cc's _fx
        # matmul: the float32 matmul of the dequantized table, at the blocks' bytes; on AVX2 with x
        # in int16 codes, which move logits by at most ~2e-3 there: the 0.08 stays), and large
        # batches multiply the float token-embedding table already in memory.
        model.logits_head = FloatActHead(head, kernels, model.embed_tokens.weight)
        count += 1
    elif isinstance(head, QuantLinear):    # float32 sums for sampling (an untied lm_head is the same module)
        model.logits_head = QuantKernelLinear(head, kernels, float32_out=True)
        count += 1
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantLinear):
                setattr(parent, name, QuantKernelLinear(child, kernels))
                count += 1
    if getattr(model, "dtype", None) == torch.bfloat16 and kernels.has_bf16_linear and packing_available():
        prefill_copies(model, _physical_memory() * PREFILL_COPY_MAX_FRACTION)
    return count


# A container's memory limit (cgroup v2, then v1): "max" or a huge number where there is none.
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def _physical_memory(limits: tuple[str, ...] = CGROUP_LIMITS) -> int:
    """The memory this process may use: physical memory, or a smaller cgroup limit (a container's)."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in limits:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            return min(total, int(text))
    return total


def prefill_copies(model: nn.Module, budget_bytes: float) -> bool:
    """Prompts of a bf16 model's QuantKernelLinears on bf16 weights: packed copies when all of them
    fit `budget_bytes` (True), else bf16 slices dequantized per call (False). One log line."""
    layers = [m for m in model.modules() if isinstance(m, QuantKernelLinear) and not m.float32_out]
    total = sum(m.prefill_copy_bytes() for m in layers)
    if total > budget_bytes:
        for m in layers:
            m.bf16_prefill, m._prefill, m._prefill_bias = True, None, None
        log.info("prompts dequantize bf16 weight slices per call: copies would take %.0f MB (budget %.0f MB)",
                 total / 1e6, budget_bytes / 1e6)
        return False
    for m in layers:
        m.keep_prefill_copy()
    log.info("prompts multiply packed bf16 copies of %d quantized matrices (%.0f MB)", len(layers), total / 1e6)
    return True


@functools.cache
def packing_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """True when this torch build can pack `dtype` linears and the result matches F.linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(24, 16, generator=gen).to(dtype)
        x = torch.randn(3, 16, generator=gen).to(dtype)
        got = PackedLinear(w, None)(x).float()
        want = torch.nn.functional.linear(x, w).float()
        return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2))
    except (RuntimeError, AttributeError) as e:      # no mkldnn ops in this build / this CPU
        log.info("prepacked linears unavailable: %s", e)
        return False


def pack_linears(model: nn.Module, kernels: cpu_kernels.CpuKernels | None = None) -> int:
    """Replace every bf16 CPU nn.Linear in `model` (in place) by a PackedLinear, and give a
    LlamaModel a packed logits_head. Returns how many matmuls were packed (0: left as is)."""
    if not packing_available():
        return 0
    count = 0
    head = getattr(model, "lm_head_weight", None)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and _packable(child.weight) and child.weight is not head:
                setattr(parent, name, PackedLinear(child.weight, child.bias, kernels))
                count += 1
    quantized_head = isinstance(getattr(model, "logits_head", None), (QuantKernelLinear, FloatActHead))
    if head is not None and _packable(head) and not quantized_head:   # an untied lm_head stays as is for state_dict()
        model.logits_head = PackedLinear(head, None, kernels, float32_out=True)
        count += 1
    return count


def _packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16


def prepare_model(model: nn.Module, kernels: cpu_kernels.CpuKernels | None = None) -> nn.Module:
    """The CPU executor's one-time model setup: quantized matrices onto the kernels (or
    dequantized), fuse the projections, pack the bf16 matmuls (with `kernels`, decode-sized
    batches take their small-batch matmul)."""
    quantized = serve_quantized(model, kernels)
    if quantized:
        log.info("serving %d quantized matmuls from their GGUF blocks (%s path)", quantized,
                 cpu_kernels.ISA_NAMES[kernels.quant_isa])
    if hasattr(model, "fuse_projections"):
        model.fuse_projections()
    n = pack_linears(model, kernels)
    if n:
        log.info("prepacked %d bf16 matmuls for oneDNN", n)
    return model
