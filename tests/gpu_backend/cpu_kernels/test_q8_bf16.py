"""q8_bf16.cc: a Q8_0 matrix repacked as exact bf16 codes (G16 layout) times bf16 activations with
AVX512-BF16 dot products. What it must compute: the float32 matmul of the dequantized matrix (gguf's
own dequantization) with the bf16 activations, every product exact, so it agrees with a float64
reference to float32 summation error, and with quant.cc's float-activation matmul over the same
blocks (the path it replaces from 4 rows) likewise."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from gpu_backend import cpu_kernels

KERNELS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the CPU kernels cannot be built here (no g++)")
needs_bf16 = pytest.mark.skipif(KERNELS is None or not KERNELS.has_q8bf16,
                                reason="no AVX512-BF16 on this CPU (or BLINK_CPU_ISA narrows below it)")


def q8_blocks(n: int, k: int, seed: int) -> torch.Tensor:
    """uint8 [N, K / 32 * 34]: gguf's Q8_0 quantization of a random normal matrix."""
    rng = np.random.default_rng(seed)
    return torch.from_numpy(np.ascontiguousarray(quants.quantize(rng.standard_normal((n, k)).astype(np.float32),
                                                                 Q.Q8_0)))


def dequantized(blocks: torch.Tensor, k: int) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(blocks.numpy(), Q.Q8_0).reshape(blocks.shape[0], k).astype(np.float64))


def _close_to_float64(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 sums of exact products: within a few float32 ulps of the largest partial sums."""
    scale = float(want.abs().max())
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert float((got.double() - want).abs().max()) <= 1e-5 * scale


@needs_bf16
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 9, 16, 17, 33])
@pytest.mark.parametrize("n, k", [(48, 64), (16, 96), (160, 576)])
def test_g16_matmul_is_the_float_matmul_of_the_dequantized_matrix(rows, n, k):
    blocks = q8_blocks(n, k, seed=rows + n)
    w = dequantized(blocks, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    packed = KERNELS.q8bf16_pack(blocks, k)
    assert packed is not None and packed.numel() == n * k * 2 + (n * k // 32) * 4    # codes + a float per block
    got = KERNELS.q8bf16_matmul(packed, x, n)
    _close_to_float64(got, x.double() @ w.t())
    fx = KERNELS.quant_linear_fx(x, Q.Q8_0, blocks)            # the blocks, float activations (quant.cc)
    torch.testing.assert_close(got, fx, rtol=0, atol=2e-5 * float(fx.abs().max()))


@needs_bf16
def test_extreme_codes_and_scales_stay_exact():
    """Codes -128 and 127, subnormal and negative f16 scales, and large x: still the float64 product
    to float32 rounding (the codes are exact in bf16, the f16 scales in float32)."""
    n, k = 32, 64
    rng = np.random.default_rng(3)
    raw = np.zeros((n, k // 32, 34), np.uint8)
    scales = np.array([6e-8, -6e-8, 1e-5, -0.5, 2.0, 65504.0, -3.0e-3, 1.0], np.float16)
    raw[:, :, 0:2] = scales[rng.integers(0, len(scales), size=(n, k // 32))].view(np.uint8).reshape(n, k // 32, 2)
    codes = rng.integers(-128, 128, size=(n, k // 32, 32)).astype(np.int8)
    codes[0, 0, :] = -128
    codes[1, 0, :] = 127
    raw[:, :, 2:] = codes.view(np.uint8)
    blocks = torch.from_numpy(raw.reshape(n, -1))
    w = torch.from_numpy((codes.astype(np.float64) * raw[:, :, 0:2].copy().view(np.float16).astype(np.float64))
                         .reshape(n, k))
    x = (torch.randn(5, k, generator=torch.Generator().manual_seed(4)) * 100).bfloat16()
    got = KERNELS.q8bf16_matmul(KERNELS.q8bf16_pack(blocks, k), x, n)
    _close_to_float64(got, x.double() @ w.t())


@needs_bf16
def test_two_threads_give_the_bits_of_one():
    blocks = q8_blocks(160, 128, seed=9)
    packed = KERNELS.q8bf16_pack(blocks, 128)
    x = torch.randn(12, 128, generator=torch.Generator().manual_seed(9)).bfloat16()
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = KERNELS.q8bf16_matmul(packed, x, 160)
        torch.set_num_threads(2)
        two = KERNELS.q8bf16_matmul(packed, x, 160)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)       # threads split the groups; each output's order is fixed


def test_the_layout_exists_only_for_whole_groups_and_blocks():
    lib = ctypes.CDLL(str(cpu_kernels.build()))
    lib.blink_q8bf16_bytes.argtypes, lib.blink_q8bf16_bytes.restype = [ctypes.c_int64] * 2, ctypes.c_int64
    assert lib.blink_q8bf16_bytes(48, 64) == 48 * 64 * 2 + 48 * 2 * 4
    assert lib.blink_q8bf16_bytes(40, 64) == -1 and lib.blink_q8bf16_bytes(48, 48) == -1
    assert KERNELS.q8bf16_pack(q8_blocks(40, 64, seed=1), 64) is None      # N % 16
    if KERNELS.has_q8bf16:
        packed = KERNELS.q8bf16_pack(q8_blocks(48, 64, seed=1), 64)
        with pytest.raises(ValueError, match="bf16"):
            KERNELS.q8bf16_matmul(packed, torch.randn(2, 64), 48)                       # float32 x


def test_blink_cpu_isa_below_avx512bf16_turns_it_off(monkeypatch):
    """BLINK_CPU_ISA=avx512 (or narrower) means: no AVX512-BF16 path, so the head keeps its blocks."""
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx512")
    narrowed = cpu_kernels.CpuKernels(ctypes.CDLL(str(cpu_kernels.build())))
    assert not narrowed.has_q8bf16
    assert narrowed.q8bf16_pack(q8_blocks(48, 64, seed=1), 64) is None
