"""Fused CPU kernels (kernels.cc, quant.cc, attention.cc, forward.cc, q8_bf16.cc) for the CPU
executor, built once with g++ and called by ctypes.

    kernels.cc + quant.cc + attention.cc + forward.cc + q8_bf16.cc --g++ -O3 -march=native -fopenmp-->
      ${BLINK_CACHE_DIR:-~/.cache/blink}/cpu_kernels/
      <hash of sources, flags, compiler, CPU flags>/libblink_cpu_kernels.so (published atomically)
    -> load() -> CpuKernels: add_rms_norm, rope_cache, decode_attention, silu_mul,
       prefill_attention (causal, flash-attention style over the paged pool),
       (on CPUs with AVX512-BF16) linear for decode-sized batches, and quant_linear: matmuls
       over GGUF Q4_0/Q4_1/Q8_0/Q4_K weight blocks on int8-quantized activations, on torch
       tensors (shapes and dtypes checked here, data pointers handed to C), and forward_decode:
       a quantized model's whole decoder stack for a step of decode rows in one call
       (forward.cc over the team bodies of the others; executors/cpu_decode.py builds its
       descriptors), and (AVX512-BF16) q8bf16: a Q8_0 matrix repacked once as exact bf16 codes,
       times bf16 activations with float32 sums (q8_bf16.cc: the tied logits head of a batch)

quant.cc has a scalar, an AVX2 and an AVX512-VNNI path, attention.cc a scalar, an AVX2, an
AVX512F and (prefill of bf16 data) an AVX512-BF16 path; `isa` picks one per call, and
BLINK_CPU_ISA=scalar|avx2|avx512|avx512bf16 (read here, once) narrows the defaults (quant_isa,
attention_isa), so each path can be tested on a machine that has a wider one.

-march=native is why the CPU's flags are part of the cache key: a cache shared between
machines never hands one CPU another's build. No compiler, or a failed build, makes
load() return None with one log line; the executor then runs the plain PyTorch layer.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib

import torch

from ..cuda.build import BuildError, _publish, _run, _version, find_gxx

log = logging.getLogger("blink.gpu_daemon")

SOURCE = pathlib.Path(__file__).resolve().parent / "kernels.cc"
SOURCES = tuple(SOURCE.with_name(name) for name in ("kernels.cc", "quant.cc", "attention.cc", "forward.cc", "q8_bf16.cc"))
MARCH_ENV = "BLINK_CPU_MARCH"   # the build's -march (default native): x86-64-v3 builds an AVX2-only CPU's library here
GXX_FLAGS = ["-std=c++17", "-O3", f"-march={os.environ.get(MARCH_ENV, 'native')}", "-fopenmp", "-fno-math-errno",
             "-fno-trapping-math", "-fPIC", "-shared", "-Wall", "-Wextra"]
LIB_NAME = "libblink_cpu_kernels.so"
SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
# The kernels that touch the KV pool also take float32 activations over a bf16 pool (half the bytes).
POOL_KERNELS = ("rope_cache", "decode_attention", "prefill_attention")
MIXED_SUFFIX = "f32kv16"
MAX_HEAD_DIM = 1024          # kernels.cc keeps a row's two halves on the stack
LINEAR_MAX_ROWS = 8          # kernels.cc's small-batch matmul: rows of x in one pass (kMaxRowsX)
LINEAR_K_MULTIPLE = 32       # ... and its inner dimension comes in whole 32-element vectors

_i64, _f32, _int, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "add_rms_norm": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32, _int],
    "rope_cache": [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _int],
    "decode_attention": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64,
                         _i64, _i64, _f32, _int],
    "silu_mul": [_ptr, _ptr, _i64, _i64, _int],
}
_LINEAR_ARGS = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int]
_QUANT_SIGNATURES = {        # quant.cc's C ABI: name -> (argtypes, restype)
    "quant_isa_max": ([], _int),
    "quant_row_bytes": ([_int, _i64], _i64),
    "quantize_act": ([_ptr, _int, _i64, _i64, _ptr, _ptr, _ptr, _int], None),
    "quant_matmul": ([_int, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _int, _i64, _i64, _i64, _i64, _int, _int], _int),
    "quant_dequantize": ([_int, _ptr, _ptr, _i64, _i64, _int], _int),
    "quant_repack": ([_int, _ptr, _ptr, _i64, _i64], _int),
    "quant_matmul_fx": ([_int, _ptr, _ptr, _i64, _ptr, _ptr, _int, _i64, _i64, _i64, _i64, _int, _int], _int),
    "attention_isa_max": ([], _int),
    "forward_decode": ([_ptr, _ptr, _int], _int),
    "q8bf16_available": ([], _int),                                     # q8_bf16.cc
    "q8bf16_bytes": ([_i64, _i64], _i64),
    "q8bf16_pack": ([_ptr, _ptr, _i64, _i64, _int], _int),
    "q8bf16_matmul": ([_ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _int], _int),
}
_PREFILL_ATTENTION_ARGS = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _f32,
                           _int, _int]
QUANT_TYPES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K"}     # ggml type id -> name: what quant.cc reads
SPLIT = 0x100           # | a type id: its rows repacked by CpuKernels.repack (f16 scales first, then codes)
X8 = 0x200              # | Q4_0 / Q4_1: groups of 8 rows interleaved block by block (CpuKernels.repack)
X16 = 0x400             # | Q4_0 / Q4_1: the same in groups of 16 rows (zmm; where the avx512 path runs)
GROUPED = X8 | X16      # either: the matmul reads rows interleaved in groups
P8 = 0x800              # | Q8_0: groups of 8 rows, codes interleaved in pairs (quant_linear_fx's int16 codes, AVX2)
QUANT_TYPES.update({SPLIT | t: f"{QUANT_TYPES[t]}(split)" for t in (2, 3, 8)})
QUANT_TYPES.update({X8 | t: f"{QUANT_TYPES[t]}(x8)" for t in (2, 3)})
QUANT_TYPES.update({X16 | t: f"{QUANT_TYPES[t]}(x16)" for t in (2, 3)})
QUANT_TYPES[P8 | 8] = "Q8_0(p8)"
# The kernels' paths, narrowest first (quant.cc's go to avx512, attention.cc's to avx512bf16).
ISA_NAMES = ("scalar", "avx2", "avx512", "avx512bf16")
ISA_ENV = "BLINK_CPU_ISA"


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("BLINK_CACHE_DIR", "~/.cache/blink")).expanduser() / "cpu_kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build(gxx: str | None = None) -> pathlib.Path:
    """The kernels as a shared library (cached; a second call only hashes)."""
    gxx = gxx or find_gxx()
    if gxx is None:
        raise BuildError("no C++ compiler found (g++); set BLINK_CXX")
    h = hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES))
    for part in (gxx, _version(gxx), _cpu_flags(), *GXX_FLAGS):
        h.update(part.encode())

    def compile_to(tmp: pathlib.Path) -> pathlib.Path:
        out = tmp / LIB_NAME
        _run([gxx, *GXX_FLAGS, *map(str, SOURCES), "-o", str(out)],
             "g++ cpu_kernels/" + " ".join(src.name for src in SOURCES))
        return out

    return _publish(compile_to, cache_root() / h.hexdigest()[:16], LIB_NAME)


class CpuKernels:
    """The loaded library; every method takes contiguous CPU tensors of one dtype (bf16 or f32)."""

    def __init__(self, lib: ctypes.CDLL):
        self._fns = {}
        for suffix in (*SUFFIX.values(), MIXED_SUFFIX):
            for name, argtypes in _SIGNATURES.items():
                if suffix == MIXED_SUFFIX and name not in POOL_KERNELS:
                    continue
                fn = getattr(lib, f"blink_{name}_{suffix}")
                fn.argtypes, fn.restype = argtypes, None
                self._fns[name, suffix] = fn
        self.has_bf16_linear = bool(lib.blink_has_bf16_linear())
        self._linear = lib.blink_linear_bf16
        self._linear.argtypes, self._linear.restype = _LINEAR_ARGS, None
        self._linear_f32out = lib.blink_linear_bf16_f32out
        self._linear_f32out.argtypes, self._linear_f32out.restype = _LINEAR_ARGS, None
        for name, (argtypes, restype) in _QUANT_SIGNATURES.items():
            fn = getattr(lib, f"blink_{name}")
            fn.argtypes, fn.restype = argtypes, restype
            self._fns[name, "quant"] = fn
        self.quant_isa_max = int(self._fns["quant_isa_max", "quant"]())   # the widest path built for this CPU
        self.quant_isa = requested_isa(self.quant_isa_max)                  # the default path (BLINK_CPU_ISA)
        for suffix in (*SUFFIX.values(), MIXED_SUFFIX):
            fn = getattr(lib, f"blink_prefill_attention_{suffix}")
            fn.argtypes, fn.restype = _PREFILL_ATTENTION_ARGS, None
            self._fns["prefill_attention", suffix] = fn
        self.attention_isa_max = int(self._fns["attention_isa_max", "quant"]())
        self.attention_isa = requested_isa(self.attention_isa_max)
        # q8_bf16.cc's matmul: built for this CPU (AVX512-BF16), and BLINK_CPU_ISA does not narrow below it.
        bf16 = len(ISA_NAMES) - 1
        self.has_q8bf16 = bool(self._fns["q8bf16_available", "quant"]()) and requested_isa(bf16) == bf16

    def _fn(self, name: str, dtype: torch.dtype, kv_dtype: torch.dtype | None = None):
        """The function for activations of `dtype` (and, for the pool kernels, a pool of kv_dtype:
        the same, or bfloat16 under float32)."""
        kv = dtype if kv_dtype is None else kv_dtype
        if kv == dtype and dtype in SUFFIX:
            return self._fns[name, SUFFIX[dtype]]
        if name in POOL_KERNELS and self.pool_dtypes_ok(dtype, kv):     # float32 over bf16
            return self._fns[name, MIXED_SUFFIX]
        raise TypeError(f"cpu kernel {name}: dtype {dtype} over a {kv} pool not supported (bfloat16, float32, "
                        f"or float32 over bfloat16)")

    @staticmethod
    def pool_dtypes_ok(dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """The pool kernels take activations of `dtype` over a pool of `kv_dtype`."""
        return dtype in SUFFIX and (kv_dtype == dtype or (dtype == torch.float32 and kv_dtype == torch.bfloat16))

    def raw(self, name: str, dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype | None = None):
        """The ctypes function itself (argument order as in kernels.cc's C ABI), for a caller
        that checked its shapes once and calls per layer: no checks, ~1 us a call."""
        if name == "linear":
            if dtype != torch.bfloat16 or not self.has_bf16_linear:
                raise TypeError("cpu kernel linear: bf16 on AVX512-BF16 only")
            return self._linear
        if name in ("quantize_act", "quant_matmul", "quant_dequantize", "quant_matmul_fx", "quant_repack",
                    "forward_decode", "q8bf16_matmul"):
            return self._fns[name, "quant"]
        return self._fn(name, dtype, kv_dtype)

    @staticmethod
    def supports(dtype: torch.dtype, head_dim: int) -> bool:
        return dtype in SUFFIX and head_dim % 2 == 0 and head_dim <= MAX_HEAD_DIM

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """x [rows, n] (the residual stream; x += delta in place when delta is given) ->
        RMSNorm(x) * weight, as LlamaModel's RMSNorm computes it."""
        rows, n = x.shape
        _check(x, weight, delta)
        if delta is not None and delta.shape != x.shape:
            raise ValueError(f"add_rms_norm: delta {tuple(delta.shape)} != x {tuple(x.shape)}")
        if weight.shape != (n,):
            raise ValueError(f"add_rms_norm: weight {tuple(weight.shape)} for rows of {n}")
        out = torch.empty_like(x)
        self._fn("add_rms_norm", x.dtype)(x.data_ptr(), None if delta is None else delta.data_ptr(),
                                          weight.data_ptr(), out.data_ptr(), rows, n, eps, _threads())
        return out

    def rope_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                   kc: torch.Tensor, vc: torch.Tensor, num_heads: int, num_kv_heads: int) -> None:
        """qkv [T, H + 2 KV, D]: RoPE in place on the q and k heads, then k and v of token t
        written to slot slots[t] of the pool layer kc / vc [KV, blocks, bs, D]."""
        t, heads_total, d = qkv.shape
        _check(qkv, cos, sin)
        _check_pool(qkv, kc, vc)
        if heads_total != num_heads + 2 * num_kv_heads or cos.shape != (t, d) or sin.shape != (t, d):
            raise ValueError(f"rope_cache: qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)} for "
                             f"{num_heads} + 2x{num_kv_heads} heads")
        if kc.shape != vc.shape or kc.shape[0] != num_kv_heads or kc.shape[3] != d:
            raise ValueError(f"rope_cache: pool {tuple(kc.shape)} for {num_kv_heads} kv heads of {d}")
        if slots.dtype != torch.int64 or slots.shape != (t,) or not slots.is_contiguous():
            raise ValueError("rope_cache: slots must be a contiguous int64 [T]")
        self._fn("rope_cache", qkv.dtype, kc.dtype)(
            qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), kc.data_ptr(), vc.data_ptr(),
            t, heads_total, num_heads + num_kv_heads, num_heads, num_kv_heads, d, kc.shape[1] * kc.shape[2],
            _threads())

    def decode_attention(self, qkv: torch.Tensor, num_heads: int, kc: torch.Tensor, vc: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor,
                         table_index: torch.Tensor | None = None) -> torch.Tensor:
        """Rows 0..B-1 of qkv [T, H + 2 KV, D] are single-query rows; row b attends to the first
        context_lens[b] cached positions through block_tables[table_index[b]] (block_tables[b]
        without an index) -> o [B, H, D]. A prefill chunk is rows sharing a table, each with its
        causal length. The tables must cover the lengths (PagedBatch.build checks it once per
        step, not here per layer)."""
        b = context_lens.shape[0] if context_lens.dim() == 1 else -1
        tables_n, max_blocks = block_tables.shape
        _, heads_total, d = qkv.shape
        kvh, num_blocks, bs, _ = kc.shape
        _check_pool(qkv, kc, vc)
        named = (("block_tables", block_tables), ("context_lens", context_lens), ("table_index", table_index))
        for name, idx in named:
            if idx is not None and (idx.dtype != torch.int64 or not idx.is_contiguous()):
                raise ValueError(f"decode_attention: {name} must be contiguous int64")
        rows_ok = table_index is None and tables_n == b or (
            table_index is not None and table_index.shape == (b,)
            and (b == 0 or 0 <= int(table_index.min()) and int(table_index.max()) < tables_n))
        if b < 0 or not rows_ok or qkv.shape[0] < b or num_heads % kvh:
            raise ValueError(f"decode_attention: {tables_n} tables, {tuple(context_lens.shape)} lengths, "
                             f"{qkv.shape[0]} rows, {num_heads} heads over {kvh} kv heads")
        o = torch.empty((b, num_heads, d), dtype=qkv.dtype)
        self._fn("decode_attention", qkv.dtype, kc.dtype)(
            qkv.data_ptr(), heads_total * d, kc.data_ptr(), vc.data_ptr(), block_tables.data_ptr(),
            None if table_index is None else table_index.data_ptr(), max_blocks, context_lens.data_ptr(),
            o.data_ptr(), b, num_heads, kvh, d, num_blocks, bs, d ** -0.5, _threads())
        return o

    def prefill_attention(self, qkv: torch.Tensor, num_heads: int, kc: torch.Tensor, vc: torch.Tensor,
                          block_tables: torch.Tensor, spans: torch.Tensor, out: torch.Tensor | None = None,
                          isa: int | None = None) -> torch.Tensor:
        """Causal attention of prefill spans over the pool. qkv [T, H + 2 KV, D] (RoPE applied, this
        step's k/v already in the pool); spans int64 [S, 3]: (first row, tokens n, context length c
        after the step): rows first .. first + n - 1 are positions c - n .. c - 1 and attend to keys
        0 .. their position through block_tables[s] [S, max_blocks] -> the spans' rows of out
        [T, H, D] (a new tensor when not given; other rows untouched). isa: 0 scalar, 1 avx2,
        2 avx512, 3 avx512bf16 (bf16 data with d % 32 == 0: vdpbf16ps, P rounded to bf16; else as 2)
        (default self.attention_isa; clamped to attention_isa_max)."""
        t, heads_total, d = qkv.shape
        kvh, num_blocks, bs, _ = kc.shape
        _check_pool(qkv, kc, vc)
        for name, idx in (("block_tables", block_tables), ("spans", spans)):
            if idx.dtype != torch.int64 or not idx.is_contiguous() or idx.dim() != 2:
                raise ValueError(f"prefill_attention: {name} must be a contiguous 2-D int64 tensor")
        if spans.shape[1] != 3 or block_tables.shape[0] != spans.shape[0] or num_heads % kvh or (
                heads_total != num_heads + 2 * kvh or kc.shape != vc.shape or kc.shape[3] != d):
            raise ValueError(f"prefill_attention: qkv {tuple(qkv.shape)}, {num_heads} heads, pool "
                             f"{tuple(kc.shape)}, tables {tuple(block_tables.shape)}, spans {tuple(spans.shape)}")
        for first, n, c in spans.tolist():           # the kernel trusts these: checked once here
            if not (0 <= first and first + n <= t and 0 < n <= c
                    and (c + bs - 1) // bs <= block_tables.shape[1]):
                raise ValueError(f"prefill_attention: span ({first}, {n}, {c}) outside {t} rows or its table")
        if out is None:
            out = torch.empty((t, num_heads, d), dtype=qkv.dtype)
        elif out.shape != (t, num_heads, d) or out.dtype != qkv.dtype or not out.is_contiguous():
            raise ValueError(f"prefill_attention: out {tuple(out.shape)} {out.dtype} for {t} rows")
        isa = self.attention_isa if isa is None else min(isa, self.attention_isa_max)
        self._fn("prefill_attention", qkv.dtype, kc.dtype)(
            qkv.data_ptr(), heads_total * d, kc.data_ptr(), vc.data_ptr(), block_tables.data_ptr(),
            block_tables.shape[1], spans.data_ptr(), spans.shape[0], out.data_ptr(), num_heads, kvh, d,
            num_blocks, bs, d ** -0.5, isa, _threads())
        return out

    def linear_fits(self, weight: torch.Tensor) -> bool:
        """Whether linear() can take this [N, K] weight (bf16, K in whole vectors, this CPU)."""
        return (self.has_bf16_linear and weight.dtype == torch.bfloat16 and weight.dim() == 2
                and weight.shape[1] % LINEAR_K_MULTIPLE == 0 and weight.is_contiguous()
                and weight.device.type == "cpu")

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N], each weight row streamed once for
        all M rows. bf16 out: 1 <= M <= LINEAR_MAX_ROWS (decode batches; oneDNN wins above).
        float32 out, any M >= 1: the float32 sums unrounded (the logits head)."""
        m, k = x.shape
        n = weight.shape[0]
        _check(x, weight, bias)
        max_rows = LINEAR_MAX_ROWS if out_dtype == torch.bfloat16 else m
        if (not self.linear_fits(weight) or weight.shape[1] != k or not 1 <= m <= max_rows
                or out_dtype not in (torch.bfloat16, torch.float32)):
            raise ValueError(f"linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
                             f"{weight.dtype} -> {out_dtype}: needs bf16 in, bf16 or float32 out, "
                             f"K % {LINEAR_K_MULTIPLE} == 0, 1..{LINEAR_MAX_ROWS} rows for bf16 out "
                             f"and AVX512-BF16 (here: {self.has_bf16_linear})")
        if bias is not None and bias.shape != (n,):
            raise ValueError(f"linear: bias {tuple(bias.shape)} for {n} outputs")
        y = torch.empty((m, n), dtype=out_dtype)
        fn = self._linear if out_dtype == torch.bfloat16 else self._linear_f32out
        fn(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
           _threads())
        return y

    def quant_row_bytes(self, wtype: int, k: int) -> int:
        """Bytes of one K-value weight row in ggml type `wtype` (or SPLIT | it); -1 where quant.cc
        cannot read it."""
        if wtype not in QUANT_TYPES or k % (256 if wtype == 12 else 32):
            return -1
        return int(self._fns["quant_row_bytes", "quant"](wtype, k))

    def repack(self, wtype: int, blocks: torch.Tensor, k: int, x8: bool = True,
               x16: bool | None = None, p8: bool = False) -> tuple[int, torch.Tensor]:
        """blocks uint8 [N, row bytes] of ggml type wtype -> (new type, the same bytes rearranged for
        quant_linear): Q4_0 / Q4_1 in groups of rows unless x8 is False: X16 (16 rows a zmm; x16 None:
        where the default path is avx512 and N % 16 == 0), else X8 (8 rows a ymm, N % 8 == 0);
        Q8_0 with p8 (N % 8 == 0) as P8 (8 rows, codes interleaved in pairs: quant_linear_fx's int16
        codes read it, the AVX2 logits head); Q4_0 / Q4_1 / Q8_0 otherwise as SPLIT (each row's f16
        scales first: quant_linear_fx reads these); Q4_K as given."""
        rb = self.quant_row_bytes(wtype, k)
        if (rb < 0 or wtype & (SPLIT | GROUPED | P8) or blocks.dtype != torch.uint8 or blocks.dim() != 2
                or blocks.shape[1] != rb):
            raise ValueError(f"repack: blocks {tuple(blocks.shape)} of type {QUANT_TYPES.get(wtype, wtype)}, K {k}")
        if wtype == 12:
            return wtype, blocks
        n = blocks.shape[0]
        if x16 is None:
            x16 = self.quant_isa >= 2
        if x8 and wtype in (2, 3) and x16 and n % 16 == 0:
            want = X16 | wtype
        elif x8 and wtype in (2, 3) and n % 8 == 0:
            want = X8 | wtype
        elif p8 and wtype == 8 and n % 8 == 0:
            want = P8 | wtype
        else:
            want = SPLIT | wtype
        src = blocks.contiguous()
        out = torch.empty_like(src)
        got = int(self._fns["quant_repack", "quant"](want, src.data_ptr(), out.data_ptr(), src.shape[0], k))
        assert got == want, (got, want)
        return got, out

    def dequantize(self, wtype: int, blocks: torch.Tensor, k: int) -> torch.Tensor:
        """blocks uint8 [N, row bytes] of ggml type wtype -> float32 [N, K]."""
        rb = self.quant_row_bytes(wtype, k)
        if rb < 0 or blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != rb:
            raise ValueError(f"dequantize: blocks {tuple(blocks.shape)} of type {QUANT_TYPES.get(wtype, wtype)}, K {k}")
        out = torch.empty((blocks.shape[0], k))
        self._fns["quant_dequantize", "quant"](wtype, blocks.contiguous().data_ptr(), out.data_ptr(), blocks.shape[0],
                                              k, _threads())
        return out

    def quantize_activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [M, K] float32 or bf16, K % 32 == 0 -> (codes int8 [M, K], scales d [M, K/32],
        d * sum(codes) s [M, K/32]): per 32 values d = max|x| / 127, codes = round(x / d)."""
        m, k = x.shape
        _check(x)
        if x.dtype not in SUFFIX or k % 32:
            raise ValueError(f"quantize_activations: x {tuple(x.shape)} {x.dtype}: float32/bf16 with K % 32 == 0")
        qs = torch.empty((m, k), dtype=torch.int8)
        d, s = torch.empty((m, k // 32)), torch.empty((m, k // 32))
        self._fns["quantize_act", "quant"](x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, qs.data_ptr(),
                                          d.data_ptr(), s.data_ptr(), _threads())
        return qs, d, s

    def quant_linear(self, x: torch.Tensor, wtype: int, blocks: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None, isa: int | None = None) -> torch.Tensor:
        """x [M, K] @ W^T (+ bias float32 [N]) -> [M, N] in out_dtype (default x's), W as blocks
        uint8 [N, row bytes] of ggml type wtype, x quantized per 32 values on the way in;
        isa: 0 scalar, 1 avx2, 2 avx512 (default self.quant_isa; clamped to quant_isa_max)."""
        m, k = x.shape
        n = blocks.shape[0]
        rb = self.quant_row_bytes(wtype, k)
        out_dtype = out_dtype or x.dtype
        if (rb < 0 or blocks.dtype != torch.uint8 or blocks.shape != (n, rb) or not blocks.is_contiguous()
                or out_dtype not in SUFFIX):
            raise ValueError(f"quant_linear: x {tuple(x.shape)}, blocks {tuple(blocks.shape)} {blocks.dtype} of "
                             f"type {QUANT_TYPES.get(wtype, wtype)} (row bytes {rb}) -> {out_dtype}")
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
            raise ValueError(f"quant_linear: bias must be a contiguous float32 [{n}]")
        qs, d, s = self.quantize_activations(x)
        y = torch.empty((m, n), dtype=out_dtype)
        isa = self.quant_isa if isa is None else min(isa, self.quant_isa_max)
        if self._fns["quant_matmul", "quant"](wtype, blocks.data_ptr(), qs.data_ptr(), d.data_ptr(), s.data_ptr(),
                                             None if bias is None else bias.data_ptr(), y.data_ptr(),
                                             int(out_dtype == torch.bfloat16), n, m, n, k, isa, _threads()) != 0:
            raise ValueError(f"quant_linear: {QUANT_TYPES.get(wtype, wtype)} rows {n}: not a layout its int8 codes read")
        return y

    def quant_linear_fx(self, x: torch.Tensor, wtype: int, blocks: torch.Tensor, bias: torch.Tensor | None = None,
                        out_dtype: torch.dtype = torch.float32, isa: int | None = None) -> torch.Tensor:
        """x [M, K] (float32; bf16 is widened) @ W^T (+ bias float32 [N]) -> [M, N], W as blocks
        uint8 [N, row bytes] of ggml type wtype dequantized in registers: the float32 matmul of
        the dequantized matrix at the blocks' bytes (no activation codes); isa: 0 scalar, 1+ avx2."""
        m, k = x.shape
        n = blocks.shape[0]
        rb = self.quant_row_bytes(wtype, k)
        if (rb < 0 or blocks.dtype != torch.uint8 or blocks.shape != (n, rb) or not blocks.is_contiguous()
                or out_dtype not in SUFFIX or x.dtype not in SUFFIX):
            raise ValueError(f"quant_linear_fx: x {tuple(x.shape)} {x.dtype}, blocks {tuple(blocks.shape)} "
                             f"{blocks.dtype} of type {QUANT_TYPES.get(wtype, wtype)} (row bytes {rb}) -> {out_dtype}")
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
            raise ValueError(f"quant_linear_fx: bias must be a contiguous float32 [{n}]")
        xf = x.float().contiguous()
        y = torch.empty((m, n), dtype=out_dtype)
        isa = self.quant_isa if isa is None else min(isa, self.quant_isa_max)
        if self._fns["quant_matmul_fx", "quant"](wtype, blocks.data_ptr(), xf.data_ptr(), k,
                                                None if bias is None else bias.data_ptr(), y.data_ptr(),
                                                int(out_dtype == torch.bfloat16), n, m, n, k, isa, _threads()) != 0:
            raise ValueError(f"quant_linear_fx: {QUANT_TYPES.get(wtype, wtype)} rows {n}: not a layout quant.cc reads")
        return y

    def q8bf16_pack(self, blocks: torch.Tensor, k: int) -> torch.Tensor | None:
        """GGUF Q8_0 rows uint8 [N, row bytes] -> the same matrix in q8_bf16.cc's G16 layout (codes as
        exact bf16, 16 rows a vector, float32 scales), 2 bytes a weight; None where this CPU cannot
        multiply it (no AVX512-BF16, or BLINK_CPU_ISA narrower) or it does not exist (N % 16, K % 32)."""
        n = blocks.shape[0]
        size = int(self._fns["q8bf16_bytes", "quant"](n, k))
        if not self.has_q8bf16 or size < 0:
            return None
        rb = self.quant_row_bytes(8, k)
        if blocks.dtype != torch.uint8 or blocks.shape != (n, rb):
            raise ValueError(f"q8bf16_pack: blocks {tuple(blocks.shape)} {blocks.dtype}: Q8_0 rows of {rb} bytes")
        src = blocks.contiguous()
        out = torch.empty(size, dtype=torch.uint8)
        assert self._fns["q8bf16_pack", "quant"](src.data_ptr(), out.data_ptr(), n, k, _threads()) == 0
        return out

    def q8bf16_matmul(self, packed: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] bf16 @ W^T -> float32 [M, N], W a q8bf16_pack() of N rows: the float32 matmul of the
        dequantized Q8_0 matrix (every product exact), in another summation order."""
        m, k = x.shape
        _check(x)
        if (x.dtype != torch.bfloat16 or packed.dtype != torch.uint8
                or packed.numel() != int(self._fns["q8bf16_bytes", "quant"](n, k))):
            raise ValueError(f"q8bf16_matmul: x {tuple(x.shape)} {x.dtype}, {packed.numel()} packed bytes for N {n}")
        y = torch.empty((m, n))
        rc = self._fns["q8bf16_matmul", "quant"](packed.data_ptr(), x.data_ptr(), k, y.data_ptr(), n, m, n, k,
                                                 _threads())
        if rc != 0:
            raise ValueError("q8bf16_matmul: this build has no AVX512-BF16")
        return y

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [rows, 2n] (gate, then up) -> silu(gate) * up [rows, n]."""
        rows, two_n = gate_up.shape
        _check(gate_up)
        out = torch.empty((rows, two_n // 2), dtype=gate_up.dtype)
        self._fn("silu_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), rows, two_n // 2, _threads())
        return out


def _check_pool(qkv: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> None:
    """Contiguous CPU tensors; the pool (kc, vc alike) of qkv's dtype, or bf16 under float32."""
    _check(kc, vc)
    _check(qkv)
    if not CpuKernels.pool_dtypes_ok(qkv.dtype, kc.dtype):
        raise ValueError(f"cpu kernels take a pool of the activations' dtype, or bfloat16 under float32; "
                         f"got {qkv.dtype} over {kc.dtype}")


def _check(*tensors: torch.Tensor | None) -> None:
    dtype = tensors[0].dtype
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cpu" or not t.is_contiguous() or t.dtype != dtype:
            raise ValueError(f"cpu kernels take contiguous CPU tensors of one dtype; got {t.dtype} "
                             f"{'contiguous' if t.is_contiguous() else 'strided'} on {t.device}")


def requested_isa(available: int) -> int:
    """A kernel's path: BLINK_CPU_ISA (one of ISA_NAMES) where set, never wider than
    `available`; unset, the widest available. An unknown name is logged and ignored."""
    name = os.environ.get(ISA_ENV, "").strip().lower()
    if not name:
        return available
    if name not in ISA_NAMES:
        log.warning("%s=%s is not one of %s; using %s", ISA_ENV, name, "|".join(ISA_NAMES), ISA_NAMES[available])
        return available
    want = ISA_NAMES.index(name)
    if want > available and want < len(ISA_NAMES) - 1:      # avx512bf16 is attention's alone: no warning
        log.warning("%s=%s: this CPU or build has at most %s; using it", ISA_ENV, name, ISA_NAMES[available])
    return min(want, available)


def _threads() -> int:
    return torch.get_num_threads()


@functools.cache
def load() -> CpuKernels | None:
    """The kernels, built on first use; None (logged once) where they cannot be built or loaded."""
    if os.environ.get("BLINK_CPU_KERNELS", "1") == "0":
        log.info("fused CPU kernels disabled by BLINK_CPU_KERNELS=0")
        return None
    try:
        path = build()
        return CpuKernels(ctypes.CDLL(str(path)))
    except (BuildError, OSError, AttributeError) as e:
        log.warning("fused CPU kernels unavailable, running the PyTorch layer: %s", e)
        return None
