"""Quantized weights kept in their GGUF block format: QuantWeight and QuantLinear.

    gguf_weights (tensor of type Q4_0/Q4_1/Q8_0/Q4_K, Q/K rows un-permuted as rows of blocks)
    -> QuantWeight (ggml type id, blocks uint8 [N, row bytes], K)
    -> loader: QuantLinear in place of the model's nn.Linear (bias, if any, float32)
    -> fuse_quantized(model): q|k|v and gate|up joined into one QuantLinear each
       (rows of blocks concatenated; parts of different types stay separate segments)
    -> the executor computes it (executors/cpu_linear.py: quant.cc's integer matmul
       over the blocks), or replaces it by a float nn.Linear (to_linear) where it cannot

QuantLinear.forward is the reference: it dequantizes (gguf's numpy code) and runs
F.linear, slowly, for the rare caller that runs the model as is.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants
from torch import nn

log = logging.getLogger("blink.gpu_daemon")

# ggml types whose blocks the CPU kernels read directly (cpu_kernels.QUANT_TYPES), with the
# values per block row unit: K must be a multiple of it.
SERVED_TYPES = {GGMLQuantizationType.Q4_0: 32, GGMLQuantizationType.Q4_1: 32,
                GGMLQuantizationType.Q8_0: 32, GGMLQuantizationType.Q4_K: 256}


@dataclasses.dataclass(frozen=True)
class QuantWeight:
    """A [N, K] weight as N rows of GGUF blocks."""
    wtype: int                  # ggml type id (GGMLQuantizationType value)
    blocks: torch.Tensor        # uint8 [N, row bytes], contiguous
    k: int                      # values per row

    @property
    def n(self) -> int:
        return self.blocks.shape[0]

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.wtype).name

    def rows(self, index: torch.Tensor) -> "QuantWeight":
        """The rows `index` (a permutation or selection), still as blocks."""
        return QuantWeight(self.wtype, self.blocks[index].contiguous(), self.k)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] (gguf's reference dequantization)."""
        values = quants.dequantize(self.blocks.numpy(), GGMLQuantizationType(self.wtype))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(self.n, self.k))


def is_served(wtype: int, k: int) -> bool:
    unit = SERVED_TYPES.get(wtype)
    return unit is not None and k % unit == 0


class QuantLinear(nn.Module):
    """y = x @ W^T + b with W as one or more QuantWeight segments stacked along N (the parts of
    a fused projection); same shapes as nn.Linear. The bias (optional) is float32."""

    def __init__(self, segments: list[QuantWeight], bias: torch.Tensor | None = None):
        super().__init__()
        k = {s.k for s in segments}
        if len(k) != 1:
            raise ValueError(f"QuantLinear segments disagree on K: {sorted(k)}")
        self.segments = _merge_same_type(segments)
        self.in_features = k.pop()
        self.out_features = sum(s.n for s in self.segments)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def extra_repr(self) -> str:
        kinds = "+".join(f"{s.type_name}[{s.n}]" for s in self.segments)
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks={kinds}"

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        return torch.cat([s.dequantize() for s in self.segments])

    def to_linear(self, dtype: torch.dtype) -> nn.Linear:
        """A float nn.Linear with the dequantized weight (for a path without the kernels)."""
        w = self.dequantize()
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight = nn.Parameter(w.to(dtype), requires_grad=False)
        if self.bias is not None:
            lin.bias = nn.Parameter(self.bias.detach().to(dtype), requires_grad=False)
        return lin

    @property
    def nbytes(self) -> int:
        return sum(s.blocks.numel() for s in self.segments)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize().to(x.dtype), bias)


def _merge_same_type(segments: list[QuantWeight]) -> list[QuantWeight]:
    """Adjacent segments of one type become one (their rows of blocks concatenated)."""
    out: list[QuantWeight] = []
    for s in segments:
        if out and out[-1].wtype == s.wtype:
            out[-1] = QuantWeight(s.wtype, torch.cat([out[-1].blocks, s.blocks]), s.k)
        else:
            out.append(s)
    return out


def _join(parts: list[nn.Module], dtype: torch.dtype) -> nn.Module | None:
    """One module computing the parts side by side: a QuantLinear when all are; None when none
    is (LlamaModel's own fuse() joins float parts); else the quantized parts as float."""
    quantized = [isinstance(p, QuantLinear) for p in parts]
    if not any(quantized):
        return None
    if all(quantized):
        biases = [p.bias for p in parts]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        return QuantLinear([s for p in parts for s in p.segments], bias)
    log.info("a fused projection mixes quantized and float parts: dequantizing it")
    return _concat_float([p.to_linear(dtype) if q else p for p, q in zip(parts, quantized)])


def _concat_float(parts: list[nn.Linear]) -> nn.Linear:
    w = torch.cat([p.weight.detach() for p in parts])
    lin = nn.Linear(w.shape[1], w.shape[0], bias=parts[0].bias is not None, device="meta")
    lin.weight = nn.Parameter(w, requires_grad=False)
    if parts[0].bias is not None:
        lin.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    return lin


def fuse_quantized(model: nn.Module) -> int:
    """Fuse the quantized q|k|v and gate|up projections of a LlamaModel in place, as its
    fuse_projections() does for float ones (rows q, k, v; gate, up), which then leaves them be.
    Returns how many fused projections are quantized."""
    count = 0
    dtype = model.dtype
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is None:
            joined = _join([attn.q_proj, attn.k_proj, attn.v_proj], dtype)
            if joined is not None:
                attn.qkv_proj = joined
                del attn.q_proj, attn.k_proj, attn.v_proj
                attn.fused_rope = isinstance(attn.q_norm, nn.Identity)   # as Attention.fuse()
        if mlp.gate_up_proj is None:
            joined = _join([mlp.gate_proj, mlp.up_proj], dtype)
            if joined is not None:
                mlp.gate_up_proj = joined
                del mlp.gate_proj, mlp.up_proj
        count += isinstance(attn.qkv_proj, QuantLinear) + isinstance(mlp.gate_up_proj, QuantLinear)
    return count


def dequantize_all(model: nn.Module) -> int:
    """Replace every QuantLinear in `model` by a float nn.Linear in the model's dtype (the path
    without the CPU kernels); a quantized logits_head is dropped (compute_logits then uses the
    float lm_head weight). Returns how many were replaced."""
    count = 0
    dtype = model.dtype
    if isinstance(getattr(model, "logits_head", None), QuantLinear):
        model.logits_head = None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantLinear):
                setattr(parent, name, child.to_linear(dtype))
                count += 1
    return count
