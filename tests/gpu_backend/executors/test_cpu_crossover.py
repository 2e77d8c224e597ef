"""cpu_crossover: the decode batch above which quantized projections multiply float weights, chosen
from timings by a fixed rule, pinned by BLINK_INT8_MAX_ROWS, applied to every projection and to
FusedDecode's largest step; the two ways it times compute the same product; and a step past the limit
takes the per-call loop on float weights and agrees with the fused step on the blocks."""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_backend import cpu_kernels
from gpu_backend.executors import cpu_crossover
from gpu_backend.executors.cpu_crossover import MARGIN, choose_limit, decide
from gpu_backend.executors.cpu_decode import MAX_DECODE_ROWS
from gpu_backend.executors.cpu_forward import KernelForward
from gpu_backend.executors.cpu_linear import FloatActHead, QuantKernelLinear, prepare_model
from gpu_backend.model.config import tiny_config
from gpu_backend.model.llama import LlamaModel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_cpu_decode import decode_step, pool_for  # noqa: E402
from test_cpu_quant import quantize_model, tiny  # noqa: E402

KERNELS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the CPU kernels cannot be built here (no g++)")


def projections(model) -> list[QuantKernelLinear]:
    return [m for m in model.modules() if isinstance(m, QuantKernelLinear) and not m.float32_out]


def test_the_limit_is_half_the_first_probe_where_float_weights_win_by_the_margin():
    assert choose_limit({16: (1.0, 0.5), 64: (4.0, 1.0)}) == 8
    assert choose_limit({16: (1.0, 0.9), 64: (4.0, 3.0)}) == 32
    assert choose_limit({16: (1.0, MARGIN), 64: (4.0, 4.0)}) == 8            # the margin itself wins
    assert choose_limit({16: (1.0, 0.9), 64: (4.0, 3.5)}) == MAX_DECODE_ROWS  # within noise: the blocks
    assert choose_limit({64: (4.0, 1.0), 16: (1.0, 2.0)}) == 32              # probes in row order


def test_a_pinned_limit_reaches_every_projection_and_the_fused_step(monkeypatch):
    model = prepare_model(quantize_model(tiny(dict(tie_word_embeddings=True)), {}, Q.Q4_1), KERNELS)
    monkeypatch.setenv(cpu_crossover.ENV, "4")
    assert decide(model) == 4
    mats = projections(model)
    assert mats and all(m.int8_rows == 4 and m.max_rows() == 4 for m in mats)
    assert isinstance(model.logits_head, FloatActHead)              # the head keeps its own rules
    fused = KernelForward(model, pool_for(model), KERNELS).fused
    assert fused is not None and fused.takes(4, 4) and not fused.takes(5, 5)


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_a_bad_pin_is_refused_in_one_line(monkeypatch, value):
    model = prepare_model(quantize_model(tiny({}), {}, Q.Q4_1), KERNELS)
    monkeypatch.setenv(cpu_crossover.ENV, value)
    with pytest.raises(ValueError, match=cpu_crossover.ENV):
        decide(model)


def test_matrices_too_small_to_time_keep_the_fixed_limits(monkeypatch):
    monkeypatch.delenv(cpu_crossover.ENV, raising=False)
    model = prepare_model(quantize_model(tiny({}), {}, Q.Q4_1), KERNELS)
    assert decide(model) is None
    assert all(m.int8_rows is None for m in projections(model))
    assert KernelForward(model, pool_for(model), KERNELS).fused.max_rows == MAX_DECODE_ROWS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_two_timed_ways_compute_the_same_product(dtype):
    """matmul_blocks (int8 codes x blocks) and matmul_float (float weights) on the same x: equal up to
    the activation codes' rounding; and measure() times both at every probe."""
    wider = LlamaModel.random(tiny_config(hidden_size=256, intermediate_size=512), seed=3)
    model = prepare_model(quantize_model(wider, {}, Q.Q4_1).to(dtype), KERNELS)
    mats = projections(model)[:4]
    for m in mats:
        x = torch.randn(16, m.in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
        want = m.matmul_float(x).float()
        torch.testing.assert_close(m.matmul_blocks(x, 1).float(), want, rtol=0.05,
                                   atol=0.05 * float(want.abs().max()))
    timings = cpu_crossover.measure(mats, dtype, 1)
    assert sorted(timings) == sorted(cpu_crossover.PROBE_ROWS)
    assert all(b > 0 and f > 0 for b, f in timings.values())


def test_a_step_past_the_limit_takes_float_weights_and_agrees_with_the_blocks(monkeypatch):
    model = prepare_model(quantize_model(tiny({}), {}, Q.Q4_1), KERNELS)
    ids, pos, batch = decode_step(model, 6)
    with torch.inference_mode():
        on_blocks = KernelForward(model, pool_for(model), KERNELS)(ids, pos, batch)       # fused, int8
        monkeypatch.setenv(cpu_crossover.ENV, "4")
        decide(model)
        forward = KernelForward(model, pool_for(model), KERNELS)
        assert not forward.fused.takes(6, 6)
        on_floats = forward(ids, pos, batch)                                             # the loop, float
    torch.testing.assert_close(on_floats, on_blocks, rtol=0.05, atol=0.05 * float(on_blocks.abs().max()))
