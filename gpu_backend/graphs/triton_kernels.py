"""Fused Triton kernels for the step graphs: one kernel where PyTorch's operators launch several.

A step graph of SmolLM2 is made of small kernels (30 layers, ~20 each with PyTorch's
operators, plus sampling), and on a GPU the step time is mostly their launch gaps. These
kernels cut a layer to 9 (4 matmuls from cuBLAS and these 5), 8 in a decode step:

    add_rms_norm(x, delta, w)          x += delta (the residual), then RMSNorm of x
                                       (in place on x; delta None: the norm only)
    rope_kv_write(qkv, positions, ...) RoPE over the q and k heads of the fused qkv
                                       projection, rotated k and v written into the paged
                                       pool at each token's slot -> rotated q [T, H, D]
    paged_attention(q, pool, ...)      causal GQA attention of R rows x S tokens over their
                                       blocks read in place (no gather, no mask tensor):
                                       flash style, an online softmax over key tiles; one
                                       program per (row, KV head, query tile)
    decode_attention(qkv, ...)         one token a row (decode): rope_kv_write and paged_attention
                                       in one kernel, the token's own key and value from registers;
                                       where few rows leave the GPU idle (decode_splits), split
                                       along the context and combined by a second kernel
    silu_mul(gate_up)                  SiLU(gate) * up of the fused gate/up projection

Every kernel computes in float32 and rounds to the tensors' dtype where PyTorch's operators
would (each operator's output); shapes come from the
tensors only (no host sync, capture-safe). Triton compiles a kernel on its first call, once
per dtype and compile-time constant: sizes that vary from shape to shape (rows, tokens a row,
context, strides) are plain arguments that are not specialised on, so the warm-up of one
decode and one prefill shape (graphs/capture.py) compiles every variant before any capture.

On a machine without a GPU the same kernels run under Triton's interpreter
(TRITON_INTERPRET=1 set before this module is imported), which is how the CPU tests diff
them with the PyTorch operators they replace (tests/gpu_backend/graphs/test_triton_kernels.py).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _fix_interpreter_index() -> None:
    """Triton 3.6's interpreter holds a kernel's scalars as 1-element arrays and turns one into an
    int with int(array), which numpy 2 refuses: a loop over range(0, n) with a runtime n fails
    there (compiled kernels are unaffected). Convert the single element instead."""
    from triton.runtime import interpreter
    orig = interpreter._patch_lang_tensor
    if getattr(orig, "blink_index_fix", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    patched.blink_index_fix = True
    interpreter._patch_lang_tensor = patched


if INTERPRETED:
    _fix_interpreter_index()


def _check_device(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device.type != "cuda" and not INTERPRETED:
            raise RuntimeError("the Triton step kernels run on a CUDA device, or on the CPU under "
                               "TRITON_INTERPRET=1 set before gpu_backend.graphs.triton_kernels is imported")


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


# ---------------------------------------------------------------------------------------------
# residual add + RMSNorm

@triton.jit(do_not_specialize=["n_cols", "stride_x", "stride_d", "stride_o", "eps"])
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, out_ptr, n_cols, stride_x, stride_d, stride_o, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * stride_d + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(d.dtype)                  # rounded to the dtype, as x + delta
        tl.store(x_ptr + row * stride_x + cols, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    y = xf * (1.0 / tl.sqrt(var + eps))
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    out = w.to(tl.float32) * y.to(w.dtype).to(tl.float32)                     # weight * (normalised, cast back)
    tl.store(out_ptr + row * stride_o + cols, out.to(w.dtype), mask=m)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] (updated in place to x + delta when delta is given), weight [N] -> RMSNorm(x) [T, N]
    (HF's: normalised in float32, cast back, times the weight)."""
    _check_device(x, weight)
    t, n = x.shape
    out = torch.empty_like(x)
    if t == 0:
        return out
    d = x if delta is None else delta
    _add_rms_norm_kernel[(t,)](x, d, weight, out, n, x.stride(0), d.stride(0), out.stride(0), eps,
                               HAS_DELTA=delta is not None, BLOCK=_pow2(n), num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------
# SiLU(gate) * up

@triton.jit(do_not_specialize=["n_cols", "stride_gu", "stride_o"])
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, stride_gu, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_cols
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=m, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=m, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)                                  # F.silu, rounded to the dtype
    tl.store(out_ptr + row * stride_o + cols, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=m)


def silu_block(cols: int) -> int:
    """Columns one program of silu_mul covers."""
    return min(1024, _pow2(cols))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns, then up) -> SiLU(gate) * up [T, I]."""
    _check_device(gate_up)
    t, two_i = gate_up.shape
    i = two_i // 2
    out = torch.empty((t, i), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = silu_block(i)
    _silu_mul_kernel[(t, triton.cdiv(i, block))](gate_up, out, i, gate_up.stride(0), out.stride(0),
                                                 BLOCK=block, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------
# RoPE + K/V into the paged pool

@triton.jit(do_not_specialize=["stride_qkv_t", "stride_q_t", "stride_c_slot"])
def _rope_kv_write_kernel(qkv_ptr, pos_ptr, inv_freq_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                          stride_qkv_t, stride_q_t, stride_c_slot,
                          H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.float32)
    i = tl.arange(0, HALF)
    freq = pos * tl.load(inv_freq_ptr + i)                                      # [HALF] float32
    cos = tl.cos(freq)[None, :]
    sin = tl.sin(freq)[None, :]
    base = qkv_ptr + t * stride_qkv_t
    # q heads: rotate_half convention (out[:half] = x1 cos - x2 sin, out[half:] = x2 cos + x1 sin)
    hq = tl.arange(0, BLOCK_H)[:, None]
    mq = hq < H
    q1 = tl.load(base + hq * D + i[None, :], mask=mq, other=0.0)
    q2 = tl.load(base + hq * D + HALF + i[None, :], mask=mq, other=0.0)
    q1f, q2f = q1.to(tl.float32), q2.to(tl.float32)
    qo = q_out_ptr + t * stride_q_t + hq * D + i[None, :]
    tl.store(qo, (q1f * cos - q2f * sin).to(q1.dtype), mask=mq)
    tl.store(qo + HALF, (q2f * cos + q1f * sin).to(q1.dtype), mask=mq)
    # k heads (after the q heads), rotated, and v heads (after the k heads) into the pool
    slot = tl.load(slot_ptr + t)
    hk = tl.arange(0, BLOCK_KV)[:, None]
    mk = hk < KV
    k1 = tl.load(base + (H + hk) * D + i[None, :], mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(base + (H + hk) * D + HALF + i[None, :], mask=mk, other=0.0).to(tl.float32)
    ko = k_cache_ptr + slot * stride_c_slot + hk * D + i[None, :]
    tl.store(ko, (k1 * cos - k2 * sin).to(k_cache_ptr.dtype.element_ty), mask=mk)
    tl.store(ko + HALF, (k2 * cos + k1 * sin).to(k_cache_ptr.dtype.element_ty), mask=mk)
    d = tl.arange(0, 2 * HALF)[None, :]
    v = tl.load(base + (H + KV + hk) * D + d, mask=mk, other=0.0)
    tl.store(v_cache_ptr + slot * stride_c_slot + hk * D + d, v.to(v_cache_ptr.dtype.element_ty), mask=mk)


def rope_kv_write(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, slot_mapping: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """qkv [T, (H + 2 KV) * D] (q heads, k heads, v heads), positions and slot_mapping [T] int64,
    inv_freq [D / 2] float32, k_cache / v_cache [blocks, block_size, KV, D] (contiguous) ->
    rotated q [T, H, D]; rotated k and v written at each token's slot."""
    _check_device(qkv, k_cache)
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    if d % 2 or d & (d - 1):
        raise ValueError(f"rope_kv_write needs a power-of-two head_dim, got {d}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and qkv.stride(1) == 1):
        raise ValueError("rope_kv_write needs a contiguous pool and qkv rows")
    q = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    _rope_kv_write_kernel[(t,)](qkv, positions, inv_freq, slot_mapping, q, k_cache, v_cache,
                                qkv.stride(0), q.stride(0), num_kv_heads * d,
                                H=num_heads, KV=num_kv_heads, D=d, HALF=d // 2,
                                BLOCK_H=_pow2(num_heads), BLOCK_KV=_pow2(num_kv_heads), num_warps=2)
    return q


# ---------------------------------------------------------------------------------------------
# causal GQA attention over the paged pool

@triton.jit
def _attend_tile(n0, q, pos, hi, m_i, l_i, acc, r, kvh, k_cache_ptr, v_cache_ptr, tables_ptr, n_tables, scale,
                 stride_c_slot, D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """One key tile [n0, n0 + BLOCK_N) of the online softmax: keys gathered through the block table."""
    d = tl.arange(0, D)
    j = n0 + tl.arange(0, BLOCK_N)                                              # key positions
    jm = j < hi
    blk = tl.load(tables_ptr + r * n_tables + j // BS, mask=jm, other=0)
    slot = blk * BS + j % BS
    kv_off = slot[:, None] * stride_c_slot + kvh * D + d[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=jm[:, None], other=0.0)
    if IEEE:
        sc = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        sc = tl.dot(q, tl.trans(k))
    sc = sc * scale
    visible = (j[None, :] <= pos[:, None]) & jm[None, :]
    sc = tl.where(visible, sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                      # rows with nothing visible yet
    p = tl.exp(sc - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + kv_off, mask=jm[:, None], other=0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["scale", "stride_q_t", "stride_o_t", "stride_c_slot", "n_tables", "ctx", "S"])
def _paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, pos_ptr, out_ptr, scale,
                            stride_q_t, stride_o_t, stride_c_slot, n_tables, ctx, S,
                            G: tl.constexpr, KV: tl.constexpr, D: tl.constexpr,
                            BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            IEEE: tl.constexpr):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    mt = tl.program_id(2)
    # query rows of this tile: m = s * G + g (token s of the row, query head g of this KV head)
    m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = m < S * G
    s = m // G
    h = kvh * G + m % G
    tok = r * S + s
    pos = tl.minimum(tl.load(pos_ptr + tok, mask=mm, other=-1), ctx - 1)        # [M] int64, keys < ctx
    hi = tl.max(pos, axis=0) + 1                                                # keys [0, hi) can be visible
    d = tl.arange(0, D)
    q = tl.load(q_ptr + tok[:, None] * stride_q_t + h[:, None] * D + d[None, :], mask=mm[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(0, hi, BLOCK_N):     # a counted loop: Triton software-pipelines its loads
        m_i, l_i, acc = _attend_tile(n0, q, pos, hi, m_i, l_i, acc, r, kvh, k_cache_ptr, v_cache_ptr, tables_ptr,
                                     n_tables, scale, stride_c_slot, D, BS, BLOCK_N, IEEE)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_o_t + h[:, None] * D + d[None, :], o.to(q.dtype), mask=mm[:, None])


@triton.jit
def _decode_prologue(qkv_ptr, pos_ptr, inv_freq_ptr, r, kvh, stride_qkv_t, ctx, H: tl.constexpr, G: tl.constexpr,
                     KV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_G: tl.constexpr):
    """A decode row's position, its q heads of KV head kvh rotated [BLOCK_G, D] (float32), and its
    token's own k (rotated) and v [D]."""
    pos = tl.minimum(tl.load(pos_ptr + r), ctx - 1)
    d = tl.arange(0, D)
    half = d % HALF
    partner = (d + HALF) % D                                                    # rotate_half's other element
    sign = tl.where(d < HALF, -1.0, 1.0)
    freq = pos.to(tl.float32) * tl.load(inv_freq_ptr + half)                    # [D]: cat(freqs, freqs)
    cos = tl.cos(freq)
    sin = tl.sin(freq)
    base = qkv_ptr + r * stride_qkv_t
    g = tl.arange(0, BLOCK_G)
    gm = g < G
    qh = (kvh * G + g)[:, None] * D
    qa = tl.load(base + qh + d[None, :], mask=gm[:, None], other=0.0).to(tl.float32)
    qb = tl.load(base + qh + partner[None, :], mask=gm[:, None], other=0.0).to(tl.float32)
    q = qa * cos[None, :] + sign[None, :] * qb * sin[None, :]                   # [BLOCK_G, D] rotated
    kb = base + (H + kvh) * D
    k_cur = tl.load(kb + d).to(tl.float32) * cos + sign * tl.load(kb + partner).to(tl.float32) * sin
    v_cur = tl.load(base + (H + KV + kvh) * D + d)
    return pos, q, k_cur, v_cur


@triton.jit
def _store_token_kv(k_cache_ptr, v_cache_ptr, slot_ptr, r, kvh, k_cur, v_cur, stride_c_slot, D: tl.constexpr):
    """The token's rotated k and its v at its slot of the pool (for the steps after this one)."""
    d = tl.arange(0, D)
    slot = tl.load(slot_ptr + r)
    tl.store(k_cache_ptr + slot * stride_c_slot + kvh * D + d, k_cur.to(k_cache_ptr.dtype.element_ty))
    tl.store(v_cache_ptr + slot * stride_c_slot + kvh * D + d, v_cur.to(v_cache_ptr.dtype.element_ty))


@triton.jit
def _decode_keys(q, pos, lo, hi, r, kvh, k_cache_ptr, v_cache_ptr, tables_ptr, n_tables, scale, stride_c_slot,
                 D: tl.constexpr, BS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """The online softmax of a decode row's q heads over its cached keys [lo, hi) (lo a multiple of
    BLOCK_N): q as the products take it, and the softmax's state (max, sum, unnormalised output)."""
    if not IEEE:
        q = q.to(k_cache_ptr.dtype.element_ty)
    posv = tl.full([BLOCK_G], 0, tl.int64) + pos
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(n0, q, posv, hi, m_i, l_i, acc, r, kvh, k_cache_ptr, v_cache_ptr, tables_ptr,
                                     n_tables, scale, stride_c_slot, D, BS, BLOCK_N, IEEE)
    return q, m_i, l_i, acc


@triton.jit
def _decode_own_key(q, k_cur, v_cur, m_i, l_i, acc, scale, k_ty: tl.constexpr, v_ty: tl.constexpr):
    """The token's own key and value into the online softmax, from registers (rounded to the pool's
    dtype, as the cached keys are)."""
    k_own = k_cur.to(k_ty).to(tl.float32)
    sc = tl.sum(q.to(tl.float32) * k_own[None, :], axis=1) * scale             # [BLOCK_G]
    m_new = tl.maximum(m_i, sc)
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(sc - m_new)
    l_i = l_i * alpha + p
    v_own = v_cur.to(v_ty).to(tl.float32)
    acc = acc * alpha[:, None] + p[:, None] * v_own[None, :]
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["scale", "stride_qkv_t", "stride_o_t", "stride_c_slot", "n_tables", "ctx"])
def _decode_attention_kernel(qkv_ptr, pos_ptr, inv_freq_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, out_ptr,
                             scale, stride_qkv_t, stride_o_t, stride_c_slot, n_tables, ctx,
                             H: tl.constexpr, G: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                             BS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """One token a row (decode): RoPE of its q heads (of this KV head) and k, k and v stored at the
    token's slot, attention over the row's cached keys 0..p-1 and the token's own key at p."""
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    pos, q, k_cur, v_cur = _decode_prologue(qkv_ptr, pos_ptr, inv_freq_ptr, r, kvh, stride_qkv_t, ctx,
                                            H, G, KV, D, HALF, BLOCK_G)
    d = tl.arange(0, D)
    g = tl.arange(0, BLOCK_G)
    _store_token_kv(k_cache_ptr, v_cache_ptr, slot_ptr, r, kvh, k_cur, v_cur, stride_c_slot, D)
    q, m_i, l_i, acc = _decode_keys(q, pos, 0, pos, r, kvh, k_cache_ptr, v_cache_ptr, tables_ptr, n_tables, scale,
                                    stride_c_slot, D, BS, BLOCK_G, BLOCK_N, IEEE)   # cached keys 0..p-1
    # the token's own key, from registers (its store above is for later steps)
    m_i, l_i, acc = _decode_own_key(q, k_cur, v_cur, m_i, l_i, acc, scale, k_cache_ptr.dtype.element_ty,
                                    v_cache_ptr.dtype.element_ty)
    o = acc / l_i[:, None]
    tl.store(out_ptr + r * stride_o_t + (kvh * G + g)[:, None] * D + d[None, :], o.to(v_cur.dtype),
             mask=(g < G)[:, None])


@triton.jit(do_not_specialize=["scale", "stride_qkv_t", "stride_c_slot", "n_tables", "ctx", "chunk", "splits"])
def _decode_split_kernel(qkv_ptr, pos_ptr, inv_freq_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, tables_ptr,
                         m_ptr, l_ptr, acc_ptr, scale, stride_qkv_t, stride_c_slot, n_tables, ctx, chunk, splits,
                         H: tl.constexpr, G: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                         BS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """decode_attention split along the context (flash-decoding): program (row, KV head, split sp)
    attends to the cached keys [sp * chunk, (sp + 1) * chunk) below the row's position, the last
    split also to the token's own key; split 0 stores the token's k and v (no split reads that slot).
    Each writes its online softmax's state (max, sum, unnormalised output) for _decode_combine_kernel."""
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    pos, q, k_cur, v_cur = _decode_prologue(qkv_ptr, pos_ptr, inv_freq_ptr, r, kvh, stride_qkv_t, ctx,
                                            H, G, KV, D, HALF, BLOCK_G)
    d = tl.arange(0, D)
    g = tl.arange(0, BLOCK_G)
    if sp == 0:
        _store_token_kv(k_cache_ptr, v_cache_ptr, slot_ptr, r, kvh, k_cur, v_cur, stride_c_slot, D)
    lo = sp.to(tl.int64) * chunk                                                # a multiple of BLOCK_N
    q, m_i, l_i, acc = _decode_keys(q, pos, lo, tl.minimum(lo + chunk, pos), r, kvh, k_cache_ptr, v_cache_ptr,
                                    tables_ptr, n_tables, scale, stride_c_slot, D, BS, BLOCK_G, BLOCK_N,
                                    IEEE)   # cached keys below p only
    if sp == splits - 1:
        m_i, l_i, acc = _decode_own_key(q, k_cur, v_cur, m_i, l_i, acc, scale, k_cache_ptr.dtype.element_ty,
                                        v_cache_ptr.dtype.element_ty)
    part = (r * KV + kvh) * splits + sp
    tl.store(m_ptr + part * BLOCK_G + g, m_i)
    tl.store(l_ptr + part * BLOCK_G + g, l_i)
    tl.store(acc_ptr + (part * BLOCK_G + g)[:, None] * D + d[None, :], acc)


@triton.jit(do_not_specialize=["stride_o_t", "splits"])
def _decode_combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, stride_o_t, splits, G: tl.constexpr, KV: tl.constexpr,
                           D: tl.constexpr, BLOCK_G: tl.constexpr):
    """The splits' softmax states of (row, KV head) into its output: each split's sum and output
    scaled by exp(its max - the max over splits). A split with no key left (a short row) has max
    -inf and weighs 0; the last always holds the token's own key, so the max is finite."""
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    d = tl.arange(0, D)
    g = tl.arange(0, BLOCK_G)
    first = (r * KV + kvh) * splits
    m_all = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for sp in range(0, splits):
        m_all = tl.maximum(m_all, tl.load(m_ptr + (first + sp) * BLOCK_G + g))
    l_all = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for sp in range(0, splits):
        w = tl.exp(tl.load(m_ptr + (first + sp) * BLOCK_G + g) - m_all)
        l_all += w * tl.load(l_ptr + (first + sp) * BLOCK_G + g)
        acc += w[:, None] * tl.load(acc_ptr + ((first + sp) * BLOCK_G + g)[:, None] * D + d[None, :])
    o = acc / l_all[:, None]
    tl.store(out_ptr + r * stride_o_t + (kvh * G + g)[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=(g < G)[:, None])


DECODE_BLOCK_N = 64       # keys a tile of decode attention
SPLIT_MIN_KEYS = 256      # a split of decode attention covers at least this many keys (4 tiles)
MAX_SPLITS = 32
INTERPRETER_SMS = 132     # under the interpreter, decode_splits decides as on an H100 / H200 (132 SMs)
SPLIT_ENV = "BLINK_DECODE_SPLIT"   # "0": decode attention in one program per (row, KV head), never split


def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessor count (what decode_splits fills); INTERPRETER_SMS on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(rows: int, kv_heads: int, ctx: int, sms: int) -> int:
    """How many splits along the context a decode step of `rows` rows at context `ctx` takes: one
    program per (row, KV head) leaves most of the GPU idle where rows x KV heads is far below its
    multiprocessors (1 row of SmolLM2: 3 programs on 132), each walking the whole context alone
    (at 1,024 keys ~5-10 us a layer). Split so that the programs about fill the multiprocessors,
    each split at least SPLIT_MIN_KEYS keys, at most MAX_SPLITS; 1 where that gives fewer than 2
    (then decode_attention runs unsplit, without the combine kernel)."""
    if os.environ.get(SPLIT_ENV, "1") == "0":
        return 1
    want = -(-int(sms) // max(1, rows * kv_heads))
    splits = min(want, ctx // SPLIT_MIN_KEYS, MAX_SPLITS)
    return splits if splits >= 2 else 1


def decode_attention(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, slot_mapping: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, num_heads: int,
                     ctx: int, splits: int = 1) -> torch.Tensor:
    """rope_kv_write + paged_attention for one token a row, in one kernel: qkv [R, (H + 2 KV) * D],
    positions and slot_mapping [R], inv_freq [D / 2], the pool [blocks, bs, KV, D], tables [R, C / bs]
    -> o [R, H * D]. The token's own key and value enter its attention from registers. With `splits`
    > 1 (decode_splits), the context is split across programs and a second kernel combines them."""
    _check_device(qkv, k_cache, tables)
    r = qkv.shape[0]
    bs, kv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    if d & (d - 1) or d < 16 or num_heads % kv:
        raise ValueError(f"decode_attention: head_dim {d} (a power of two >= 16), {num_heads} heads / {kv} KV heads")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and tables.is_contiguous() and qkv.stride(1) == 1):
        raise ValueError("decode_attention needs contiguous qkv rows, pool and block tables")
    out = torch.empty((r, num_heads * d), dtype=qkv.dtype, device=qkv.device)
    if r == 0:
        return out
    g = num_heads // kv
    consts = dict(H=num_heads, G=g, KV=kv, D=d, HALF=d // 2, BS=bs, BLOCK_G=max(16, _pow2(g)), BLOCK_N=DECODE_BLOCK_N,
                  IEEE=ieee_products(qkv.dtype), num_warps=4)
    if splits <= 1:
        _decode_attention_kernel[(r, kv)](qkv, positions, inv_freq, slot_mapping, k_cache, v_cache, tables, out,
                                          d ** -0.5, qkv.stride(0), out.stride(0), kv * d, tables.shape[1], ctx,
                                          **consts)
        return out
    chunk = -(-(-(-ctx // splits)) // DECODE_BLOCK_N) * DECODE_BLOCK_N        # ceil(ctx / splits), whole tiles
    parts = r * kv * splits * consts["BLOCK_G"]
    m = torch.empty(parts, dtype=torch.float32, device=qkv.device)
    l_sum = torch.empty(parts, dtype=torch.float32, device=qkv.device)
    acc = torch.empty((parts, d), dtype=torch.float32, device=qkv.device)
    _decode_split_kernel[(r, kv, splits)](qkv, positions, inv_freq, slot_mapping, k_cache, v_cache, tables, m, l_sum,
                                          acc, d ** -0.5, qkv.stride(0), kv * d, tables.shape[1], ctx, chunk, splits,
                                          **consts)
    _decode_combine_kernel[(r, kv)](m, l_sum, acc, out, out.stride(0), splits, G=g, KV=kv, D=d,
                                    BLOCK_G=consts["BLOCK_G"], num_warps=4)
    return out


def ieee_products(dtype: torch.dtype) -> bool:
    """float32: the attention's products in float32 on the FMA units (tf32 would be ~1e-3 off the
    CPU executor); bf16 / fp16: tensor-core products, float32 sums (the interpreter has no bf16
    products: float32 there)."""
    return dtype == torch.float32 or INTERPRETED


def attention_tiles(seq: int, group: int) -> tuple[int, int]:
    """(BLOCK_M query rows, BLOCK_N keys) of a tile: one token a row takes 16 x 64, longer pieces 64 x
    32 whatever their length, so the step graphs (which give one-token rows to decode_attention)
    use one variant, compiled by the warm-up of any prefill shape, never first inside a capture."""
    return (16, 64) if seq == 1 else (64, 32)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                    positions: torch.Tensor, rows: int, seq: int, ctx: int) -> torch.Tensor:
    """q [R*S, H, D] (rotated), k_cache / v_cache [blocks, block_size, KV, D] (contiguous), tables
    [R, C / block_size] int64 (contiguous), positions [R*S] int64 -> o [R*S, H * D]: each query at
    position p attends to its row's keys 0..p (keys < ctx), scaled by D^-0.5."""
    _check_device(q, k_cache, tables)
    t, h, d = q.shape
    bs, kv = k_cache.shape[1], k_cache.shape[2]
    if t != rows * seq or h % kv or d & (d - 1) or d < 16:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} for {rows} rows x {seq} tokens, "
                         f"{kv} KV heads, head_dim a power of two >= 16")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and tables.is_contiguous() and q.is_contiguous()):
        raise ValueError("paged_attention needs contiguous q, pool and block tables")
    out = torch.empty((t, h * d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    g = h // kv
    block_m, block_n = attention_tiles(seq, g)
    grid = (rows, kv, triton.cdiv(seq * g, block_m))
    _paged_attention_kernel[grid](q, k_cache, v_cache, tables, positions, out, d ** -0.5,
                                  q.stride(0), out.stride(0), kv * d, tables.shape[1], ctx, seq,
                                  G=g, KV=kv, D=d, BS=bs, BLOCK_M=block_m, BLOCK_N=block_n,
                                  IEEE=ieee_products(q.dtype), num_warps=4)
    return out
