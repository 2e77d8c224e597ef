"""KernelForward: LlamaModel.forward for the CPU executor, over the paged pool, with the
fused kernels of gpu_backend/cpu_kernels between the (prepacked) matmuls.

    input_ids [T], positions [T], PagedBatch
      -> embed -> RMSNorm (kernel)
      -> per layer:  qkv_proj -> rope_cache (RoPE on q|k in place, k/v into the pool)
                     -> decode rows: decode_attention straight from the pool's blocks;
                        prefill spans: SDPA (paged_attention.prefill_attention)
                     -> o_proj -> add_rms_norm (residual += o; norm)
                     -> gate_up_proj -> silu_mul -> down_proj
                     -> add_rms_norm (residual += mlp; the next layer's norm, or the final one)
      -> hidden [T, hidden] after the final norm, as LlamaModel.forward returns

Same math as LlamaModel.forward + PagedAttention, in ~9 calls a layer instead of ~60 ops:
on a CPU the small ops, not the matmuls, were half of a batch-8 decode step. Applies to
fused models without q/k norm (Llama, SmolLM2, Mistral, Qwen2) in bfloat16 or float32;
`KernelForward.applicable` says when, and the executor keeps the PyTorch path otherwise.
"""
from __future__ import annotations

import torch

from ..cpu_kernels import CpuKernels
from ..kv_cache import KVPool
from ..model.llama import LlamaModel
from ..paged_attention import PagedBatch, prefill_attention


class KernelForward:
    def __init__(self, model: LlamaModel, pool: KVPool, kernels: CpuKernels):
        if not self.applicable(model, kernels):
            raise ValueError("KernelForward needs a fused model without q/k norm in bf16 or f32")
        cfg = model.config
        self.model, self.pool, self.kernels = model, pool, kernels
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        layers = list(model.layers)
        # The norm after layer i: the next layer's input norm, and the model's final norm last.
        self._next_norms = [layers[i + 1].input_layernorm for i in range(len(layers) - 1)] + [model.norm]

    @staticmethod
    def applicable(model: LlamaModel, kernels: CpuKernels | None) -> bool:
        if kernels is None or model.device.type != "cpu":
            return False
        if not kernels.supports(model.dtype, model.config.head_dim):
            return False
        return all(layer.self_attn.qkv_proj is not None and layer.self_attn.fused_rope
                   and layer.mlp.gate_up_proj is not None for layer in model.layers)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        m, kern = self.model, self.kernels
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        t = input_ids.shape[0]
        x = m.embed_tokens(input_ids)                                  # [T, hidden]: the residual stream
        cos, sin = (c.contiguous() for c in m.rope(positions, x.dtype))  # [T, D] each
        first = m.layers[0].input_layernorm
        normed = kern.add_rms_norm(x, None, first.weight, first.eps)
        for i, layer in enumerate(m.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = attn.qkv_proj(normed).view(t, h + 2 * kvh, d)       # [T, H + 2 KV, D]
            kc, vc = self.pool.k[i], self.pool.v[i]                    # [KV, blocks, bs, D]
            kern.rope_cache(qkv, cos, sin, batch.slot_mapping, kc, vc, h, kvh)
            o = self._attention(qkv, kc, vc, batch)                    # [T, H, D]
            post = layer.post_attention_layernorm
            normed = kern.add_rms_norm(x, attn.o_proj(o.view(t, h * d)), post.weight, post.eps)
            down = mlp.down_proj(kern.silu_mul(mlp.gate_up_proj(normed)))
            nxt = self._next_norms[i]
            normed = kern.add_rms_norm(x, down, nxt.weight, nxt.eps)
        return normed

    def _attention(self, qkv: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, b: PagedBatch) -> torch.Tensor:
        h, kvh = self.num_heads, self.num_kv_heads
        nd = b.num_decode
        dec = None
        if nd:
            dec = self.kernels.decode_attention(qkv, h, kc, vc, b.decode_block_tables, b.decode_context_lens)
            if not b.prefills:
                return dec                                             # [Bd, H, D]
        out = torch.empty((qkv.shape[0], h, self.head_dim), dtype=qkv.dtype)
        if nd:
            out[:nd] = dec
        # RoPE is already applied in place, and this chunk's k/v are in the pool.
        prefill_attention(qkv[:, :h], qkv[:, h:h + kvh], qkv[:, h + kvh:], kc, vc, b, out)
        return out
