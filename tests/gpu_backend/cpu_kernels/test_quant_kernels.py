"""quant.cc's matmul over GGUF blocks (Q4_0, Q4_1, Q8_0, Q4_K) on int8 activations, on every
path this machine has (scalar, avx2, avx512), against references computed here from gguf's
own dequantization:
- exactly what it computes: the dequantized weights times the dequantized activations
  (d * codes), up to float32 summation order;
- what it approximates: the dequantized weights times the float activations, within the
  bound the activation quantization allows: each value moves by at most d/2 (d = the
  block's max |x| / 127), so an output by at most sum |w| * d/2 over its row."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from gpu_backend import cpu_kernels

KERNELS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the CPU kernels cannot be built here (no g++)")
ISAS = list(range(KERNELS.quant_isa_max + 1)) if KERNELS else []
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K]


def random_blocks(wtype: Q, n: int, k: int, seed: int) -> torch.Tensor:
    """uint8 [N, row bytes] of `wtype`: gguf's quantizer where it has one; Q4_K (which gguf's
    Python cannot quantize) as random codes and 6-bit scales under small f16 super-scales."""
    rng = np.random.default_rng(seed)
    if wtype != Q.Q4_K:
        return torch.from_numpy(np.ascontiguousarray(quants.quantize(rng.standard_normal((n, k)).astype(np.float32),
                                                                     wtype)))
    blocks = rng.integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)
    blocks[:, :, 0:2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)     # d
    blocks[:, :, 2:4] = np.frombuffer(np.float16(0.004).tobytes(), np.uint8)     # dmin
    return torch.from_numpy(blocks.reshape(n, -1))


def dequantized(wtype: Q, blocks: torch.Tensor, k: int) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(blocks.numpy(), wtype).reshape(blocks.shape[0], k).astype(np.float64))


def test_activation_codes_are_within_half_a_step_and_carry_their_sums():
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)) * torch.tensor([1e-3, 1.0, 30.0]).repeat(32)
    x[2, 32:64] = 0.0                                            # an all-zero block: d = 0, codes 0
    qs, d, s = KERNELS.quantize_activations(x)
    assert qs.dtype == torch.int8 and qs.shape == (5, 96) and d.shape == s.shape == (5, 3)
    step = d.repeat_interleave(32, dim=1)
    assert float(((x - step * qs.float()).abs() - step / 2).max()) <= 1e-6 * float(x.abs().max())
    assert int(qs.abs().max()) == 127 and int(qs[2, 32:64].abs().max()) == 0
    torch.testing.assert_close(s, d * qs.float().view(5, 3, 32).sum(-1))
    bf16_codes, _, _ = KERNELS.quantize_activations(x.bfloat16())
    assert (bf16_codes.int() - KERNELS.quantize_activations(x.bfloat16().float())[0].int()).abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_codes_are_exactly_the_float32_rounding_of_x_over_its_step(dtype):
    """Bit for bit what every path (scalar, the AVX2 block quantizer) must give: codes =
    round-half-even(x * float32(127 / amax)) within +-127, d = amax / 127, s = d * sum(codes),
    ties included (a block whose amax is 127 scales by exactly 1: 2.5 -> 2, -3.5 -> -4)."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 1536, generator=g) * torch.logspace(-3, 2, 7)[:, None]).to(dtype)
    x[0, :32] = torch.tensor([127.0] + [v + 0.5 for v in range(-15, 16)]).to(dtype)
    x[1, :32] = 0.0
    qs, d, s = KERNELS.quantize_activations(x)
    v = x.float().numpy().reshape(7, -1, 32)
    amax = np.abs(v).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    want = np.clip(np.rint((v * inv).astype(np.float32)), -127, 127).astype(np.int8).reshape(7, -1)
    assert np.array_equal(qs.numpy(), want)
    want_d = (amax[..., 0] / np.float32(127)).astype(np.float32)
    assert np.array_equal(d.numpy(), want_d)
    assert np.array_equal(s.numpy(), (want_d * want.reshape(7, -1, 32).sum(-1).astype(np.float32)).astype(np.float32))
    assert list(qs[0, 1:5]) == [-14, -14, -12, -12]                  # -14.5 -> -14, -13.5 -> -14, ...


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 3, 8, 37])
def test_quant_matmul_against_dequantized_references(wtype, m, isa):
    n, k = 70, 512                                     # 70 rows: full tiles and a tail on every path
    blocks = random_blocks(wtype, n, k, seed=m)
    w = dequantized(wtype, blocks, k)                                    # float64 [N, K]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7))
    got = KERNELS.quant_linear(x, int(wtype), blocks, bias=bias, isa=isa).double()
    qs, d, _ = KERNELS.quantize_activations(x)
    xq = qs.double() * d.double().repeat_interleave(32, dim=1)         # the activations it multiplies
    exact = xq @ w.T + bias.double()
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))
    float_ref = x.double() @ w.T + bias.double()
    bound = (w.abs() @ (d.double().repeat_interleave(32, dim=1) / 2).T).T     # [M, N]: sum |w| d/2
    assert bool(((got - float_ref).abs() <= bound + 1e-4 * float(float_ref.abs().max())).all())


@pytest.mark.parametrize("wtype", TYPES, ids=lambda t: t.name)
def test_the_paths_agree_and_bf16_in_and_out_round_once(wtype):
    n, k = 33, 256
    blocks = random_blocks(wtype, n, k, seed=3)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(4))
    outs = [KERNELS.quant_linear(x, int(wtype), blocks, isa=isa) for isa in ISAS]
    for other in outs[1:]:                    # integer sums are exact: only float summation order differs
        torch.testing.assert_close(other, outs[0], rtol=1e-5, atol=1e-4)
    xb = x.bfloat16()
    want = KERNELS.quant_linear(xb, int(wtype), blocks, out_dtype=torch.float32)
    got = KERNELS.quant_linear(xb, int(wtype), blocks)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 9, 17])     # Q8_0 on avx512: zmm tiles of 1-3 rows, from 4 rows of 8
def test_float_activation_matmul_is_the_float_matmul_of_the_dequantized_matrix(wtype, m, isa):
    """quant_linear_fx: no activation codes, so it equals x @ dequant(W)^T up to float32 summation
    order (the logits head's path: near-ties stay where the float model puts them)."""
    n, k = 70, 512
    blocks = random_blocks(wtype, n, k, seed=20 + m)
    w = dequantized(wtype, blocks, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(200 + m))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(8))
    got = KERNELS.quant_linear_fx(x, int(wtype), blocks, bias=bias, isa=isa)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    want = x.double() @ w.T + bias.double()
    err = (got.double() - want).abs()
    scale = (x.double().abs() @ w.abs().T) + bias.double().abs()          # the sum's own magnitude
    coding = 0.0
    if isa == 1 and wtype == Q.Q8_0:          # AVX2's Q8_0 path: x in int16 codes, half a step each at most
        coding = x16_steps(x).double() @ w.abs().T / 2
    assert bool((err <= 4 * k * 2.0 ** -24 * scale + coding + 1e-6).all())
    got_bf16 = KERNELS.quant_linear_fx(x.bfloat16(), int(wtype), blocks, out_dtype=torch.bfloat16, isa=isa)
    torch.testing.assert_close(got_bf16, KERNELS.quant_linear_fx(x.bfloat16().float(), int(wtype), blocks,
                                                                 isa=isa).bfloat16(), rtol=0, atol=0)


def x16_steps(x: torch.Tensor) -> torch.Tensor:
    """The step of each value's int16 code on AVX2's Q8_0 path: its 32-block's max |x| / 32767."""
    return (x.abs().view(x.shape[0], -1, 32).amax(-1) / 32767).repeat_interleave(32, dim=1)


def x16_coded(x: torch.Tensor) -> torch.Tensor:
    """x as AVX2's Q8_0 path codes it, in float64: round(x * (32767 / amax)) (float32, half to even)
    times amax / 32767, per 32-value block."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros(()))
    codes = torch.round(blocks * inv)                        # float32 multiply, then half to even
    return (codes.double() * (amax / 32767).double()).view_as(x)


@pytest.mark.skipif(KERNELS is None or KERNELS.quant_isa_max < 1, reason="no AVX2 path here")
@pytest.mark.parametrize("layout", ["rows", "split", "p8"])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 33])          # p8: tiles of 4 rows of x, then 1-3
def test_avx2_q8_0_float_activation_path_is_the_matmul_of_int16_coded_x(m, layout):
    """quant_linear_fx of Q8_0 on AVX2 (the logits head there): x coded per 32-value block in int16,
    vpmaddwd on the codes, so exactly dequant(W) times the coded x up to float32 summation order (the
    P8 groups sum a block's 32 products of a row as integers, converted once); an outlier channel's
    coarser step stays in its own block; a non-finite value makes its rows NaN."""
    n, k = (40 if layout == "p8" else 37), 576
    blocks = random_blocks(Q.Q8_0, n, k, seed=m)
    w = dequantized(Q.Q8_0, blocks, k)
    wtype = int(Q.Q8_0)
    if layout != "rows":
        wtype, blocks = KERNELS.repack(wtype, blocks, k, p8=layout == "p8")
        assert wtype == (cpu_kernels.P8 if layout == "p8" else cpu_kernels.SPLIT) | int(Q.Q8_0)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[:, 199] = 40.0                                         # an outlier channel, as SmolLM2's final hidden state has
    got = KERNELS.quant_linear_fx(x, wtype, blocks, isa=1).double()
    want = x16_coded(x) @ w.T
    scale = x.double().abs() @ w.abs().T
    assert bool(((got - want).abs() <= 4 * k * 2.0 ** -24 * scale + 1e-6).all())
    # The outlier's step stays in its block: weights only in a block of small values (1e-3), whose
    # products a coding scaled by the row's 40 would lose (its step 1.2e-3), come out near exact.
    raw = random_blocks(Q.Q8_0, n, k, seed=m).view(n, k // 32, 34).clone()
    raw[:, [b for b in range(k // 32) if b != 1], 2:] = 0
    raw = raw.view(n, -1)
    w1 = dequantized(Q.Q8_0, raw, k)
    x1 = x.clone()
    x1[:, 32:64] *= 1e-3
    exact = x1.double() @ w1.T
    bound = x16_steps(x1).double() @ w1.abs().T / 2 + 4 * k * 2.0 ** -24 * (x1.double().abs() @ w1.abs().T)
    assert bool(((KERNELS.quant_linear_fx(x1, int(Q.Q8_0), raw, isa=1).double() - exact).abs() <= bound + 1e-12).all())
    assert float(bound.max()) < 1e-3 * float(exact.abs().max())
    bad = x.clone()
    bad[0, 5] = float("nan")
    if m > 1:
        bad[1, 300] = float("inf")
    out = KERNELS.quant_linear_fx(bad, wtype, blocks, isa=1)
    assert bool(out[: min(m, 2)].isnan().all()) and bool(out[2:].isfinite().all())


@pytest.mark.parametrize("k", [64, 576])
def test_p8_groups_hold_the_rows_bytes_and_the_scalar_path_gives_the_rows_sums(k):
    """repack(p8=True) of Q8_0 (the AVX2 logits head's layout): the same bytes in groups of 8 rows,
    dequantized bit for bit as the GGUF rows; the scalar path's float-activation sums the rows' (same
    products, same order: the -march=native build gives the same bits, the x86-64-v3 build of
    test_avx2_build differs in the last bit, the compiler contracting one loop otherwise); AVX2 within
    float32 summation order of the rows' int16-code path;
    a row count that is not whole groups stays SPLIT, and P8 blocks are refused where int8 codes are asked."""
    n = 24
    blocks = random_blocks(Q.Q8_0, n, k, seed=k + 1)
    wtype, packed = KERNELS.repack(int(Q.Q8_0), blocks, k, p8=True)
    assert wtype == cpu_kernels.P8 | int(Q.Q8_0) and packed.shape == blocks.shape
    assert torch.equal(KERNELS.dequantize(wtype, packed, k), KERNELS.dequantize(int(Q.Q8_0), blocks, k))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(k))
    scale = x.double().abs() @ dequantized(Q.Q8_0, blocks, k).abs().T       # the sums' own magnitude
    diff = (KERNELS.quant_linear_fx(x, wtype, packed, isa=0) - KERNELS.quant_linear_fx(x, int(Q.Q8_0), blocks, isa=0))
    assert bool((diff.double().abs() <= 2 * k * 2.0 ** -24 * scale).all())
    if KERNELS.quant_isa_max >= 1:
        torch.testing.assert_close(KERNELS.quant_linear_fx(x, wtype, packed, isa=1),
                                   KERNELS.quant_linear_fx(x, int(Q.Q8_0), blocks, isa=1), rtol=1e-5, atol=1e-5)
    assert KERNELS.repack(int(Q.Q8_0), blocks[:12], k, p8=True)[0] == cpu_kernels.SPLIT | int(Q.Q8_0)
    with pytest.raises(ValueError):
        KERNELS.quant_linear(x, wtype, packed)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("k", [256, 576])               # 576: 18 blocks, a tail after 16 on the 8-wide scales
def test_split_rows_compute_exactly_what_the_gguf_rows_do(wtype, k, isa):
    """repack (f16 scales first, then codes): the same bytes, and every kernel gives bit-identical
    results on them: the same values in the same order, only read from other offsets."""
    n = 37
    blocks = random_blocks(wtype, n, k, seed=k)
    split, packed = KERNELS.repack(int(wtype), blocks, k)
    assert split == cpu_kernels.SPLIT | int(wtype) and packed.shape == blocks.shape
    assert sorted(packed.flatten().tolist()) == sorted(blocks.flatten().tolist())
    assert torch.equal(KERNELS.dequantize(split, packed, k), KERNELS.dequantize(int(wtype), blocks, k))
    for m in (1, 3, 6):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        assert torch.equal(KERNELS.quant_linear(x, split, packed, isa=isa),
                           KERNELS.quant_linear(x, int(wtype), blocks, isa=isa))
        assert torch.equal(KERNELS.quant_linear_fx(x, split, packed, isa=isa),
                           KERNELS.quant_linear_fx(x, int(wtype), blocks, isa=isa))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wtype", [Q.Q4_0, Q.Q4_1], ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 40])
@pytest.mark.parametrize("group", [8, 16], ids=["x8", "x16"])
def test_x8_rows_compute_the_same_products(wtype, m, isa, group):
    """X8 / X16 (8 / 16 rows interleaved a block at a time): the same integer sums as the GGUF rows, so
    the results agree to float summation order, and the dequantized matrix is the same exactly, on
    every path (X16 below avx512: the scalar loop)."""
    n, k = 48, 576
    blocks = random_blocks(wtype, n, k, seed=m + 50)
    layout, packed = KERNELS.repack(int(wtype), blocks, k, x16=group == 16)
    assert layout == (cpu_kernels.X16 if group == 16 else cpu_kernels.X8) | int(wtype)
    assert packed.shape == blocks.shape
    assert torch.equal(KERNELS.dequantize(layout, packed, k), KERNELS.dequantize(int(wtype), blocks, k))
    part = slice(group, 3 * group)                               # whole groups from the second on
    assert torch.equal(KERNELS.dequantize(layout, packed[part], k), KERNELS.dequantize(int(wtype), blocks[part], k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(9))
    want = KERNELS.quant_linear(x, int(wtype), blocks, bias=bias, isa=0).double()
    got = KERNELS.quant_linear(x, layout, packed, bias=bias, isa=isa).double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    bf16 = KERNELS.quant_linear(x, layout, packed, bias=bias, isa=isa, out_dtype=torch.bfloat16)
    assert torch.equal(bf16, got.float().bfloat16())
    odd, _ = KERNELS.repack(int(wtype), blocks[:12], k, x16=group == 16)      # 12 rows: no whole groups
    assert odd == cpu_kernels.SPLIT | int(wtype)
    eights, _ = KERNELS.repack(int(wtype), blocks[:24], k, x16=group == 16)  # 24 rows: groups of 8 only
    assert eights == cpu_kernels.X8 | int(wtype)


@pytest.mark.skipif(KERNELS is None or KERNELS.quant_isa_max < 2, reason="no AVX512-VNNI path on this CPU")
@pytest.mark.parametrize("wtype", [Q.Q4_0, Q.Q4_1], ids=lambda t: t.name)
@pytest.mark.parametrize("group", [8, 16], ids=["x8", "x16"])
def test_x8_vnni_gives_the_avx2_paths_bits(wtype, group):
    """The VNNI tiles (vpdpbusd: X8 on ymm, X16 on zmm, 8 rows of x) sum the same integers as AVX2's
    maddubs tiles over X8 (4 rows of x) and scale them in the same order: equal outputs at every row
    count, remainders included."""
    n, k = 64, 576
    blocks = random_blocks(wtype, n, k, seed=7)
    x8, packed8 = KERNELS.repack(int(wtype), blocks, k, x16=False)
    layout, packed = KERNELS.repack(int(wtype), blocks, k, x16=group == 16)
    for m in (1, 3, 4, 7, 8, 9, 15, 16, 28, 29, 32, 40):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        for out_dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(KERNELS.quant_linear(x, layout, packed, isa=2, out_dtype=out_dtype),
                               KERNELS.quant_linear(x, x8, packed8, isa=1, out_dtype=out_dtype)), (m, out_dtype)


def test_q4_k_has_no_split_layout_and_stays_as_it_is():
    blocks = random_blocks(Q.Q4_K, 3, 256, seed=1)
    wtype, same = KERNELS.repack(int(Q.Q4_K), blocks, 256)
    assert wtype == int(Q.Q4_K) and same is blocks
    with pytest.raises(ValueError, match="repack"):
        KERNELS.repack(cpu_kernels.SPLIT | int(Q.Q4_1), random_blocks(Q.Q4_1, 2, 64, seed=0), 64)


def test_float_activation_matmul_refuses_what_it_cannot_take():
    blocks = random_blocks(Q.Q8_0, 4, 64, seed=0)
    with pytest.raises(ValueError, match="row bytes"):
        KERNELS.quant_linear_fx(torch.randn(1, 96), int(Q.Q8_0), blocks)
    with pytest.raises(ValueError, match="bias"):
        KERNELS.quant_linear_fx(torch.randn(1, 64), int(Q.Q8_0), blocks, bias=torch.randn(3))


@pytest.mark.parametrize("wtype", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf(wtype):
    blocks = random_blocks(wtype, 9, 512, seed=5)
    torch.testing.assert_close(KERNELS.dequantize(int(wtype), blocks, 512).double(), dequantized(wtype, blocks, 512),
                               rtol=0, atol=0)


def test_shapes_and_types_it_cannot_take_are_refused():
    blocks = random_blocks(Q.Q4_1, 4, 64, seed=0)
    with pytest.raises(ValueError, match="Q6_K|14"):
        KERNELS.quant_linear(torch.randn(1, 64), int(Q.Q6_K), blocks)
    with pytest.raises(ValueError, match="row bytes"):
        KERNELS.quant_linear(torch.randn(1, 96), int(Q.Q4_1), blocks)
    assert KERNELS.quant_row_bytes(int(Q.Q4_K), 288) == -1         # Q4_K rows come in 256s


def test_isa_switch_narrows_and_never_widens(monkeypatch, caplog):
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "scalar")
    assert cpu_kernels.requested_isa(2) == 0
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "AVX2")
    assert cpu_kernels.requested_isa(2) == 1 and cpu_kernels.requested_isa(0) == 0
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx512")
    assert cpu_kernels.requested_isa(1) == 1 and "at most avx2" in caplog.text
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "sse9")
    assert cpu_kernels.requested_isa(1) == 1 and "not one of" in caplog.text
    monkeypatch.delenv(cpu_kernels.ISA_ENV)
    assert cpu_kernels.requested_isa(2) == 2


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_the_avx512_vnni_path_compiles():
    """The path this machine may lack still builds (for CPUs that have it)."""
    src = cpu_kernels.SOURCE.with_name("quant.cc")
    r = subprocess.run(["g++", "-std=c++17", "-O1", "-march=icelake-server", "-fopenmp", "-Wall", "-Wextra", "-Werror",
                        "-fsyntax-only", str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
