"""The CPU executor's model setup: fused projections and prepacked bf16 matmuls
compute what the plain model computes, on every Llama variant the loader knows."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gpu_backend import cpu_kernels
from gpu_backend.executors.cpu_linear import (FLOAT32_LOGITS_MAX_ROWS, SMALL_BATCH_ROWS, PackedLinear, pack_linears,
                                              packing_available, prepare_model)
from gpu_backend.model.attention import DenseCausalAttention
from gpu_backend.model.config import tiny_config
from gpu_backend.model.llama import LlamaModel
from gpu_backend.model.reference import greedy_generate

VARIANTS = {
    "gqa-untied": dict(),
    "mha-tied": dict(num_kv_heads=4, tie_word_embeddings=True),
    "qwen2-bias": dict(arch="qwen2", attention_bias=True),
    "qwen3-qknorm": dict(arch="qwen3", qk_norm=True, head_dim=32),
}

needs_packing = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN bf16 linear")


def logits_of(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    attn = DenseCausalAttention(model.config)
    return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), attn))   # [T, V]


@pytest.mark.parametrize("variant", VARIANTS)
@torch.inference_mode()
def test_fused_projections_compute_the_same_logits(variant):
    model = LlamaModel.random(tiny_config(**VARIANTS[variant]), seed=5)
    ids = torch.randint(0, model.config.vocab_size, (19,), generator=torch.Generator().manual_seed(2)).tolist()
    want = logits_of(model, ids)
    fused = copy.deepcopy(model).fuse_projections()
    assert fused.layers[0].self_attn.qkv_proj is not None and not hasattr(fused.layers[0].self_attn, "q_proj")
    assert fused.layers[0].mlp.gate_up_proj is not None and not hasattr(fused.layers[0].mlp, "up_proj")
    torch.testing.assert_close(logits_of(fused, ids), want, rtol=1e-5, atol=1e-5)
    fused.fuse_projections()                                  # idempotent
    torch.testing.assert_close(logits_of(fused, ids), want, rtol=1e-5, atol=1e-5)


@needs_packing
@pytest.mark.parametrize("shape", [(24, 16), (1536, 576), (7, 3)])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_packed_linear_equals_linear_in_bf16(shape, rows):
    gen = torch.Generator().manual_seed(rows)
    lin = nn.Linear(shape[1], shape[0], bias=True).to(torch.bfloat16)
    x = torch.randn(rows, shape[1], generator=gen).to(torch.bfloat16)
    packed = PackedLinear(lin.weight, lin.bias)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x).float(), lin(x).float(), rtol=1e-2, atol=1e-2)
        assert packed(x.view(1, rows, -1)).shape == (1, rows, shape[0])   # leading dims kept


KERNELS = cpu_kernels.load()
needs_small = pytest.mark.skipif(KERNELS is None or not KERNELS.has_bf16_linear or not packing_available(),
                                 reason="the small-batch matmul needs the CPU kernels on AVX512-BF16")


@needs_small
@pytest.mark.parametrize("rows", [1, 2, 8, 9, 64])
def test_packed_linear_sends_decode_batches_to_the_small_batch_kernel(rows, monkeypatch):
    gen = torch.Generator().manual_seed(rows)
    lin = nn.Linear(576, 960, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    packed = PackedLinear(lin.weight, lin.bias, KERNELS)
    calls = []
    real = KERNELS.linear
    monkeypatch.setattr(KERNELS, "linear", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        torch.testing.assert_close(packed(x).float(), lin(x).float(), rtol=1e-2, atol=1e-2)
    assert bool(calls) == (rows in SMALL_BATCH_ROWS)             # 1 row and > 8 rows: oneDNN
    assert PackedLinear(lin.weight, lin.bias).weight is None     # no kernels: no second copy of the weight


@needs_small
@pytest.mark.parametrize("rows", [1, 8, 32, 33])
def test_the_logits_head_keeps_float32_sums_up_to_its_row_limit(rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(2048, 576, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    head = PackedLinear(w, None, KERNELS, float32_out=True)
    with torch.inference_mode():
        got = head(x)
    want = x.float() @ w.float().t()
    if rows <= FLOAT32_LOGITS_MAX_ROWS:
        assert got.dtype == torch.float32 and (got - want).abs().max() < 1e-2
    else:                                                         # oneDNN's bf16 GEMM past the limit
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=0.2)


@needs_packing
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kernels", [False, True])
@torch.inference_mode()
def test_prepared_bf16_model_generates_what_the_plain_one_does(variant, kernels):
    model = LlamaModel.random(tiny_config(**VARIANTS[variant]), seed=7).to(torch.bfloat16)
    prompt = list(range(3, 20))
    want = greedy_generate(model, prompt, 12)
    prepared = prepare_model(copy.deepcopy(model), KERNELS if kernels else None)
    packed = [m for m in prepared.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 4 * model.config.num_layers + 1          # qkv, o, gate_up, down a layer + head
    assert prepared.logits_head is not None
    assert [m for m in prepared.modules() if type(m) is nn.Linear] == (
        [] if prepared.lm_head is None else [prepared.lm_head])    # the untied head is read via logits_head
    assert greedy_generate(prepared, prompt, 12) == want


def test_float32_models_are_fused_but_not_packed():
    model = prepare_model(LlamaModel.random(tiny_config(), seed=1))
    assert pack_linears(model) == 0
    assert model.logits_head is None
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
