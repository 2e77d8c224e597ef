"""LlamaModel: a Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3) in PyTorch.

input_ids [T] + positions [T] -> embed -> num_layers x (RMSNorm -> q/k/v proj
(-> q/k norm) -> RoPE -> AttentionBackend -> o_proj, residual; RMSNorm -> SwiGLU,
residual) -> final RMSNorm -> hidden [T, hidden]; compute_logits(hidden[N]) ->
float32 [N, vocab]. Parameter names are HF's without the "model." prefix, so an
HF state dict loads after stripping it.

Executors capture forward into CUDA graphs, so forward holds no data-dependent
Python control flow and no host syncs: shapes follow the input shapes only.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionBackend
from .config import ModelConfig, tiny_config

__all__ = ["LlamaModel", "RMSNorm", "tiny_config", "rope_inv_freq", "apply_rope"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused_kernel = True        # float32: F.rms_norm (False: the explicit ops, for an A/B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_kernel and x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # the same float32 operations (bit-equal on a CPU); on a GPU one fused kernel instead of
            # six, which counts in a step graph of ~60 norms
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # As HF does: normalise in float32, scale after casting back.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, with Llama-3/linear scaling applied; on the
    CPU (math on the meta device goes through torch._refs, whose first use imports torch._dynamo:
    seconds of the daemon's start)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    scaling = config.rope_scaling_dict
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, head_dim] (HF rotate_half convention)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()
        self.qkv_proj: nn.Module | None = None     # set by fuse(): q, k and v in one matmul
        self.fused_rope = False

    def fuse(self) -> None:
        """Replace q/k/v_proj by one qkv_proj (rows q, then k, then v): one weight pass per step."""
        if self.qkv_proj is not None:
            return
        self.qkv_proj = _concat_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj
        self.fused_rope = isinstance(self.q_norm, nn.Identity)     # q/k norms are per tensor: keep them apart

    def forward(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]                                                      # x: [T, hidden]
        hq, hkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qkv_proj is not None and self.fused_rope:
            # Fused fast path (no q/k norm): RoPE over the q and k heads in one pass.
            qkv = self.qkv_proj(x).view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
            qk = apply_rope(qkv[:, :self.num_heads + self.num_kv_heads], cos, sin)     # [T, H + KV, D]
            o = attn(layer, qk[:, :self.num_heads], qk[:, self.num_heads:], qkv[:, self.num_heads + self.num_kv_heads:])
            return self.o_proj(o.reshape(t, hq))                                         # [T, hidden]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split([hq, hkv, hkv], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim))       # [T, H, D]
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim))    # [T, KV, D]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)                 # [T, KV, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attn(layer, q, k, v)                                            # [T, H, D]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))   # [T, hidden]


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.intermediate_size = i
        self.gate_up_proj: nn.Module | None = None    # set by fuse(): gate and up in one matmul

    def fuse(self) -> None:
        """Replace gate/up_proj by one gate_up_proj (rows gate, then up)."""
        if self.gate_up_proj is not None:
            return
        self.gate_up_proj = _concat_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


def _concat_linears(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the parts' outputs side by side (same math, one weight pass)."""
    w = parts[0].weight
    out = nn.Linear(w.shape[1], sum(p.weight.shape[0] for p in parts),
                    bias=parts[0].bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(torch.cat([p.weight for p in parts]))
        if out.bias is not None:
            out.bias.copy_(torch.cat([p.bias for p in parts]))
    return out.requires_grad_(w.requires_grad)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int):
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.index, self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # nn.Embedding's own init, except on the meta device (the loader's): there normal_ goes
        # through torch._refs, whose first use imports torch._dynamo: 3-7 s of the daemon's start.
        embed = torch.empty(config.vocab_size, config.hidden_size)
        if embed.device.type != "meta":
            nn.init.normal_(embed)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embed)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self.logits_head: nn.Module | None = None   # an executor's faster equivalent of the lm_head matmul
        # float32 even in a bf16 model (as HF keeps it); recomputed by to()/load, never saved.
        inv_freq = rope_inv_freq(config).to(torch.empty(0).device)        # onto the default device
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim / 2]

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, sin: [T, head_dim] in `dtype` (computed in float32)."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]   # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                                # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> hidden [T, hidden] after the final norm."""
        x = self.embed_tokens(input_ids)                 # [T, hidden]
        cos, sin = self.rope(positions, x.dtype)         # [T, head_dim] each
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x)

    def fuse_projections(self) -> "LlamaModel":
        """q/k/v and gate/up projections fused per layer (fewer, larger matmuls). In place;
        HF-named weights (state_dict, loaders) refer to the unfused model, so fuse after loading."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the output projection (embed_tokens.weight when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in float32."""
        if self.logits_head is not None:
            return self.logits_head(hidden).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight  # [V, hidden]
        return F.linear(hidden, weight).float()

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0) -> "LlamaModel":
        """Random weights, deterministic in `seed` (independent of the global RNG), for tests.

        Scaled so activations stay O(1) and argmax decisions are well separated;
        norm weights and biases are perturbed too, so a loader that drops them fails.
        """
        model = cls(config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                noise = torch.randn(p.shape, generator=gen)
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * noise)
                elif name.endswith(".bias"):
                    p.copy_(0.1 * noise)
                elif name == "embed_tokens.weight":
                    p.copy_(noise)
                else:                                    # Linear [out, in]
                    p.copy_(noise / math.sqrt(p.shape[1]))
        return model.requires_grad_(False).eval()   # as the loader leaves a model: served, never trained
