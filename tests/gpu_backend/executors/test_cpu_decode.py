"""FusedDecode (forward.cc: a quantized model's decoder stack for a step of decode rows in one
call) computes exactly what KernelForward's per-call loop computes: the same hidden states and
the same KV pool bytes, on every block type and layout quant.cc serves, with biases, in float32
and bfloat16, on every ISA path of this machine, with one thread and with several, and past the
prompts' 32-row limit on the blocks; steps it does not take (prefill rows, unquantized models)
keep the loop."""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_backend import cpu_kernels
from gpu_backend.executors import cpu_linear
from gpu_backend.executors.cpu_decode import MAX_DECODE_ROWS, FusedDecode
from gpu_backend.executors.cpu_forward import KernelForward
from gpu_backend.executors.cpu_linear import prepare_model
from gpu_backend.kv_pool import KVCacheConfig, KVPool
from gpu_backend.paged_attention import PagedBatch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_cpu_quant import quantize_model, tiny  # noqa: E402

KERNELS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the CPU kernels cannot be built here (no g++)")

BLOCK = 16
NUM_BLOCKS = 128         # 3 a row, up to 33 rows, tables disjoint (each row writes its own slot)
TYPES = {      # name -> (per-projection types, default type): every layout quant.cc serves
    "q4_1-x8": ({}, Q.Q4_1),
    "q4_0-x8": ({}, Q.Q4_0),
    "q8_0-split": ({}, Q.Q8_0),
    "mixed-segments": ({"k_proj": Q.Q8_0, "up_proj": Q.Q4_0}, Q.Q4_1),
}
ISAS = [i for i in range(len(cpu_kernels.ISA_NAMES)) if KERNELS is not None and i <= KERNELS.quant_isa_max]


def served(types: str, dtype: torch.dtype, variant: dict | None = None, isa: int | None = None):
    per_name, default = TYPES[types]
    model = prepare_model(quantize_model(tiny(variant or {}), per_name, default).to(dtype), KERNELS)
    if isa is not None:
        for m in model.modules():
            if isinstance(m, cpu_linear.QuantKernelLinear):
                m.isa = isa
    return model


def pool_for(model, seed: int = 0, kv_dtype: torch.dtype | None = None) -> KVPool:
    cfg = model.config
    pool = KVPool(KVCacheConfig(NUM_BLOCKS, BLOCK, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim),
                  dtype=kv_dtype or model.dtype)
    g = torch.Generator().manual_seed(seed)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))      # a cached context to attend to
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    return pool


def decode_step(model, rows: int, seed: int = 0):
    """`rows` decode rows at different context lengths over disjoint, out-of-order block tables."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    seqs = [(5 + 9 * i % 40, 1, perm[3 * i:3 * i + 3]) for i in range(rows)]
    ids = torch.randint(0, model.config.vocab_size, (rows,), generator=g)
    return ids, torch.tensor([s[0] for s in seqs]), PagedBatch.build(seqs, BLOCK)


def both(model, ids, pos, batch, threads: int = 1, kv_dtype: torch.dtype | None = None):
    """(per-call hidden, pool k, pool v), (fused hidden, pool k, pool v) from the same starting pool."""
    pool = pool_for(model, kv_dtype=kv_dtype)
    k0, v0 = pool.k.clone(), pool.v.clone()
    fast = KernelForward(model, pool, KERNELS)
    assert fast.fused is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            fused = fast(ids, pos, batch), pool.k.clone(), pool.v.clone()
            pool.k.copy_(k0), pool.v.copy_(v0)
            kept, fast.fused = fast.fused, None
            calls = fast(ids, pos, batch), pool.k.clone(), pool.v.clone()
            fast.fused = kept
    finally:
        torch.set_num_threads(before)
    return calls, fused


def assert_same(calls, fused):
    for a, b in zip(calls, fused):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), float((a.float() - b.float()).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("types", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_fused_decode_equals_the_per_call_loop(types, dtype, rows):
    model = served(types, dtype)
    assert_same(*both(model, *decode_step(model, rows, seed=rows)))


@pytest.mark.parametrize("types", TYPES)
@pytest.mark.parametrize("rows", [1, 5])
def test_fused_decode_over_a_bf16_pool_equals_the_per_call_loop(types, rows):
    """Float32 activations over a bf16 KV pool (the AVX2 CPUs' default for quantized weights): the
    fused step writes and reads the pool as the per-call loop does, bit for bit."""
    model = served(types, torch.float32)
    calls, fused = both(model, *decode_step(model, rows, seed=rows + 11), kv_dtype=torch.bfloat16)
    assert calls[1].dtype == torch.bfloat16
    assert_same(calls, fused)


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: cpu_kernels.ISA_NAMES[i])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 5])
def test_every_isa_and_thread_count_gives_the_same_bits(isa, threads, rows):
    model = served("mixed-segments", torch.bfloat16, isa=isa)
    assert_same(*both(model, *decode_step(model, rows, seed=isa), threads=threads))


def test_biases_and_the_largest_row_count_the_blocks_take():
    model = served("q4_1-x8", torch.float32, dict(arch="qwen2", attention_bias=True))
    assert_same(*both(model, *decode_step(model, cpu_linear.QUANT_X8_MAX_ROWS, seed=7), threads=2))


def test_decode_steps_past_the_prompt_row_limit_stay_on_the_blocks(monkeypatch):
    """Past QuantKernelLinear's 32 rows (a limit for prompts) decode rows stay on the int8 blocks: the
    bits of the per-call loop with that limit lifted, and each row's hidden state the same as in a
    smaller batch (its activation codes are its own)."""
    model = served("mixed-segments", torch.bfloat16)
    rows = cpu_linear.QUANT_X8_MAX_ROWS + 9
    ids, pos, batch = decode_step(model, rows, seed=11)
    monkeypatch.setattr(cpu_linear, "QUANT_X8_MAX_ROWS", 4096)
    monkeypatch.setattr(cpu_linear, "QUANT_MAX_ROWS", 4096)
    calls, fused = both(model, ids, pos, batch, threads=2)
    assert_same(calls, fused)
    head = decode_step(model, 5, seed=11)                 # the same first 5 rows alone
    assert torch.equal(both(model, *head)[1][0], fused[0][:5])


def test_steps_it_does_not_take_keep_the_per_call_loop(monkeypatch):
    model = served("q4_1-x8", torch.bfloat16)
    fast = KernelForward(model, pool_for(model), KERNELS)
    calls = []
    monkeypatch.setattr(FusedDecode, "__call__", lambda self, *a: calls.append(a))
    with torch.inference_mode():
        # a prefill chunk beside a decode row
        fast(torch.tensor([1, 2, 3]), torch.tensor([4, 0, 1]), PagedBatch.build([(4, 1, [0]), (0, 2, [1])], BLOCK))
    assert calls == []
    assert fast.fused.takes(1, 1) and not fast.fused.takes(3, 1) and not fast.fused.takes(0, 0)
    assert fast.fused.takes(MAX_DECODE_ROWS, MAX_DECODE_ROWS) and not fast.fused.takes(MAX_DECODE_ROWS + 1,
                                                                                     MAX_DECODE_ROWS + 1)


def test_models_off_the_int8_blocks_have_no_fused_decode():
    from gpu_backend.model.config import tiny_config
    from gpu_backend.model.llama import LlamaModel
    plain = prepare_model(LlamaModel.random(tiny_config(hidden_size=64, intermediate_size=128), seed=1), KERNELS)
    assert KernelForward(plain, pool_for(plain), KERNELS).fused is None
    model = served("q4_1-x8", torch.float32)
    model.layers[1].mlp.down_proj.isa = 0 if model.layers[0].mlp.down_proj.isa else 1   # two paths in one stack
    assert KernelForward(model, pool_for(model), KERNELS).fused is None
