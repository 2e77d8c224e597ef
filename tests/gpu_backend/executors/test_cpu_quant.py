"""The CPU executor on quantized weights (cpu_linear.QuantKernelLinear over GGUF blocks):
prepare_model fuses and serves them (or dequantizes them without the kernels), the kernel
layer and the PyTorch layer compute the same thing on them, and on the real SmolLM2 Q4_1
the served model picks the greedy tokens of the dequantized float32 model (near-ties
aside) at a perplexity within 1% of it."""
from __future__ import annotations

import copy
import logging
import math
import pathlib
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from torch import nn

from gpu_backend import cpu_kernels
from gpu_backend.executors import cpu_linear
from gpu_backend.executors.cpu_forward import KernelForward
from gpu_backend.executors.cpu_linear import QuantKernelLinear, prepare_model
from gpu_backend.model.config import tiny_config
from gpu_backend.model.llama import LlamaModel
from gpu_backend.model.quantized import QuantLinear, QuantWeight, dequantize_all

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_cpu_forward import greedy_batch, run_both  # noqa: E402

KERNELS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the CPU kernels cannot be built here (no g++)")


def quantize_model(model: LlamaModel, types: dict[str, Q], default: Q) -> LlamaModel:
    """Every projection (and a tied head, as logits_head) as GGUF blocks of its type:
    types maps a name part ("k_proj") to a type, the rest get `default`."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                wtype = types.get(name, default)
                blocks = quants.quantize(child.weight.detach().float().numpy(), wtype)
                quant = QuantLinear([QuantWeight(int(wtype), torch.from_numpy(np.ascontiguousarray(blocks)),
                                                 child.in_features)], child.bias)
                setattr(parent, name, quant)
    if model.lm_head is None:
        w = model.embed_tokens.weight.detach().float().numpy()
        model.logits_head = QuantLinear([QuantWeight(int(Q.Q8_0), torch.from_numpy(quants.quantize(w, Q.Q8_0)),
                                                     w.shape[1])])
    return model


def tiny(variant: dict, seed: int = 3) -> LlamaModel:
    return LlamaModel.random(tiny_config(hidden_size=64, intermediate_size=128, **variant), seed=seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", [dict(tie_word_embeddings=True), dict(arch="qwen2", attention_bias=True)],
                         ids=["tied", "qwen2-bias"])
def test_kernel_layer_equals_the_pytorch_layer_on_quantized_weights(variant, dtype):
    model = prepare_model(quantize_model(tiny(variant), {}, Q.Q4_1).to(dtype), KERNELS)
    attn = model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, QuantKernelLinear) and isinstance(model.layers[0].mlp.down_proj,
                                                                       QuantKernelLinear)
    assert KernelForward.applicable(model, KERNELS)
    if model.lm_head is None:     # a tied head: float activations against its blocks or the float table
        assert isinstance(model.logits_head, cpu_linear.FloatActHead)
    tol = 1e-4 if dtype == torch.float32 else 0.05     # bf16: PyTorch rounds attention to bf16, the kernel not
    for want, got in run_both(model):         # both layers multiply by the same blocks and codes
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def int16_coding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far AVX2's Q8_0 head (quant.cc's matmul_q8_x16) may move x @ w^T by coding x in int16: half
    a step a value, a step being its 32-value block's max |x| / 32767."""
    steps = (x.float().abs().view(x.shape[0], -1, 32).amax(-1) / 32767).repeat_interleave(32, dim=1)
    return steps.double() @ w.double().abs().T / 2


@pytest.mark.parametrize("rows", [1, 3, cpu_linear.FX_HEAD_MAX_ROWS, cpu_linear.FX_HEAD_MAX_ROWS + 1])
def test_a_tied_head_gives_the_float_logits_of_its_embedding_table(rows):
    """FloatActHead: up to FX_HEAD_MAX_ROWS rows on the blocks, above on the float table; both are
    the float32 product with the dequantized table (no int8 activation codes), so the logits match
    F.linear over the embedding weight to float32 rounding; on the AVX2 path (quant.cc's
    matmul_q8_x16) to within x's int16 codes too: half a step (its block's max |x| / 32767) a value."""
    model = quantize_model(tiny(dict(tie_word_embeddings=True)), {}, Q.Q8_0)
    with torch.no_grad():                  # as the loader has it: the table is the blocks, dequantized
        model.embed_tokens.weight.copy_(model.logits_head.dequantize())
    model = prepare_model(model, KERNELS)
    head = model.logits_head
    assert isinstance(head, cpu_linear.FloatActHead)
    x = torch.randn(rows, head.in_features, generator=torch.Generator().manual_seed(rows))
    want = torch.nn.functional.linear(x.double(), model.embed_tokens.weight.double())
    got = model.compute_logits(x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    coding = 0.0
    if KERNELS.quant_isa == 1 and rows <= cpu_linear.FX_HEAD_MAX_ROWS:
        coding = int16_coding_bound(x, model.embed_tokens.weight)
    assert bool(((got.double() - want).abs() <= coding + 1e-5 * want.abs() + 1e-5).all())


@pytest.mark.parametrize("rows", [1, 3, cpu_linear.G16_HEAD_MIN_ROWS, 9, cpu_linear.FX_HEAD_MAX_ROWS + 1])
def test_a_bf16_models_tied_head_keeps_float32_logits_of_the_blocks(rows):
    """A bf16 model's FloatActHead: 1-3 rows on the blocks, from G16_HEAD_MIN_ROWS on (AVX512-BF16)
    the G16 copy, and past FX_HEAD_MAX_ROWS too (not the bf16 table): always the float32 product of
    the bf16 activations with the dequantized blocks, not of the table rounded to bf16 (on AVX2 up to
    the activations' int16 codes)."""
    model = quantize_model(tiny(dict(tie_word_embeddings=True, vocab_size=96)), {}, Q.Q8_0)
    w = model.logits_head.dequantize().double()
    model = prepare_model(model.to(torch.bfloat16), KERNELS)
    head = model.logits_head
    assert isinstance(head, cpu_linear.FloatActHead)
    assert (head.g16 is not None) == KERNELS.has_q8bf16
    x = torch.randn(rows, head.in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = model.compute_logits(x)
    assert got.dtype == torch.float32
    if rows > cpu_linear.FX_HEAD_MAX_ROWS and head.g16 is None:
        return                              # the bf16 table through oneDNN: bf16 logits (as before)
    want = x.double() @ w.t()
    coding = 0.0
    if KERNELS.quant_isa == 1:              # AVX2 (no G16 copy there): x in int16 codes, as above
        coding = int16_coding_bound(x, w)
    assert bool(((got.double() - want).abs() <= coding + 1e-5 * want.abs() + 1e-5).all())


def test_mixed_types_in_one_fused_projection_each_fill_their_columns():
    model = quantize_model(tiny({}), {"k_proj": Q.Q8_0, "up_proj": Q.Q4_0}, Q.Q4_1)
    reference = copy.deepcopy(model)
    dequantize_all(reference)
    served = prepare_model(model, KERNELS)
    qkv = served.layers[0].self_attn.qkv_proj
    assert [s.type_name for s in qkv.segments] == ["Q4_1", "Q8_0", "Q4_1"]
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    ref = reference.layers[0].self_attn
    want = torch.cat([ref.q_proj(x), ref.k_proj(x), ref.v_proj(x)], dim=-1)
    torch.testing.assert_close(qkv(x), want, rtol=0.05, atol=0.05 * float(want.abs().max()))


def test_large_batches_take_the_dequantized_gemm_and_agree(monkeypatch):
    model = prepare_model(quantize_model(tiny({}), {}, Q.Q4_0), KERNELS)
    layer = model.layers[0].mlp.gate_up_proj
    assert layer._x8 and layer.max_rows() == cpu_linear.QUANT_X8_MAX_ROWS      # Q4_0, whole groups of 8 rows
    monkeypatch.setattr(cpu_linear, "QUANT_X8_MAX_ROWS", cpu_linear.QUANT_MAX_ROWS)
    x = torch.randn(cpu_linear.QUANT_MAX_ROWS + 5, 64, generator=torch.Generator().manual_seed(2))
    gemm = layer(x)                                             # float activations x dequantized blocks
    monkeypatch.setattr(cpu_linear, "QUANT_X8_MAX_ROWS", 10**6)
    torch.testing.assert_close(layer(x), gemm, rtol=0.05, atol=0.05 * float(gemm.abs().max()))


def _bf16_quantized(variant: dict) -> LlamaModel:
    return quantize_model(tiny(variant).to(torch.bfloat16), {}, Q.Q4_1)


@pytest.mark.parametrize("variant", [{}, dict(arch="qwen2", attention_bias=True)], ids=["llama", "qwen2-bias"])
def test_bf16_prompts_multiply_the_bf16_dequantized_weight(variant):
    """A bf16 model's prompts (rows above max_rows): the weight dequantized and rounded to bf16,
    float32 sums; the packed copy and the per-call bf16 slices give the same values."""
    packs = cpu_linear.packing_available()             # oneDNN's bf16 matmuls (not on every AVX2 build)
    slices = prepare_model(_bf16_quantized(variant), KERNELS)
    assert not cpu_linear.prefill_copies(slices, budget_bytes=0)
    models = [slices]
    if packs:
        copies = prepare_model(_bf16_quantized(variant), KERNELS)
        assert cpu_linear.prefill_copies(copies, budget_bytes=float("inf"))
        models.append(copies)
    x = torch.randn(cpu_linear.QUANT_X8_MAX_ROWS + 7, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    for name in ("qkv_proj", "o_proj"):
        layers = [getattr(m.layers[0].self_attn, name) for m in models]
        assert layers[0]._prefill is None and layers[0].bf16_prefill
        assert all(layer._prefill is not None for layer in layers[1:])
        a = layers[0]
        w = torch.cat([KERNELS.dequantize(t, blk, a.in_features) for t, blk in a._blocks]).bfloat16().double()
        want = x.double() @ w.t() + (0 if a.bias is None else a.bias.double())
        for layer in layers:
            got = layer(x)
            assert got.dtype == torch.bfloat16
            # float32 sums of exact products, one rounding to bf16 (and the bias's, on the copy)
            torch.testing.assert_close(got.double(), want, rtol=2 ** -7, atol=1e-2 * float(want.abs().max()))
            # decode-sized batches stay on the blocks (int8 codes): not the bf16 weights
            assert layer(x[:3]).dtype == torch.bfloat16 and layer.max_rows() >= 3


def test_a_bf16_model_keeps_prefill_copies_where_the_cpu_has_bf16_math():
    model = prepare_model(_bf16_quantized({}), KERNELS)
    layer = model.layers[0].mlp.down_proj
    native = KERNELS.has_bf16_linear and cpu_linear.packing_available()
    assert (layer._prefill is not None) == native and layer.bf16_prefill == native
    f32 = prepare_model(quantize_model(tiny({}), {}, Q.Q4_1), KERNELS)      # float32 models: float32 slices
    assert f32.layers[0].mlp.down_proj._prefill is None and not f32.layers[0].mlp.down_proj.bf16_prefill


def test_the_copies_budget_takes_a_containers_memory_limit(tmp_path):
    physical = cpu_linear._physical_memory(limits=())
    limit, unlimited = tmp_path / "memory.max", tmp_path / "v2-none"
    limit.write_text(f"{physical // 4}\n")
    unlimited.write_text("max\n")
    assert cpu_linear._physical_memory(limits=(str(limit),)) == physical // 4
    assert cpu_linear._physical_memory(limits=(str(unlimited), str(tmp_path / "absent"))) == physical
    assert 0 < cpu_linear._physical_memory() <= physical


def test_without_kernels_quantized_weights_are_dequantized_once(caplog):
    model = quantize_model(tiny(dict(tie_word_embeddings=True)), {}, Q.Q8_0)
    want = QuantLinear.dequantize(model.layers[1].mlp.down_proj)
    with caplog.at_level(logging.WARNING, logger="blink.gpu_daemon"):
        plain = prepare_model(model, None)
    assert "dequantized" in caplog.text
    assert not any(isinstance(m, (QuantLinear, QuantKernelLinear)) for m in plain.modules())
    assert plain.logits_head is None or not isinstance(plain.logits_head, QuantLinear)
    assert torch.equal(plain.layers[1].mlp.down_proj.weight, want)


# A fixed English text of a few hundred tokens for the perplexity comparison.
TEXT = (
    "The river begins in the hills above the town, where snow lies late into spring. In April the "
    "water rises quickly, and the old stone bridge at the mill is sometimes closed for a day or two "
    "while the current carries branches and mud past the arches. Farmers along the valley have "
    "learned to move their animals to higher fields before the flood, and the school keeps a record "
    "of every year the water reached the steps of the church. Most summers are dry. The river then "
    "becomes a chain of quiet pools, and children spend the long afternoons catching small fish with "
    "their hands, or building dams of gravel that the next storm will wash away. In the autumn the "
    "leaves turn yellow and red, the mill wheel turns again, and the market fills with apples, pears "
    "and walnuts from the orchards on the southern slope. Visitors often ask why the town was built "
    "so close to the water, when it floods so often. The answer is simple: the river was the only "
    "road. Before the railway came, timber, wool and grain travelled downstream on flat boats, and "
    "the mill ground flour for every village within a day's walk. The railway arrived in the last "
    "years of the century, and with it came a station, a hotel and a newspaper that still prints a "
    "weekly page of local history. Today the mill is a museum, the boats are gone, and the bridge "
    "carries more bicycles than carts, but the people still watch the water every spring."
)


@pytest.mark.slow
def test_smollm2_q4_1_agrees_with_its_float32_dequantization():
    from tokenizers import Tokenizer

    from gpu_backend.executors.cpu import CpuRunner
    from gpu_backend.kv_pool import KVCacheConfig, KVPool
    from gpu_backend.model.attention import DenseCausalAttention
    from gpu_backend.model.loader import load_model, prepare_default_model
    tok = Tokenizer.from_file(str(prepare_default_model() / "tokenizer.json"))
    served = prepare_model(load_model("default", quantized=True).model, KERNELS)
    assert isinstance(served.layers[0].self_attn.qkv_proj, QuantKernelLinear)
    assert served.layers[0].self_attn.qkv_proj.segments[0].type_name == "Q4_1"
    # tied: the Q8_0 blocks against float activations (the float32 matmul of the embedding table)
    assert isinstance(served.logits_head, cpu_linear.FloatActHead)
    reference = prepare_model(load_model("default", dtype=torch.float32).model, KERNELS)   # the same values, float
    cfg = served.config

    def runner(model, kv_dtype=None):
        return CpuRunner(model, KVPool(KVCacheConfig(64, 16, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim),
                                       dtype=kv_dtype or model.dtype), KERNELS)

    chats = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea."]
    prompts = [tok.encode(f"<|im_start|>user\n{c}<|im_end|>\n<|im_start|>assistant\n").ids for c in chats]
    want = greedy_batch(runner(reference), prompts, 24)
    # Teacher-forced on the float32 tokens: the quantized model's pick, step by step; where it
    # differs, the float32 model's own top two logits were a near-tie.
    forced = greedy_batch(runner(served), prompts, 24, forced=want)
    picks, ref = [t for s in forced for t in s], [t for s in want for t in s]
    assert sum(a == b for a, b in zip(picks, ref)) >= 0.9 * len(ref)
    assert "Paris" in tok.decode(greedy_batch(runner(served), prompts[:1], 12)[0])
    # float32 activations over a bf16 KV pool: how a CPU without bf16 math serves it (--kv-cache-dtype auto)
    forced = greedy_batch(runner(served, torch.bfloat16), prompts, 24, forced=want)
    assert sum(a == b for a, b in zip([t for s in forced for t in s], ref)) >= 0.9 * len(ref)
    assert "Paris" in tok.decode(greedy_batch(runner(served, torch.bfloat16), prompts[:1], 12)[0])

    # bf16 activations, as the executor serves it where the CPU has bf16 math: prompts on the packed
    # bf16 copies (there), decode rows on the blocks
    # (--dtype auto picks bf16 only there)
    if KERNELS.has_bf16_linear:
        bf16 = prepare_model(load_model("default", quantized=True, dtype=torch.bfloat16).model, KERNELS)
        assert bf16.layers[0].mlp.down_proj.bf16_prefill == cpu_linear.packing_available()
        forced = greedy_batch(runner(bf16), prompts, 24, forced=want)
        assert sum(a == b for a, b in zip([t for s in forced for t in s], ref)) >= 0.9 * len(ref)
        assert "Paris" in tok.decode(greedy_batch(runner(bf16), prompts[:1], 12)[0])

    ids = tok.encode(TEXT).ids
    assert 250 <= len(ids) <= 400

    def logits_of(model) -> torch.Tensor:              # [T - 1, vocab]: each position's next-token logits
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention(cfg))
            return model.compute_logits(hidden[:-1])

    def perplexity(logits: torch.Tensor) -> float:
        return math.exp(float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))))

    # The whole text in one forward, every matmul on the blocks (not the dequantized GEMM).
    rows, cpu_linear.QUANT_X8_MAX_ROWS = cpu_linear.QUANT_X8_MAX_ROWS, 10**6
    try:
        got = logits_of(served)
    finally:
        cpu_linear.QUANT_X8_MAX_ROWS = rows
    want = logits_of(reference)
    assert abs(perplexity(got) / perplexity(want) - 1) <= 0.01, (perplexity(got), perplexity(want))
    # The near-tie rule at every position: a different argmax only where the float32 model's margin
    # over the quantized pick is within twice the two paths' largest logit difference there.
    pick_got, pick_want = got.argmax(-1), want.argmax(-1)
    margin = want.max(-1).values - want.gather(-1, pick_got[:, None])[:, 0]
    noise = (got - want).abs().max(-1).values
    assert bool((margin <= 2 * noise).all())
    assert float((pick_got == pick_want).float().mean()) >= 0.9
