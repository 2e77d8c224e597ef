"""KernelForward (the fused C++ kernel layer) computes what LlamaModel.forward with
PagedAttention computes: mixed batches of decodes, fresh prefills and continuing prefill
chunks, on the Llama variants it applies to, and the real SmolLM2 in bfloat16."""
from __future__ import annotations

import copy

import pytest
import torch

from gpu_backend import cpu_kernels
from gpu_backend.executors.cpu_forward import KernelForward, prefill_spans
from gpu_backend.executors.cpu_linear import prepare_model
from gpu_backend.kv_pool import KVCacheConfig, KVPool
from gpu_backend.model.config import tiny_config
from gpu_backend.model.llama import LlamaModel
from gpu_backend.paged_attention import PagedAttention, PagedBatch

KERNELS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the CPU kernels cannot be built here (no g++)")

VARIANTS = {
    "gqa-untied": dict(),
    "mha-tied": dict(num_kv_heads=4, tie_word_embeddings=True),
    "qwen2-bias": dict(arch="qwen2", attention_bias=True),
    "head64": dict(head_dim=64, hidden_size=128),
}
BLOCK = 4


BLOCKS = {"a": [9, 2, 14, 5], "b": [0, 7, 11, 3], "c": [4, 12, 1, 8]}   # block tables, out of order
# A prefills 7 then decodes; B prefills in two chunks (5 + 6, the second over cached blocks)
# while A decodes; C arrives fresh beside both; then all three decode together.
STEPS = [
    [("a", 0, 7)],
    [("a", 7, 1), ("b", 0, 5)],
    [("a", 8, 1), ("b", 5, 6), ("c", 0, 3)],
    [("a", 9, 1), ("b", 11, 1), ("c", 3, 1)],
    [("a", 10, 1), ("b", 12, 1), ("c", 4, 1)],
]


def run_both(model: LlamaModel, steps=STEPS, kv_dtype: torch.dtype | None = None):
    """Each step through both paths, each over its own pool -> [(PyTorch hidden, kernel hidden)]."""
    cfg = model.config
    pools = [KVPool(KVCacheConfig(16, BLOCK, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim),
                    dtype=kv_dtype or model.dtype) for _ in range(2)]
    attn, fast = PagedAttention(pools[0]), KernelForward(model, pools[1], KERNELS)
    tokens = {seq: torch.randint(0, cfg.vocab_size, (32,), generator=torch.Generator().manual_seed(i))
              for i, seq in enumerate(BLOCKS)}
    out = []
    for step in steps:
        ids = torch.cat([tokens[seq][start:start + n] for seq, start, n in step])
        pos = torch.cat([torch.arange(start, start + n) for _, start, n in step])
        batch = PagedBatch.build([(start, n, BLOCKS[seq]) for seq, start, n in step], BLOCK)
        with torch.inference_mode():
            attn.batch = batch
            want = model(ids, pos, attn)
            got = fast(ids, pos, batch)
        out.append((want, got))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_layer_equals_the_pytorch_layer_on_mixed_batches(variant, dtype):
    model = prepare_model(LlamaModel.random(tiny_config(**VARIANTS[variant]), seed=7).to(dtype))
    assert KernelForward.applicable(model, KERNELS)
    agree = rows = 0
    for want, got in run_both(model):
        assert got.shape == want.shape and got.dtype == want.dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        else:        # bf16: PyTorch rounds attention scores and probabilities to bf16, the kernel does not
            torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)
            logits_want, logits_got = model.compute_logits(want), model.compute_logits(got)
            pick_want, pick_got = logits_want.argmax(-1), logits_got.argmax(-1)
            agree, rows = agree + int((pick_want == pick_got).sum()), rows + len(pick_want)
            # A different greedy pick only at a near-tie of the random model: the reference's margin
            # over the kernel's pick is within the two paths' bf16 noise.
            margin = logits_want.max(-1).values - logits_want.gather(-1, pick_got[:, None])[:, 0]
            assert float(margin.max()) <= 2 * float((logits_want - logits_got).abs().max())
    assert dtype == torch.float32 or agree >= 0.9 * rows


def test_prefill_spans_give_each_chunk_its_rows_context_and_table():
    batch = PagedBatch.build([(8, 1, [9, 2, 14]), (5, 6, [0, 7, 11]), (0, 3, [4])], BLOCK)
    tables, spans = prefill_spans(batch)
    assert tables.tolist() == [[0, 7, 11], [4, 0, 0]]
    assert spans.tolist() == [[1, 6, 11], [7, 3, 3]]        # first row, tokens, context after the step


@pytest.mark.slow
def test_smollm2_bf16_greedy_tokens_agree_between_the_two_layers():
    """The real model, prompt then 24 greedy tokens a sequence, three sequences batched. The
    two bf16 layers round differently only inside attention (PyTorch rounds scores and
    probabilities to bf16, the kernel keeps them in float32), so they agree on the next
    token wherever SmolLM2's top two logits are not a near-tie."""
    from tokenizers import Tokenizer

    from gpu_backend.executors.cpu import CpuRunner
    from gpu_backend.model.loader import load_model, prepare_default_model
    tok = Tokenizer.from_file(str(prepare_default_model() / "tokenizer.json"))
    chats = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea."]
    prompts = [tok.encode(f"<|im_start|>user\n{c}<|im_end|>\n<|im_start|>assistant\n").ids for c in chats]
    # One model as the executor prepares it without kernels (oneDNN matmuls, PyTorch layer), one
    # with them (small-batch matmuls for these 3-row decode steps, kernel layer).
    plain = prepare_model(load_model("default", dtype=torch.bfloat16).model)
    model = prepare_model(load_model("default", dtype=torch.bfloat16).model, KERNELS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = model.config

    def new_pool():
        return KVPool(KVCacheConfig(64, 16, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim), dtype=torch.bfloat16)
    try:
        outs = []
        for kernels in (None, KERNELS):
            runner = CpuRunner(model if kernels else plain, new_pool(), kernels)
            assert (runner.kernel_forward is not None) == (kernels is not None)
            outs.append(greedy_batch(runner, prompts, 24))
        # Teacher-forced on the PyTorch layer's tokens, the kernel layer picks the same next token
        # (nearly) everywhere; free-running, bf16 near-ties may flip a late token and the texts part.
        forced = greedy_batch(CpuRunner(model, new_pool(), KERNELS), prompts, 24, forced=outs[0])
    finally:
        torch.set_num_threads(threads)
    picks = [t for seq in forced for t in seq]
    want = [t for seq in outs[0] for t in seq]
    agree = sum(a == b for a, b in zip(picks, want)) / len(want)
    assert agree >= 0.95, agree
    assert outs[1][0] == outs[0][0]                    # the short factual answer is the same
    assert "Paris" in tok.decode(outs[1][0])


def greedy_batch(runner, prompts: list[list[int]], n: int, forced=None) -> list[list[int]]:
    """Prefill every prompt in one step, then decode all of them together n - 1 times; each
    step's argmax is returned, and fed back unless `forced` gives the tokens to feed."""
    from gpu_backend.scheduler import ScheduledChunk, StepBatch
    from gpu_backend.scheduler.policy import StepKind
    from gpu_backend.scheduler.sequence import SamplingParams, Sequence
    seqs, start = [], 0
    for i, p in enumerate(prompts):
        blocks = -(-(len(p) + n) // 16)
        seqs.append(Sequence(slot=i, seq=i, epoch=1, prompt=p, max_tokens=n, params=SamplingParams(),
                             stop_ids=frozenset(), max_len=2048, blocks=list(range(start, start + blocks))))
        start += blocks
    out = [[] for _ in prompts]
    for step in range(n):
        chunks = tuple(ScheduledChunk(s, 0 if step == 0 else len(s.prompt) + step - 1,
                                      len(s.prompt) if step == 0 else 1, True) for s in seqs)
        kind = StepKind.PREFILL if step == 0 else StepKind.DECODE
        for i, t in enumerate(runner.run(StepBatch(kind, chunks))):
            out[i].append(t)
            seqs[i].output.append(t if forced is None else forced[i][step])
    return out


def test_not_applicable_where_the_kernels_do_not_cover_the_model():
    qk_norm = prepare_model(LlamaModel.random(tiny_config(arch="qwen3", qk_norm=True, head_dim=32), seed=1))
    assert not KernelForward.applicable(qk_norm, KERNELS)        # q/k norms sit between the matmul and RoPE
    unfused = LlamaModel.random(tiny_config(), seed=1)
    assert not KernelForward.applicable(unfused, KERNELS)
    assert not KernelForward.applicable(prepare_model(copy.deepcopy(unfused)), None)
    assert not KernelForward.applicable(prepare_model(unfused.to(torch.float16)), KERNELS)
    with pytest.raises(ValueError, match="fused model"):
        KernelForward(qk_norm, None, KERNELS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rows_come_from_a_table_with_the_models_values(dtype):
    """KernelForward.rope: the rows of LlamaModel.rope, bit for bit, for any positions; the table
    grows (to a power of two) when a position passes it, and follows the dtype asked for."""
    model = prepare_model(LlamaModel.random(tiny_config(head_dim=64, hidden_size=128), seed=0).to(dtype), KERNELS)
    cfg = model.config
    pool = KVPool(KVCacheConfig(16, BLOCK, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim), dtype=dtype)
    fast = KernelForward(model, pool, KERNELS)
    for positions in (torch.tensor([0]), torch.tensor([5, 3, 200, 7]), torch.tensor([1000, 999, 0]),
                      torch.randint(0, 4096, (37,), generator=torch.Generator().manual_seed(0))):
        cos, sin = fast.rope(positions, dtype)
        want_cos, want_sin = model.rope(positions, dtype)
        assert cos.dtype == dtype and cos.is_contiguous() and sin.is_contiguous()
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
        assert fast._rope_cos.shape[0] >= int(positions.max()) + 1
    assert fast._rope_cos.shape[0] == 4096                        # grew from 256 to the next power of two
    cos, _ = fast.rope(torch.tensor([3]), torch.float32)          # another dtype: the table is made again
    assert cos.dtype == torch.float32 and torch.equal(cos, model.rope(torch.tensor([3]), torch.float32)[0])


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_layer_over_a_bf16_pool_equals_the_pytorch_layer_over_it(variant):
    """Float32 activations over a bf16 KV pool, prefill chunks and decodes mixed: the kernels' layer
    and PyTorch's (PagedAttention writes k/v .to(bf16), reads them back .to(float32)) agree within the
    K/V rounding (PyTorch's prefill of a fresh sequence attends over the chunk's own unrounded k/v,
    the kernels read every key from the pool: ~6e-3 apart at most here), and so does each against
    the float32 pool."""
    model = prepare_model(LlamaModel.random(tiny_config(**VARIANTS[variant]), seed=7))
    for (want, got), (want32, got32) in zip(run_both(model, kv_dtype=torch.bfloat16), run_both(model)):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)
        torch.testing.assert_close(got, got32, rtol=0.02, atol=0.02)
        assert not torch.equal(got, got32)                 # the bf16 pool was used (its rounding shows)
