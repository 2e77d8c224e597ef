"""The model's forward inside a step graph with the fused Triton kernels (graphs/triton_kernels.py).

    input_ids, positions, slot_mapping [R*S], block tables [R, C/bs], the paged pool
      -> embedding -> x; normed = RMSNorm(x)                               (add_rms_norm)
      -> per layer (9 kernels: 4 cuBLAS matmuls and 5 of ours; 8 in a decode step):
           qkv = normed @ W_qkv                                            (matmul)
           q = RoPE(q); K/V <- RoPE(k), v at each token's slot             (rope_kv_write)
           o = causal GQA attention of each row over its blocks in place   (paged_attention)
             (one token a row: both in one kernel                          (decode_attention);
            few rows: split along the context, then a combine kernel: decode_splits)
           x += o @ W_o; normed = RMSNorm(x)                               (matmul, add_rms_norm)
           h = SiLU(gate) * up of normed @ W_gate_up                        (matmul, silu_mul)
           x += h @ W_down; normed = the next layer's (or the final) RMSNorm(x)
      -> hidden = normed [R*S, hidden] (after the final norm, as LlamaModel.forward returns)

The same function as LlamaModel.forward with GraphAttention (the "torch" kernels): the
PyTorch operators of one layer launch ~20 kernels on a GPU, these 9. It applies to the
models whose projections are fused (graphs/device.load_graph_model) and have no q/k norm
(SmolLM2, Llama, Mistral, Qwen2), with a power-of-two head size; `supported` says why not.
"auto" (the executors' default) takes them on a GPU once `self_test` has seen each kernel give
PyTorch's result there; a kernel that fails to compile or disagrees costs the speed, not the run.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("blink.gpu_daemon")

KERNELS = ("auto", "triton", "torch")


def supported(model) -> str | None:
    """None when the fused forward applies to `model`, else the reason it does not."""
    cfg = model.config
    d = cfg.head_dim
    if d < 16 or d & (d - 1):
        return f"head_dim {d} is not a power of two >= 16"
    for layer in model.layers:
        att, mlp = layer.self_attn, layer.mlp
        if att.qkv_proj is None or not att.fused_rope or mlp.gate_up_proj is None:
            return "the projections are not fused, or the model has q/k norms"
        if not (layer.input_layernorm.fused_kernel and layer.post_attention_layernorm.fused_kernel):
            return "the norms are set to the explicit operations"
    return None


def resolve(kernels: str, model, device: torch.device) -> str:
    """"auto": "triton" on a CUDA device where Triton imports, the model is supported and the
    kernels pass self_test there, else "torch" (with a warning saying why, when the kernels fail)."""
    if kernels not in KERNELS:
        raise ValueError(f"step kernels must be one of {KERNELS}, got {kernels!r}")
    if kernels != "auto":
        if kernels == "triton" and (why := supported(model)) is not None:
            raise ValueError(f"the Triton step kernels do not apply to this model: {why}")
        return kernels
    if torch.device(device).type != "cuda" or supported(model) is not None:
        return "torch"
    why = self_test(torch.device(device), model.dtype)
    if why is not None:
        log.warning("step graphs: the Triton kernels are not used (%s); PyTorch's operators instead", why)
        return "torch"
    return "triton"


def failure(e: Exception) -> str:
    """A compiler's or driver's error as one line, the reason a kernel set is not used."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def _off(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> str | None:
    """None where got is want within the self-tests' tolerance for dtype (NaN never is), else why."""
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    err = (got.float() - want.float()).abs().max().item()
    return None if err <= tol * (1 + want.float().abs().max().item()) else f"{name} off by {err:.3g}"


_SELF_TESTS: dict[tuple, str | None] = {}
_SPLIT_CHECKS: dict[tuple, str | None] = {}   # split_key -> None, or why the split decode attention is off


def split_key(model, device: torch.device, block_size: int) -> tuple:
    """What the split decode attention's kernels are compiled for: device, dtype, heads, KV heads,
    head size, block size."""
    cfg = model.config
    return str(torch.device(device)), model.dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size


def decode_splits(rows: int, ctx: int, model, device: torch.device, block_size: int) -> int:
    """The splits a decode step of `rows` rows at context `ctx` takes (triton_kernels.decode_splits on
    the device's multiprocessors); 1 where the split kernels of this model failed check_splits."""
    from . import triton_kernels as tk
    if _SPLIT_CHECKS.get(split_key(model, device, block_size)) is not None:
        return 1
    return tk.decode_splits(rows, model.config.num_kv_heads, ctx, tk.multiprocessors(device))


def check_splits(model, device: torch.device, block_size: int) -> str | None:
    """The split decode attention, in the variant this model's steps compile (its heads, head size,
    dtype, block size), against the unsplit kernel once per process: None, or why not (logged; the
    steps then never split: decode_attention unsplit is what it replaces, the Triton kernels stay)."""
    key = split_key(model, device, block_size)
    if key not in _SPLIT_CHECKS:
        cfg = model.config
        try:
            why = _split_self_test(torch.device(device), model.dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   block_size)
        except Exception as e:      # noqa: BLE001 - a compiler or driver error is the answer
            why = failure(e)
        _SPLIT_CHECKS[key] = why
        if why is not None:
            log.warning("step graphs: decode attention is not split along the context (%s)", why)
    return _SPLIT_CHECKS[key]


def self_test(device: torch.device, dtype: torch.dtype) -> str | None:
    """Each kernel once on small random inputs on `device`, against PyTorch's operators: None when
    all agree, else why not (Triton missing, a compile or launch error, a wrong result). Once per
    device and dtype in a process; what "auto" asks before it picks the kernels."""
    key = (str(device), dtype)
    if key not in _SELF_TESTS:
        try:
            _SELF_TESTS[key] = _self_test(device, dtype)
        except Exception as e:      # noqa: BLE001 - a compiler or driver error is the answer
            _SELF_TESTS[key] = failure(e)
    return _SELF_TESTS[key]


@torch.inference_mode()
def _self_test(device: torch.device, dtype: torch.dtype) -> str | None:
    import torch.nn.functional as F

    from ..model.llama import apply_rope
    from . import triton_kernels as tk
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    def off(name, got, want):
        return _off(name, got, want, dtype)

    x, delta, w = rnd(3, 64), rnd(3, 64), rnd(64)
    want_x = x + delta
    want = F.rms_norm(want_x.float(), (64,), None, 1e-5).to(dtype) * w
    got = tk.add_rms_norm(x, delta, w, 1e-5)
    if why := off("add_rms_norm", got, want) or off("add_rms_norm's residual", x, want_x):
        return why
    gu = rnd(3, 96)
    if why := off("silu_mul", tk.silu_mul(gu), F.silu(gu[:, :48]) * gu[:, 48:]):
        return why
    h, kv, d, bs, blocks, t = 4, 2, 16, 4, 8, 6
    qkv = rnd(t, (h + 2 * kv) * d)
    pos = torch.arange(t, device=device)
    slots = torch.arange(t, device=device) + bs
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device).float() / d))
    kc = torch.zeros(blocks, bs, kv, d, device=device, dtype=dtype)
    vc = torch.zeros_like(kc)
    q = tk.rope_kv_write(qkv, pos, inv, slots, kc, vc, h, kv)
    freqs = pos.float()[:, None] * inv[None]
    emb = torch.cat((freqs, freqs), -1)
    heads = qkv.float().view(t, h + 2 * kv, d)
    qk = apply_rope(heads[:, :h + kv], emb.cos(), emb.sin())
    if why := off("rope_kv_write", q, qk[:, :h]) or off("rope_kv_write's k", kc.view(-1, kv, d)[slots], qk[:, h:]):
        return why
    tables = torch.tensor([[1, 2]], device=device)          # the t tokens at slots bs.. of one row
    o = tk.paged_attention(q, kc, vc, tables, pos, 1, t, 2 * bs)
    keys, vals = kc.view(-1, kv, d)[slots].float(), vc.view(-1, kv, d)[slots].float()
    g = h // kv
    sc = torch.einsum("qhd,khd->hqk", q.float(), keys.repeat_interleave(g, 1)) * d ** -0.5
    sc = sc.masked_fill(torch.ones(t, t, dtype=torch.bool, device=device).triu(1), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", sc.softmax(-1), vals.repeat_interleave(g, 1)).reshape(t, h * d)
    if why := off("paged_attention", o, want):
        return why
    # decode: the last token of that row again, its K/V rewritten in place, against the two kernels' result
    tables_r = torch.tensor([[1, 2]], device=device)
    dec = tk.decode_attention(qkv[-1:], pos[-1:], inv, slots[-1:], kc, vc, tables_r, h, 2 * bs)
    if why := off("decode_attention", dec, want[-1:]):
        return why
    return _sampler_self_test(device, gen)


@torch.inference_mode()
def _split_self_test(device: torch.device, dtype: torch.dtype, h: int, kv: int, d: int, bs: int) -> str | None:
    """decode_attention split 4 ways against unsplit, on random inputs of the given shape: rows at
    the first key (3 of the 4 splits empty), mid-context and at the end."""
    from . import triton_kernels as tk
    gen = torch.Generator().manual_seed(1)
    ctx = 4 * max(tk.SPLIT_MIN_KEYS, bs)
    rows = 3
    tables = torch.arange(rows * ctx // bs, device=device).view(rows, ctx // bs)
    kc = torch.randn(rows * ctx // bs + 1, bs, kv, d, generator=gen).to(device=device, dtype=dtype)
    vc = torch.randn(kc.shape, generator=gen).to(device=device, dtype=dtype)
    qkv = torch.randn(rows, (h + 2 * kv) * d, generator=gen).to(device=device, dtype=dtype)
    pos = torch.tensor([0, ctx // 2 + 5, ctx - 1], device=device)
    slots = tables.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device).float() / d))
    want = tk.decode_attention(qkv, pos, inv, slots, kc.clone(), vc.clone(), tables, h, ctx)
    got = tk.decode_attention(qkv, pos, inv, slots, kc, vc, tables, h, ctx, splits=4)
    return _off("decode_attention split 4 ways", got, want, dtype)


def _sampler_self_test(device: torch.device, gen: torch.Generator) -> str | None:
    """The sampler's kernels give the PyTorch sampler's results bit for bit (penalties, a bias, a stop id)."""
    from . import sampler, triton_sampler
    vocab, rows = 96, 3
    s = sampler.SeatState(2, vocab, device)
    p = sampler.RowParams.neutral(rows, s.sink, device)
    p.seat[:2] = torch.tensor([0, 1], device=device)
    p.repetition[0], p.frequency[1], p.presence[1], p.min_tokens[0] = 1.3, 0.5, 0.7, 4
    p.stop_ids[0, 0] = 7
    s.fill(0, [1, 2, 3], [4, 4], logit_bias=((5, 2.0),))
    s.fill(1, [9], [10], bad_words=((10, 11),))
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(device)
    if not torch.equal(triton_sampler.process(logits, p, s), sampler.process(logits, p, s)):
        return "sampler process differs from PyTorch's"
    seeds = torch.randint(-2**62, 2**62, (rows,), generator=gen).to(device)
    if not torch.equal(triton_sampler.uniform(seeds, p.index), sampler.uniform(seeds, p.index)):
        return "sampler uniform differs from PyTorch's"
    # the draw: greedy and top-k 1 rows take the argmax, a top-k 5, top-p 0.7 row one of the ids the
    # reference keeps (both thresholds found by the draw's descent, no sort)
    temp = torch.tensor([0.0, 1.0, 0.8], device=device)
    top_k = torch.tensor([0, 1, 5], device=device)
    top_p = torch.tensor([1.0, 1.0, 0.7], device=device)
    drawn = triton_sampler.draw(logits, temp, top_p, top_k, seeds, p.index)
    probs, order = sampler.filtered_sorted(logits, temp, top_p, top_k)
    kept = order[2][probs[2] > 0]
    if not (bool((drawn[:2] == logits.argmax(dim=-1)[:2]).all()) and bool((kept == drawn[2]).any())):
        return "sampler draw breaks its rules"
    # the logprobs of the rows whose record is read: the token's rank and the top ids exactly (the
    # logits are distinct), the values within rounding; the row not wanted gets zeros
    tokens = torch.tensor([3, 5, 7], device=device)
    want = torch.tensor([1, 0, 1], device=device)
    lp, rank, ids, vals = triton_sampler.logprobs(logits, tokens, 5, want)
    ref = sampler.logprobs(logits, tokens, 5)
    rows_ = [0, 2]
    if not (torch.equal(rank[rows_], ref[1][rows_]) and torch.equal(ids[rows_], ref[2][rows_])
            and bool(torch.allclose(vals[rows_], ref[3][rows_], atol=1e-4)) and float(vals[1].abs().sum()) == 0):
        return "sampler logprobs differ from PyTorch's"
    counts, recent = s.counts.clone(), s.recent.clone()
    sampler.update(s, p, tokens)
    want = (s.counts.clone(), s.recent.clone())
    s.counts.copy_(counts)
    s.recent.copy_(recent)
    triton_sampler.update(s, p, tokens)
    if not (torch.equal(s.counts, want[0]) and torch.equal(s.recent, want[1])):
        return "sampler seat update differs from PyTorch's"
    return None


def forward(model, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            tables: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: int, seq: int,
            ctx: int) -> torch.Tensor:
    """input_ids, positions, slot_mapping [R*S] int64; tables [R, C/bs] int64; k_pool / v_pool
    [L, blocks + 1, bs, KV, D] -> hidden [R*S, hidden] after the final norm."""
    from . import triton_kernels as tk
    cfg = model.config
    layers = model.layers
    splits = decode_splits(rows, ctx, model, input_ids.device, k_pool.shape[2]) if seq == 1 else 1
    x = model.embed_tokens(input_ids)                                                     # [T, hidden]
    first = layers[0].input_layernorm
    normed = tk.add_rms_norm(x, None, first.weight, first.eps)
    inv_freq = model.inv_freq.float()
    for i, layer in enumerate(layers):
        att, mlp = layer.self_attn, layer.mlp
        kc, vc = k_pool[i], v_pool[i]                                                    # [blocks + 1, bs, KV, D]
        qkv = att.qkv_proj(normed)
        if seq == 1:                    # decode: RoPE, the K/V store and the attention in one kernel
            o = tk.decode_attention(qkv, positions, inv_freq, slot_mapping, kc, vc, tables, cfg.num_heads, ctx,
                                    splits)
        else:
            q = tk.rope_kv_write(qkv, positions, inv_freq, slot_mapping, kc, vc,
                                 cfg.num_heads, cfg.num_kv_heads)                        # [T, H, D]
            o = tk.paged_attention(q, kc, vc, tables, positions, rows, seq, ctx)         # [T, H*D]
        post = layer.post_attention_layernorm
        normed = tk.add_rms_norm(x, att.o_proj(o), post.weight, post.eps)
        nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
        normed = tk.add_rms_norm(x, mlp.down_proj(tk.silu_mul(mlp.gate_up_proj(normed))), nxt.weight, nxt.eps)
    return normed
