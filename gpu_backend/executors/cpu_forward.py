"""KernelForward: LlamaModel.forward for the CPU executor, over the paged pool, with the
fused kernels of gpu_backend/cpu_kernels between the (prepacked) matmuls.

    input_ids [T], positions [T], PagedBatch
      -> embed; RoPE's cos/sin rows of a table over every position so far (rope()) -> RMSNorm (kernel)
      -> per layer:  qkv matmul -> rope_cache (RoPE on q|k in place, k/v into the pool)
                     -> attention straight from the pool's blocks: decodes (decode_attention:
                        one query row each), prefill chunks (prefill_attention: causal,
                        flash-attention style tiles of query rows x key rows, online softmax;
                        each K/V row read once per tile, not once per query row)
                     -> o matmul -> add_rms_norm (residual += o; norm)
                     -> gate_up matmul -> silu_mul -> down matmul
                     -> add_rms_norm (residual += mlp; the next layer's norm, or the final one)
      -> hidden [T, hidden] after the final norm, as LlamaModel.forward returns

A step of decode rows only on a quantized model (every projection on quant.cc's int8 matmul) runs
the whole stack in one C call instead (cpu_decode.FusedDecode: forward.cc, one OpenMP parallel
region a step), with the same kernels in the same order: the same bits.

Same math as LlamaModel.forward + PagedAttention, in ~9 calls a layer instead of ~60 ops:
on a CPU the small ops, not the matmuls, were half of a batch-8 decode step. The calls
go straight to ctypes with data pointers taken once at setup (weights) or once a step
(activations): shapes are fixed by the model and checked here, once, so the per-layer
Python cost is a few microseconds. Quantized projections (cpu_linear.QuantKernelLinear)
run on their GGUF blocks. Applies to fused models without q/k norm (Llama,
SmolLM2, Mistral, Qwen2) in bfloat16 or float32, over a pool of the model's dtype or a bf16
pool under float32 (the kernels' f32kv16 entries); `KernelForward.applicable` says when,
and the executor keeps the PyTorch path otherwise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cpu_kernels import CpuKernels
from ..kv_pool import KVPool
from ..model.llama import LlamaModel
from ..paged_attention import PagedBatch
from .cpu_decode import FusedDecode
from .cpu_linear import PackedLinear, QuantKernelLinear


def prefill_spans(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's prefill chunks for the prefill attention kernel -> (block tables [S, W],
    spans [S, 3]: first row, tokens n, context length c after the step), once a step."""
    width = max(len(s.block_table) for s in batch.prefills)
    tables = torch.zeros((len(batch.prefills), width), dtype=torch.int64)
    for i, s in enumerate(batch.prefills):
        tables[i, :len(s.block_table)] = s.block_table
    spans = torch.tensor([[s.token_start, s.num_tokens, s.context_len] for s in batch.prefills], dtype=torch.int64)
    return tables, spans


class _Matmul:
    """One projection: the quantized matmul over GGUF blocks (QuantKernelLinear), or the
    small-batch kernel for decode-sized batches where the layer has it, else oneDNN's
    prepacked matmul, else (float32 models) F.linear."""

    def __init__(self, layer: nn.Module, kernels: CpuKernels):
        self.quant = layer if isinstance(layer, QuantKernelLinear) else None
        if self.quant is not None:
            return
        self.bias = layer.bias
        self.bias_ptr = None if layer.bias is None else layer.bias.data_ptr()
        self.n, self.k = layer.out_features, layer.in_features
        self.packed = layer.packed if isinstance(layer, PackedLinear) else None
        self.weight = layer.weight                                   # None: a PackedLinear without kernels
        self.layer = layer if isinstance(layer, PackedLinear) else None
        self.small = self.layer is not None and self.layer.small is not None
        self.weight_ptr = self.weight.data_ptr() if self.small else None
        self.small_fn = kernels.raw("linear") if self.small else None

    def __call__(self, x: torch.Tensor, threads: int) -> torch.Tensor:    # x: [M, K] contiguous
        if self.quant is not None:           # its output buffer reused: each is read within its layer
            return self.quant.matmul(x, threads, reuse_output=True)
        m = x.shape[0]
        if self.small and self.layer.takes_small(m):
            y = torch.empty((m, self.n), dtype=x.dtype)
            self.small_fn(x.data_ptr(), self.weight_ptr, self.bias_ptr, y.data_ptr(), m, self.n, self.k, threads)
            return y
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class _LayerPlan:
    """One decoder layer's matmuls and the data pointers of its norm weights and pool tensors."""

    def __init__(self, layer: nn.Module, next_norm: nn.Module, pool: KVPool, index: int, kernels: CpuKernels):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv, self.o = _Matmul(attn.qkv_proj, kernels), _Matmul(attn.o_proj, kernels)
        self.gate_up, self.down = _Matmul(mlp.gate_up_proj, kernels), _Matmul(mlp.down_proj, kernels)
        self.kc, self.vc = pool.k[index], pool.v[index]                  # [KV, blocks, bs, D] views
        self.kc_ptr, self.vc_ptr = self.kc.data_ptr(), self.vc.data_ptr()
        post = layer.post_attention_layernorm
        self.post_w, self.post_eps = post.weight.data_ptr(), post.eps
        self.next_w, self.next_eps = next_norm.weight.data_ptr(), next_norm.eps


class KernelForward:
    def __init__(self, model: LlamaModel, pool: KVPool, kernels: CpuKernels):
        if not self.applicable(model, kernels):
            raise ValueError("KernelForward needs a fused model without q/k norm in bf16 or f32")
        cfg = model.config
        pc = pool.config
        if (not kernels.pool_dtypes_ok(model.dtype, pool.k.dtype) or pool.v.dtype != pool.k.dtype
                or pc.num_layers != cfg.num_layers or pc.num_kv_heads != cfg.num_kv_heads
                or pc.head_dim != cfg.head_dim or not pool.k.is_contiguous() or not pool.v.is_contiguous()):
            raise ValueError(f"KV pool {tuple(pool.k.shape)} {pool.k.dtype} does not fit the model")
        self.model = model
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.hidden = cfg.hidden_size
        self.num_blocks, self.block_size = pc.num_blocks, pc.block_size
        layers = list(model.layers)
        nexts = [layers[i + 1].input_layernorm for i in range(len(layers) - 1)] + [model.norm]
        self.plans = [_LayerPlan(layer, nxt, pool, i, kernels) for i, (layer, nxt) in enumerate(zip(layers, nexts))]
        first = layers[0].input_layernorm
        self.first_w, self.first_eps = first.weight.data_ptr(), first.eps
        dt = model.dtype
        self.kv_dtype = kv = pool.k.dtype          # the model's, or bf16 under float32 (half the KV bytes)
        self.add_rms_norm = kernels.raw("add_rms_norm", dt)
        self.rope_cache = kernels.raw("rope_cache", dt, kv)
        self.decode_attention = kernels.raw("decode_attention", dt, kv)
        self.prefill_attention = kernels.raw("prefill_attention", dt, kv)
        self.attention_isa = kernels.attention_isa
        self.silu_mul = kernels.raw("silu_mul", dt)
        self._rope_cos = self._rope_sin = None   # [cap, D] each: m.rope over positions 0..cap-1 (rope())
        # Decode steps of a quantized model: the whole stack in one call (None: the per-call loop only).
        self.fused = FusedDecode(self, kernels) if FusedDecode.fits(self) else None

    @staticmethod
    def applicable(model: LlamaModel, kernels: CpuKernels | None) -> bool:
        if kernels is None or model.device.type != "cpu":
            return False
        if not kernels.supports(model.dtype, model.config.head_dim):
            return False
        return all(layer.self_attn.qkv_proj is not None and layer.self_attn.fused_rope
                   and layer.mlp.gate_up_proj is not None for layer in model.layers)

    def rope(self, positions: torch.Tensor, dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] of `positions`, contiguous: rows of a table of LlamaModel.rope over positions
        0..cap-1 (elementwise, so the same values), made again twice as long when a position passes
        it. Two gathers a step instead of rope's six small operators (~60 us of a ~3.5 ms 1-row
        decode step on a 2-core Zen 4)."""
        cos, sin = self.rope_tables(int(positions.max()) + 1, dt)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def rope_tables(self, need: int, dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables [cap, D] themselves, cap >= need positions (the decode step's C call gathers them)."""
        if self._rope_cos is None or need > self._rope_cos.shape[0] or self._rope_cos.dtype != dt:
            cap = 1 << max(8, (need - 1).bit_length())
            cos, sin = self.model.rope(torch.arange(cap), dt)
            self._rope_cos, self._rope_sin = cos.contiguous(), sin.contiguous()
        return self._rope_cos, self._rope_sin

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        m = self.model
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        t = input_ids.shape[0]
        if positions.shape != (t,) or batch.slot_mapping.shape != (t,) or t == 0:
            raise ValueError(f"{t} tokens, {tuple(positions.shape)} positions, "
                             f"{tuple(batch.slot_mapping.shape)} slots")
        threads = torch.get_num_threads()
        x = m.embed_tokens(input_ids)                                  # [T, hidden]: the residual stream
        x_ptr, dt = x.data_ptr(), x.dtype
        cos, sin = self.rope(positions, dt)                            # [T, D] each
        cos_ptr, sin_ptr, slots_ptr = cos.data_ptr(), sin.data_ptr(), batch.slot_mapping.data_ptr()
        nd = batch.num_decode                                         # decode rows first, then the chunks
        dec_tables, dec_lens = batch.decode_block_tables, batch.decode_context_lens     # [Bd, W], [Bd]
        if self.fused is not None and self.fused.takes(t, nd):
            return self.fused(x, cos, sin, batch.slot_mapping, dec_tables, dec_lens, threads)
        if batch.prefills:
            pre_tables, spans = prefill_spans(batch)                   # once a step, for every layer
        isa = self.attention_isa
        heads_total = h + 2 * kvh
        normed = torch.empty_like(x)           # each norm's output, reused layer after layer
        o = torch.empty((t, h * d), dtype=dt)  # [T, H * D]: attention's output, reused likewise
        act = None                             # [T, I]: silu(gate) * up, reused likewise
        self.add_rms_norm(x_ptr, None, self.first_w, normed.data_ptr(), t, self.hidden, self.first_eps, threads)
        for p in self.plans:
            qkv = p.qkv(normed, threads)                               # [T, (H + 2 KV) * D]
            self.rope_cache(qkv.data_ptr(), cos_ptr, sin_ptr, slots_ptr, p.kc_ptr, p.vc_ptr, t, heads_total,
                            h + kvh, h, kvh, d, self.num_blocks * self.block_size, threads)
            # RoPE is applied in place, and this step's k/v are in the pool.
            if nd:
                self.decode_attention(qkv.data_ptr(), heads_total * d, p.kc_ptr, p.vc_ptr, dec_tables.data_ptr(),
                                      None, dec_tables.shape[1], dec_lens.data_ptr(), o.data_ptr(), nd, h, kvh, d,
                                      self.num_blocks, self.block_size, d ** -0.5, threads)
            if batch.prefills:
                self.prefill_attention(qkv.data_ptr(), heads_total * d, p.kc_ptr, p.vc_ptr, pre_tables.data_ptr(),
                                       pre_tables.shape[1], spans.data_ptr(), spans.shape[0], o.data_ptr(), h, kvh,
                                       d, self.num_blocks, self.block_size, d ** -0.5, isa, threads)
            attn_out = p.o(o, threads)
            self.add_rms_norm(x_ptr, attn_out.data_ptr(), p.post_w, normed.data_ptr(), t, self.hidden,
                              p.post_eps, threads)
            gate_up = p.gate_up(normed, threads)                       # [T, 2 I]
            if act is None:
                act = torch.empty((t, gate_up.shape[1] // 2), dtype=dt)
            self.silu_mul(gate_up.data_ptr(), act.data_ptr(), t, act.shape[1], threads)
            down = p.down(act, threads)
            self.add_rms_norm(x_ptr, down.data_ptr(), p.next_w, normed.data_ptr(), t, self.hidden,
                              p.next_eps, threads)
        return normed
