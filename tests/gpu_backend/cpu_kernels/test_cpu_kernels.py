"""The fused C++ CPU kernels against the PyTorch ops they replace (LlamaModel's RMSNorm,
apply_rope, SwiGLU; PagedAttention's KV write and decode attention), in bfloat16 and
float32, over the shapes the hardware paths specialise (head_dim 64 and 128 take the
vdpbf16ps path where the CPU has it) and the generic ones."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from gpu_backend import cpu_kernels
from gpu_backend.kv_pool import KVCacheConfig, KVPool
from gpu_backend.model.llama import RMSNorm, apply_rope
from gpu_backend.paged_attention import PagedAttention, PagedBatch

KERNELS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the CPU kernels cannot be built here (no g++)")
DTYPES = [torch.float32, torch.bfloat16]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, bf16_tol: float = 0.0) -> None:
    tol = 1e-5 if dtype == torch.float32 else bf16_tol
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_residual_and_normalises_like_rmsnorm(dtype):
    g = gen(0)
    x = torch.randn(7, 576, generator=g).to(dtype)
    delta = torch.randn(7, 576, generator=g).to(dtype)
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    want_resid = x + delta
    want = norm(want_resid)
    resid = x.clone()
    got = KERNELS.add_rms_norm(resid, delta, norm.weight.data, norm.eps)
    assert torch.equal(resid, want_resid)                       # one rounding, as `x + delta`
    close(got, want, dtype, bf16_tol=1e-2)
    if dtype == torch.bfloat16:                                 # the same value almost everywhere
        assert (got != want).float().mean() < 0.01
    only = x.clone()
    close(KERNELS.add_rms_norm(only, None, norm.weight.data, norm.eps), norm(x), dtype, bf16_tol=1e-2)
    assert torch.equal(only, x)                                 # no delta: the residual is left alone


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_swiglu_of_the_fused_gate_up_rows(dtype):
    gate_up = (3 * torch.randn(5, 2 * 320, generator=gen(1))).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)     # exp clamps at both ends
    want = F.silu(gate_up[:, :320]) * gate_up[:, 320:]
    got = KERNELS.silu_mul(gate_up)
    close(got, want, dtype, bf16_tol=1e-2)
    if dtype == torch.bfloat16:
        assert (got != want).float().mean() < 0.01


def rope_tables(positions: torch.Tensor, d: int, dtype: torch.dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([positions.float()[:, None] * inv[None]] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def paged_case(dtype, heads, kv_heads, d, block_size, contexts, seed):
    """A pool with random cached K/V and one decode token per sequence at position contexts[i] - 1,
    the tables scattered over the pool (not in order), some blocks only partly used."""
    g = gen(seed)
    blocks_each = [-(-c // block_size) for c in contexts]
    perm = torch.randperm(sum(blocks_each) + 5, generator=g).tolist()
    tables, at = [], 0
    for n in blocks_each:
        tables.append(perm[at:at + n])
        at += n
    pool = KVPool(KVCacheConfig(len(perm), block_size, 1, kv_heads, d), dtype=dtype)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    chunks = [(c - 1, 1, t) for c, t in zip(contexts, tables)]
    qkv = (torch.randn(len(contexts), heads + 2 * kv_heads, d, generator=g) * 0.3).to(dtype)
    return pool, PagedBatch.build(chunks, block_size), qkv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,d,block_size", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 48, 8),
                                                         (6, 1, 32, 4)])
def test_rope_cache_and_decode_attention_match_paged_attention(dtype, heads, kv_heads, d, block_size):
    contexts = [1, 37, block_size, 3 * block_size + 5, 130]
    pool, batch, qkv = paged_case(dtype, heads, kv_heads, d, block_size, contexts, seed=heads * d)
    positions = torch.tensor([c - 1 for c in contexts])
    cos, sin = rope_tables(positions, d, dtype)
    # PyTorch: RoPE on q|k, then PagedAttention writes k/v and attends (on a copy of the pool).
    ref_pool = KVPool(pool.config, dtype=dtype)
    ref_pool.k.copy_(pool.k)
    ref_pool.v.copy_(pool.v)
    qk = apply_rope(qkv[:, :heads + kv_heads], cos, sin)
    attn = PagedAttention(ref_pool)
    attn.batch = batch
    want = attn(0, qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:])
    # Kernels: RoPE in place + KV write, then attention straight from the pool.
    got_qkv = qkv.clone()
    KERNELS.rope_cache(got_qkv, cos, sin, batch.slot_mapping, pool.k[0], pool.v[0], heads, kv_heads)
    close(got_qkv[:, :heads + kv_heads], qk, dtype)               # RoPE rounds exactly as apply_rope
    assert torch.equal(got_qkv[:, heads + kv_heads:], qkv[:, heads + kv_heads:])
    close(pool.k, ref_pool.k, dtype)
    close(pool.v, ref_pool.v, dtype)
    got = KERNELS.decode_attention(got_qkv, heads, pool.k[0], pool.v[0], batch.decode_block_tables,
                                   batch.decode_context_lens)
    # float32 accumulation throughout vs PyTorch's bf16 scores/probabilities: within bf16 noise.
    close(got, want, dtype, bf16_tol=3e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("start", [0, 37])
def test_prefill_rows_through_a_shared_table_are_causal_attention(dtype, start):
    """A chunk of 21 tokens at positions start.. as 21 rows over one table (table_index), row i
    attending to start + i + 1 positions: what PagedAttention's SDPA prefill computes."""
    heads, kv_heads, d, bs, n = 9, 3, 64, 16, 21
    pool, _, _ = paged_case(dtype, heads, kv_heads, d, bs, [start + n], seed=start + 1)
    table = torch.randperm(pool.config.num_blocks, generator=gen(2))[:-(-(start + n) // bs)].tolist()
    batch = PagedBatch.build([(start, n, table)], bs)
    qkv = (torch.randn(n, heads + 2 * kv_heads, d, generator=gen(3)) * 0.3).to(dtype)
    ref_pool = KVPool(pool.config, dtype=dtype)
    ref_pool.k.copy_(pool.k)
    ref_pool.v.copy_(pool.v)
    attn = PagedAttention(ref_pool)
    attn.batch = batch
    want = attn(0, qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:])
    # The kernels' way: k/v into the pool (RoPE at angle 0 leaves them as they are), then rows.
    KERNELS.rope_cache(qkv, *rope_tables(torch.zeros(n), d, dtype), batch.slot_mapping, pool.k[0], pool.v[0],
                       heads, kv_heads)
    got = KERNELS.decode_attention(qkv, heads, pool.k[0], pool.v[0], torch.tensor([[0] * len(table), table]),
                                   torch.arange(start + 1, start + n + 1), table_index=torch.ones(n, dtype=torch.long))
    close(got, want, dtype, bf16_tol=3e-2)
    with pytest.raises(ValueError, match="tables"):                # an index past the tables
        KERNELS.decode_attention(qkv, heads, pool.k[0], pool.v[0], torch.tensor([table]),
                                 torch.arange(1, n + 1), table_index=torch.ones(n, dtype=torch.long))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,d,block_size", [(9, 3, 64, 16), (8, 2, 128, 16), (6, 1, 32, 4)])
def test_long_contexts_give_the_same_bits_on_any_team(dtype, heads, kv_heads, d, block_size):
    """Each (row, kv head) item, or part of its query heads where a step has fewer items than
    twice the team (one row: split by head), is one thread's, whichever: the output is the bits
    one thread computes alone, on 2-4 threads, and PagedAttention's result."""
    before = torch.get_num_threads()
    for contexts in ([192], [517], [300, 45], [256, 257, 1030]):
        pool, batch, qkv = paged_case(dtype, heads, kv_heads, d, block_size, contexts, seed=sum(contexts) + d)
        args = (qkv, heads, pool.k[0], pool.v[0], batch.decode_block_tables, batch.decode_context_lens)
        try:
            torch.set_num_threads(1)
            alone = KERNELS.decode_attention(*args)
            for threads in (2, 3, 4):
                torch.set_num_threads(threads)
                assert torch.equal(KERNELS.decode_attention(*args), alone), (contexts, threads)
        finally:
            torch.set_num_threads(before)
        want = PagedAttention._decode(qkv[:, :heads], pool.k[0], pool.v[0], batch)   # the PyTorch decode
        close(alone, want, dtype, bf16_tol=3e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_attention_bits_do_not_depend_on_the_rows_beside_it(dtype):
    """Contexts past kernels.cc's kChunkPositions (128) are cut into chunks whose softmax partials
    are combined; the cut depends on the row's own length only, so a row's output is the same bits
    alone, in a batch of short and long rows, and on any team (requests' tokens do not depend on
    what else runs), and it is the attention over the whole context (PagedAttention's)."""
    contexts = [300, 45, 1030, 128, 129]
    pool, batch, qkv = paged_case(dtype, 9, 3, 64, 16, contexts, seed=11)
    tables, lens = batch.decode_block_tables, batch.decode_context_lens
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            together = KERNELS.decode_attention(qkv, 9, pool.k[0], pool.v[0], tables, lens)
            for i in range(len(contexts)):
                alone = KERNELS.decode_attention(qkv[i:i + 1].contiguous(), 9, pool.k[0], pool.v[0],
                                                 tables[i:i + 1, :].contiguous(), lens[i:i + 1].contiguous())
                assert torch.equal(alone[0], together[i]), (threads, contexts[i])
    finally:
        torch.set_num_threads(before)
    want = PagedAttention._decode(qkv[:, :9], pool.k[0], pool.v[0], batch)
    close(together, want, dtype, bf16_tol=3e-2)


def test_decode_attention_of_a_single_position_returns_its_value():
    pool, batch, qkv = paged_case(torch.bfloat16, 9, 3, 64, 16, [1, 1], seed=4)
    KERNELS.rope_cache(qkv, *rope_tables(torch.zeros(2), 64, torch.bfloat16), batch.slot_mapping,
                       pool.k[0], pool.v[0], 9, 3)
    o = KERNELS.decode_attention(qkv, 9, pool.k[0], pool.v[0], batch.decode_block_tables,
                                 batch.decode_context_lens)
    v = qkv[:, 12:].repeat_interleave(3, dim=1)                  # each q head's kv head
    assert torch.equal(o, v)


def test_bad_arguments_are_refused_before_reaching_c():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="weight"):
        KERNELS.add_rms_norm(x, None, torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="one dtype"):
        KERNELS.add_rms_norm(x, None, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        KERNELS.silu_mul(torch.zeros(4, 8).t())
    with pytest.raises(TypeError, match="float16"):
        KERNELS.silu_mul(torch.zeros(2, 8, dtype=torch.float16))
    pool, batch, qkv = paged_case(torch.float32, 4, 2, 16, 4, [5], seed=0)
    with pytest.raises(ValueError, match="slots"):
        KERNELS.rope_cache(qkv, *rope_tables(torch.zeros(1), 16, torch.float32), batch.slot_mapping.int(),
                           pool.k[0], pool.v[0], 4, 2)
    with pytest.raises(ValueError, match="heads"):
        KERNELS.rope_cache(qkv, *rope_tables(torch.zeros(1), 16, torch.float32), batch.slot_mapping,
                           pool.k[0], pool.v[0], 2, 2)
    with pytest.raises(ValueError, match="outside"):
        PagedBatch.build([(40, 1, [0, 1])], 4)                   # position 40 needs 11 blocks, not 2


def test_build_is_cached_per_source_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("BLINK_CACHE_DIR", str(tmp_path))
    first = cpu_kernels.build()
    assert first.is_file() and first.parent.parent == tmp_path / "cpu_kernels"
    stamp = first.stat().st_mtime_ns
    assert cpu_kernels.build() == first and first.stat().st_mtime_ns == stamp     # no rebuild
    lib = ctypes.CDLL(str(first))
    assert hasattr(lib, "blink_decode_attention_bf16") and hasattr(lib, "blink_silu_mul_f32")


def test_disabled_or_unbuildable_kernels_fall_back_with_a_log_line(tmp_path):
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
            "from gpu_backend import cpu_kernels; print('loaded', cpu_kernels.load() is not None)")
    env = dict(os.environ, BLINK_CACHE_DIR=str(tmp_path))
    off = subprocess.run([sys.executable, "-c", code], env=dict(env, BLINK_CPU_KERNELS="0"),
                         capture_output=True, text=True, timeout=120)
    assert "loaded False" in off.stdout and "BLINK_CPU_KERNELS=0" in off.stdout
    broken = subprocess.run([sys.executable, "-c", code], env=dict(env, BLINK_CXX="/bin/false"),
                            capture_output=True, text=True, timeout=120)
    assert "loaded False" in broken.stdout and "running the PyTorch layer" in broken.stdout


needs_bf16_linear = pytest.mark.skipif(KERNELS is None or not KERNELS.has_bf16_linear,
                                       reason="the small-batch matmul needs AVX512-BF16")


@needs_bf16_linear
@pytest.mark.parametrize("rows", range(1, cpu_kernels.LINEAR_MAX_ROWS + 1))
@pytest.mark.parametrize("n,k,bias", [(960, 576, False), (77, 1536, True), (1, 64, True), (5, 32, False)])
def test_small_batch_linear_matches_f_linear(rows, n, k, bias):
    g = gen(rows * n + k)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    want = F.linear(x.float(), w.float(), None if b is None else b.float())     # exact products, f32 sums
    got = KERNELS.linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)        # one bf16 rounding


@needs_bf16_linear
@pytest.mark.parametrize("rows", [1, 8, 9, 20])
def test_float32_out_linear_keeps_the_sums_unrounded_for_any_batch(rows):
    g = gen(rows)
    x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
    w = torch.randn(1001, 576, generator=g).to(torch.bfloat16)       # logits of size ~25: bf16 steps 0.125
    b = torch.randn(1001, generator=g).to(torch.bfloat16)
    want = F.linear(x.float(), w.float(), b.float())
    got = KERNELS.linear(x, w, b, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == (rows, 1001)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)        # float32 sums, only the order differs
    assert (got - want).abs().max() < 0.01 < (F.linear(x, w, b).float() - want).abs().max()


@needs_bf16_linear
def test_small_batch_linear_refuses_what_it_cannot_compute():
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rows"):
        KERNELS.linear(torch.zeros(cpu_kernels.LINEAR_MAX_ROWS + 1, 64, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="K % 32"):
        KERNELS.linear(torch.zeros(2, 48, dtype=torch.bfloat16), torch.zeros(8, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="one dtype"):
        KERNELS.linear(torch.zeros(2, 64), w)
    with pytest.raises(ValueError, match="bias"):
        KERNELS.linear(torch.zeros(2, 64, dtype=torch.bfloat16), w, torch.zeros(3, dtype=torch.bfloat16))
    assert not KERNELS.linear_fits(torch.zeros(8, 64))                      # float32 weights stay on oneDNN


def test_kernels_split_work_over_threads_with_the_same_results():
    """The OpenMP paths (torch's thread count > 1) compute what one thread computes."""
    pool, batch, qkv = paged_case(torch.bfloat16, 9, 3, 64, 16, [40, 130, 7, 77], seed=11)
    cos, sin = rope_tables(torch.tensor([39, 129, 6, 76]), 64, torch.bfloat16)
    x = torch.randn(4, 576, generator=gen(12)).to(torch.bfloat16)
    w = torch.randn(576, generator=gen(13)).to(torch.bfloat16)
    gate_up = torch.randn(4, 640, generator=gen(14)).to(torch.bfloat16)

    def run():
        p = KVPool(pool.config, dtype=torch.bfloat16)
        p.k.copy_(pool.k)
        p.v.copy_(pool.v)
        q = qkv.clone()
        KERNELS.rope_cache(q, cos, sin, batch.slot_mapping, p.k[0], p.v[0], 9, 3)
        out = [q, p.k, KERNELS.decode_attention(q, 9, p.k[0], p.v[0], batch.decode_block_tables,
                                                batch.decode_context_lens),
               KERNELS.add_rms_norm(x.clone(), x, w, 1e-5), KERNELS.silu_mul(gate_up)]
        if KERNELS.has_bf16_linear:
            out.append(KERNELS.linear(x, torch.randn(97, 576, generator=gen(15)).to(torch.bfloat16)))
        return out

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(3)
        many = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, many):
        assert torch.equal(a, b)


@pytest.mark.parametrize("heads,kv_heads,d,block_size", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 48, 8),
                                                         (6, 1, 32, 4)])
def test_float32_activations_over_a_bf16_pool_are_the_float_pool_of_its_rounded_values(heads, kv_heads, d,
                                                                                         block_size):
    """The f32kv16 kernels (float32 activations, a bf16 pool: CPUs without bf16 math halve their KV
    bytes): rope_cache writes each k/v value rounded to bf16 as .to(torch.bfloat16) does, and decode
    and prefill attention over the bf16 pool give the bits they give over a float32 pool holding the
    same (exactly widened) values, on every attention path this CPU has."""
    contexts = [1, 37, block_size, 3 * block_size + 5, 130]
    pool32, batch, qkv = paged_case(torch.float32, heads, kv_heads, d, block_size, contexts, seed=d + 1)
    pool16 = KVPool(pool32.config, dtype=torch.bfloat16)
    pool16.k.copy_(pool32.k)
    pool16.v.copy_(pool32.v)
    pool32.k.copy_(pool16.k)                                     # the float pool holds the rounded values
    pool32.v.copy_(pool16.v)
    cos, sin = rope_tables(torch.tensor([c - 1 for c in contexts]), d, torch.float32)
    q16, q32 = qkv.clone(), qkv.clone()
    KERNELS.rope_cache(q16, cos, sin, batch.slot_mapping, pool16.k[0], pool16.v[0], heads, kv_heads)
    KERNELS.rope_cache(q32, cos, sin, batch.slot_mapping, pool32.k[0], pool32.v[0], heads, kv_heads)
    assert torch.equal(q16, q32)                                 # RoPE on the float32 rows alike
    written = batch.slot_mapping
    flat16, flat32 = pool16.k[0].reshape(kv_heads, -1, d), pool32.k[0].reshape(kv_heads, -1, d)
    assert torch.equal(flat16[:, written], flat32[:, written].to(torch.bfloat16))      # rounded, nearest even
    assert torch.equal(pool16.v[0].reshape(kv_heads, -1, d)[:, written],
                       pool32.v[0].reshape(kv_heads, -1, d)[:, written].to(torch.bfloat16))
    pool32.k.copy_(pool16.k)
    pool32.v.copy_(pool16.v)
    got = KERNELS.decode_attention(q16, heads, pool16.k[0], pool16.v[0], batch.decode_block_tables,
                                   batch.decode_context_lens)
    want = KERNELS.decode_attention(q32, heads, pool32.k[0], pool32.v[0], batch.decode_block_tables,
                                    batch.decode_context_lens)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    # prefill: one chunk of 21 rows at positions 9.., every path of this build
    n, start = 21, 9
    table = torch.randperm(pool16.config.num_blocks, generator=gen(4))[:-(-(start + n) // block_size)]
    spans = torch.tensor([[0, n, start + n]])
    rows = (torch.randn(n, heads + 2 * kv_heads, d, generator=gen(5)) * 0.3)
    for isa in range(KERNELS.attention_isa_max + 1):
        a = KERNELS.prefill_attention(rows, heads, pool16.k[0], pool16.v[0], table[None], spans, isa=isa)
        b = KERNELS.prefill_attention(rows, heads, pool32.k[0], pool32.v[0], table[None], spans, isa=isa)
        assert torch.equal(a, b), isa
    with pytest.raises(ValueError, match="bfloat16 under float32"):      # bf16 rows over a float32 pool
        KERNELS.decode_attention(q16.to(torch.bfloat16), heads, pool32.k[0], pool32.v[0],
                                 batch.decode_block_tables, batch.decode_context_lens)
