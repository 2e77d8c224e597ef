"""attention.cc's prefill attention (causal, flash-attention style over the paged pool) on every
path this machine has (scalar, avx2, avx512, avx512bf16; BLINK_CPU_ISA narrows the default), against a
float64 softmax(q k^T / sqrt(d)) v computed here from the same blocks: fresh prompts, chunks
continuing over cached blocks, single-token spans, contexts longer than a key tile, tiles of
query tokens that end mid-tile, block sizes that split key tiles, GQA groups, bf16 and f32."""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch

from gpu_backend import cpu_kernels

KERNELS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the CPU kernels cannot be built here (no g++)")
ISAS = list(range(KERNELS.attention_isa_max + 1)) if KERNELS else []


def reference(qkv, heads, kc, vc, tables, spans) -> torch.Tensor:
    """float64 causal attention of each span's rows over its context, rows outside spans zero."""
    kvh, _, _, d = kc.shape
    out = torch.zeros(qkv.shape[0], heads, d, dtype=torch.float64)
    for s, (first, n, c) in enumerate(spans.tolist()):
        keys = kc.index_select(1, tables[s]).reshape(kvh, -1, d)[:, :c].double()        # [KV, c, D]
        vals = vc.index_select(1, tables[s]).reshape(kvh, -1, d)[:, :c].double()
        q = qkv[first:first + n, :heads].double().reshape(n, kvh, heads // kvh, d)       # [n, KV, G, D]
        scores = torch.einsum("nkgd,kcd->nkgc", q, keys) * d ** -0.5
        later = torch.arange(c)[None, :] > torch.arange(c - n, c)[:, None]             # [n, c]
        scores = scores.masked_fill(later[:, None, None, :], float("-inf"))
        out[first:first + n] = torch.einsum("nkgc,kcd->nkgd", scores.softmax(-1), vals).reshape(n, heads, d)
    return out


def case(spans: list[tuple[int, int, int]], heads: int, kvh: int, d: int, bs: int, dtype, seed: int = 0):
    """Random q/k/v, a pool with shuffled block tables covering each span's context."""
    gen = torch.Generator().manual_seed(seed)
    need = [(c + bs - 1) // bs for _, _, c in spans]
    num_blocks = sum(need) + 3
    kc = torch.randn(kvh, num_blocks, bs, d, generator=gen).to(dtype)
    vc = torch.randn(kvh, num_blocks, bs, d, generator=gen).to(dtype)
    t = max(first + n for first, n, _ in spans) + 1                # one row no span covers
    qkv = (2 * torch.randn(t, heads + 2 * kvh, d, generator=gen)).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(spans), max(need), dtype=torch.int64)
    at = 0
    for s, k in enumerate(need):
        tables[s, :k] = perm[at:at + k]
        at += k
    return qkv, kc, vc, tables, torch.tensor(spans, dtype=torch.int64)


SHAPES = {                 # spans (first row, tokens, context after the step), heads, kv heads, d, block
    "fresh-and-continuing": ([(0, 37, 37), (37, 50, 333), (87, 1, 20)], 9, 3, 64, 16),
    "long-context-mha": ([(0, 70, 200)], 4, 4, 32, 16),
    "odd-block-size": ([(0, 45, 45), (45, 19, 130)], 6, 2, 64, 5),
    "head-dim-20": ([(0, 33, 40), (33, 2, 2)], 4, 2, 20, 8),
    "head-dim-128": ([(0, 40, 90)], 2, 1, 128, 32),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("isa", ISAS, ids=lambda i: cpu_kernels.ISA_NAMES[i])
def test_prefill_attention_matches_a_float64_reference(isa, shape, dtype):
    spans, heads, kvh, d, bs = SHAPES[shape]
    qkv, kc, vc, tables, spans_t = case(spans, heads, kvh, d, bs, dtype)
    sentinel = torch.full((qkv.shape[0], heads, d), 7.0, dtype=dtype)
    got = KERNELS.prefill_attention(qkv, heads, kc, vc, tables, spans_t, out=sentinel, isa=isa)
    want = reference(qkv, heads, kc, vc, tables, spans_t)
    rows = torch.zeros(qkv.shape[0], dtype=torch.bool)
    for first, n, _ in spans:
        rows[first:first + n] = True
    # float32 math throughout; bf16 rounds the output once (8 bits of mantissa)
    tol = 2e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got[rows].double(), want[rows], rtol=tol, atol=tol)
    assert bool((got[~rows] == 7.0).all())                         # rows outside the spans untouched


def test_the_paths_agree_with_each_other():
    """Same inputs on every path: only the float summation order differs."""
    qkv, kc, vc, tables, spans = case([(0, 100, 260)], 9, 3, 64, 16, torch.float32, seed=3)
    outs = [KERNELS.prefill_attention(qkv, 9, kc, vc, tables, spans, isa=isa)[:100] for isa in ISAS]   # span rows
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not KERNELS or KERNELS.attention_isa_max < 3, reason="no AVX512-BF16 path on this CPU")
@pytest.mark.parametrize("d", [64, 32, 128])
def test_the_bf16_dot_path_agrees_with_the_float_path(d):
    """bf16 data: vdpbf16ps (P rounded to bf16) against the avx512 float32 path, within bf16 rounding;
    head dims that are no multiple of 32 take the float path (the same bits)."""
    qkv, kc, vc, tables, spans = case([(0, 100, 260), (100, 67, 67), (167, 1, 90)], 9, 3, d, 16, torch.bfloat16,
                                      seed=5)
    rows = 168
    fast = KERNELS.prefill_attention(qkv, 9, kc, vc, tables, spans, isa=3)[:rows].double()
    slow = KERNELS.prefill_attention(qkv, 9, kc, vc, tables, spans, isa=2)[:rows].double()
    torch.testing.assert_close(fast, slow, rtol=8e-3, atol=8e-3)
    qkv, kc, vc, tables, spans = case([(0, 40, 90)], 4, 2, 48, 16, torch.bfloat16, seed=6)
    assert torch.equal(KERNELS.prefill_attention(qkv, 4, kc, vc, tables, spans, isa=3)[:40],     # span rows
                       KERNELS.prefill_attention(qkv, 4, kc, vc, tables, spans, isa=2)[:40])


def test_the_switch_narrows_the_default_path(monkeypatch):
    lib = ctypes.CDLL(str(cpu_kernels.build()))
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "scalar")
    assert cpu_kernels.CpuKernels(lib).attention_isa == 0
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx2")
    assert cpu_kernels.CpuKernels(lib).attention_isa == min(1, KERNELS.attention_isa_max)
    monkeypatch.delenv(cpu_kernels.ISA_ENV)
    assert cpu_kernels.CpuKernels(lib).attention_isa == KERNELS.attention_isa_max


def test_spans_outside_their_rows_or_tables_are_refused():
    qkv, kc, vc, tables, _ = case([(0, 10, 10)], 4, 2, 32, 16, torch.float32)
    for bad in ([[0, 12, 12]], [[0, 10, 40]], [[0, 10, 5]], [[-1, 5, 5]]):
        with pytest.raises(ValueError, match="span"):
            KERNELS.prefill_attention(qkv, 4, kc, vc, tables, torch.tensor(bad, dtype=torch.int64))


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
@pytest.mark.parametrize("march", ["cooperlake", "icelake-server", "haswell"])
def test_every_path_compiles(march):
    """The paths this machine may lack still build (AVX512-BF16 on cooperlake, AVX512F without it on
    icelake-server, AVX2 on haswell)."""
    src = cpu_kernels.SOURCE.with_name("attention.cc")
    r = subprocess.run(["g++", "-std=c++17", "-O1", f"-march={march}", "-fopenmp", "-Wall", "-Wextra", "-Werror",
                        "-fsyntax-only", str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
