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
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from .. import cpu_kernels

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
    if head is not None and _packable(head):      # an untied lm_head stays as is for state_dict()
        model.logits_head = PackedLinear(head, None, kernels, float32_out=True)
        count += 1
    return count


def _packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16


def prepare_model(model: nn.Module, kernels: cpu_kernels.CpuKernels | None = None) -> nn.Module:
    """The CPU executor's one-time model setup: fuse the projections, pack the bf16 matmuls
    (with `kernels`, decode-sized batches take their small-batch matmul)."""
    if hasattr(model, "fuse_projections"):
        model.fuse_projections()
    n = pack_linears(model, kernels)
    if n:
        log.info("prepacked %d bf16 matmuls for oneDNN", n)
    return model
