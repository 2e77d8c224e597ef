"""DecodeStep (cpu_decode_step.py: a decode-only step from token ids to tokens in one C call) gives
what CpuRunner's general path gives (PagedBatch, KernelForward, compute_logits, sample): the same
logits bit for bit and the same argmax, the same tokens and KV pool bytes over steps whose rows come,
go, move between rows, grow new blocks, outgrow the kept arrays and are recomputed on other blocks;
sampled and logprob rows take the sampler over its logits; a NaN row gives -1 alone; the steps it
does not take run the general path."""
from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
import torch

from gpu_backend.executors.cpu import CpuRunner
from gpu_backend.executors.cpu_decode_step import DecodeStep
from gpu_backend.executors.cpu_forward import KernelForward
from gpu_backend.scheduler import ScheduledChunk, StepBatch
from gpu_backend.scheduler.policy import StepKind
from gpu_backend.scheduler.sequence import SamplingParams, Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_cpu_decode import BLOCK, KERNELS, NUM_BLOCKS, decode_step, pool_for, served  # noqa: E402

pytestmark = pytest.mark.skipif(KERNELS is None, reason="the CPU kernels cannot be built here (no g++)")

TIED = dict(tie_word_embeddings=True)


def untied(dtype: torch.dtype):
    """An untied Q4_1 model whose own lm_head (Q4_1 blocks) is its logits head, as the GGUF loader serves one
    (a head forward.cc does not run: the logits come from compute_logits in Python)."""
    from gpu_backend.executors.cpu_linear import prepare_model
    from test_cpu_quant import quantize_model, tiny
    from gguf import GGMLQuantizationType as Q
    model = quantize_model(tiny({}), {}, Q.Q4_1).to(dtype)
    model.logits_head = model.lm_head
    return prepare_model(model, KERNELS)


def runners(model):
    """(DecodeStep's runner, the general path's runner) over two pools with the same bytes."""
    fast, plain = CpuRunner(model, pool_for(model), KERNELS), CpuRunner(model, pool_for(model), KERNELS)
    assert fast.decode_step is not None
    plain.decode_step = None
    return fast, plain


def new_seq(i: int, prompt_len: int, blocks: list[int], **params) -> Sequence:
    g = torch.Generator().manual_seed(100 + i)
    prompt = torch.randint(3, 500, (prompt_len,), generator=g).tolist()
    return Sequence(slot=i, seq=i, epoch=1, prompt=prompt, max_tokens=64, params=SamplingParams(**params),
                    stop_ids=frozenset(), max_len=256, blocks=blocks)


def prefill(runner, seq: Sequence) -> int:
    """The sequence's whole context (prompt + output so far) in one chunk -> its next token."""
    n = len(seq.prompt) + len(seq.output)
    return runner.run(StepBatch(StepKind.PREFILL, (ScheduledChunk(seq, 0, n, True),)))[0]


def decode(runner, seqs: list[Sequence]) -> list[int]:
    n = [len(s.prompt) + len(s.output) - 1 for s in seqs]
    return runner.run(StepBatch(StepKind.DECODE, tuple(ScheduledChunk(s, p, 1, True) for s, p in zip(seqs, n))))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_logits_and_picks_are_the_general_paths_bits(rows, dtype, threads):
    model = served("q4_1-x8", dtype, TIED)
    ids, pos, batch = decode_step(model, rows)
    pool = pool_for(model)
    k0, v0 = pool.k.clone(), pool.v.clone()
    fwd = KernelForward(model, pool, KERNELS)
    fused = fwd.fused
    if not fused.head_takes(rows):
        pytest.skip("this CPU's head takes another path at this batch (G16 copy): not forward.cc's")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            want = model.compute_logits(fwd(ids, pos, batch))
            k1, v1 = pool.k.clone(), pool.v.clone()
            pool.k.copy_(k0), pool.v.copy_(v0)
            cos, sin = fwd.rope_tables(int(pos.max()) + 1, model.dtype)
            arrays = [a.contiguous() for a in (ids, pos, batch.slot_mapping, batch.decode_block_tables,
                                               batch.decode_context_lens)]
            normed, logits, picks = fused.run_ids(rows, *(a.data_ptr() for a in arrays[:4]),
                                                  arrays[3].shape[1], arrays[4].data_ptr(), cos, sin, True, True,
                                                  threads)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(logits, want), float((logits - want).abs().max())
    assert picks.tolist() == want.numpy().argmax(axis=-1).tolist()
    assert torch.equal(pool.k, k1) and torch.equal(pool.v, v1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [True, False], ids=["tied-head-in-c", "own-head-in-python"])
def test_changing_batches_give_the_general_paths_tokens_and_pool(tied, dtype):
    model = served("q4_1-x8", dtype, TIED) if tied else untied(dtype)
    fast, plain = runners(model)
    assert (fast.decode_step.fused.head is not None) == tied
    free = list(range(NUM_BLOCKS))

    def take(n):
        got = free[:n]
        del free[:n]
        return got

    def both(seqs_fast, seqs_plain, fn):
        a, b = fn(fast, seqs_fast), fn(plain, seqs_plain)
        assert a == b
        for s, t in zip(seqs_fast, a):
            s.output.append(t)
        for s, t in zip(seqs_plain, b):
            s.output.append(t)

    # Each sequence twice (one per runner), on the same blocks of its runner's pool. Lengths put row
    # 0 on a block edge, and the 150-token prompt's 10-block table past the kept width of 8.
    specs = [(14, 3), (40, 4), (150, 11), (7, 3), (23, 4), (60, 6), (9, 2), (31, 4), (18, 3), (5, 2), (70, 6)]
    pairs = []
    for i, (n, nb) in enumerate(specs):
        blocks = take(nb)
        pairs.append((new_seq(i, n, list(blocks)), new_seq(i, n, list(blocks))))
    for f, p in pairs:
        both([f], [p], lambda r, s: [prefill(r, s[0])])

    def step(idx):
        both([pairs[i][0] for i in idx], [pairs[i][1] for i in idx], decode)

    for _ in range(3):
        step([0, 1, 3])
    step([0, 3])                                  # row 1 leaves; row 3 moves up
    step([3, 0, 4, 1])
    step([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])          # past the kept rows and width
    for f, p in (pairs[1],):                      # preempted: recomputed on other blocks, same row
        f.blocks = p.blocks = take(4)
        both([f], [p], lambda r, s: [prefill(r, s[0])])
    for _ in range(2):
        step([3, 1, 10])
    step([0])
    assert torch.equal(fast.pool.k, plain.pool.k) and torch.equal(fast.pool.v, plain.pool.v)


def test_sampled_and_logprob_rows_take_the_sampler_over_the_same_logits():
    model = served("q4_1-x8", torch.float32, TIED)
    fast, plain = runners(model)
    params = [dict(), dict(temperature=0.8, seed=7), dict(logprobs=3), dict(temperature=1.0, top_k=5, seed=3)]
    seqs = {r: [new_seq(i, 10 + 3 * i, [2 * i, 2 * i + 1], **p) for i, p in enumerate(params)]
            for r in (fast, plain)}
    for r, ss in seqs.items():
        for s in ss:
            s.output.append(prefill(r, s))
    for _ in range(4):
        got = {r: decode(r, ss) for r, ss in seqs.items()}
        assert got[fast] == got[plain]
        assert np.array_equal(seqs[fast][2].step_logprobs, seqs[plain][2].step_logprobs)
        for r, ss in seqs.items():
            for s, t in zip(ss, got[r]):
                s.output.append(t)


def test_a_nan_row_gives_minus_one_and_leaves_the_others():
    model = served("q4_1-x8", torch.float32, TIED)
    fast, plain = runners(model)
    seqs = {r: [new_seq(i, 12, [3 * i, 3 * i + 1, 3 * i + 2]) for i in range(3)] for r in (fast, plain)}
    for r, ss in seqs.items():
        for s in ss:
            s.output.append(prefill(r, s))
    # NaN in row 1's input embedding: the residual stream keeps it to the head (the layers' int8
    # activation codes would not: a NaN in the pool does not reach the logits)
    last = [s.output[-1] for s in seqs[fast]]
    assert last[1] not in (last[0], last[2])
    with torch.no_grad():
        model.embed_tokens.weight[last[1]] = float("nan")
    got = {r: decode(r, ss) for r, ss in seqs.items()}
    assert got[fast] == got[plain] and got[fast][1] == -1 and -1 not in (got[fast][0], got[fast][2])


def test_steps_it_does_not_take_run_the_general_path():
    model = served("q4_1-x8", torch.float32, TIED)
    fast, _ = runners(model)
    step = fast.decode_step
    s = new_seq(0, 12, [0, 1])
    assert step(StepBatch(StepKind.PREFILL, (ScheduledChunk(s, 0, 12, True),))) is None         # a prompt
    assert step(StepBatch(StepKind.DECODE, (ScheduledChunk(s, 11, 1, False),))) is None          # not sampled
    lp = new_seq(1, 12, [2, 3], prompt_logprobs=2)
    assert step(StepBatch(StepKind.PREFILL, (ScheduledChunk(lp, 5, 1, True),))) is None          # scores a prompt row
    many = tuple(ScheduledChunk(new_seq(i, 3, [i]), 2, 1, True) for i in range(step.fused.max_rows + 1))
    assert step(StepBatch(StepKind.DECODE, many)) is None
    bad = new_seq(2, 40, [4])                                                                     # table too short
    with pytest.raises(ValueError, match="outside"):
        step(StepBatch(StepKind.DECODE, (ScheduledChunk(bad, 39, 1, True),)))


def test_only_models_whose_embedding_forward_cc_copies_get_it():
    model = served("q4_1-x8", torch.float32, TIED)
    assert DecodeStep.applicable(KernelForward(model, pool_for(model), KERNELS))
    from gpu_backend.model.config import tiny_config
    from gpu_backend.model.llama import LlamaModel
    from gpu_backend.executors.cpu_linear import prepare_model
    dense = prepare_model(LlamaModel.random(tiny_config(), seed=1), KERNELS)       # no int8 blocks: no fused decode
    assert CpuRunner(dense, pool_for(dense), KERNELS).decode_step is None
