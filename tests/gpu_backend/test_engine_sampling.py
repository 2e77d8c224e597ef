"""The sampling surface through the engine and a real ring: logprob records (generated and
prompt) against a full-attention float32 reference, and the processors' effect on greedy runs."""
from __future__ import annotations

import pathlib
import random
import sys

import pytest
import torch

from gpu_backend import cpu_kernels
from gpu_backend.engine import Engine, EngineConfig
from gpu_backend.executors.cpu import CpuRunner
from gpu_backend.scheduler.intake import IntakeConfig
from gpu_backend.kv_pool import KVCacheConfig, KVPool
from gpu_backend.model import LlamaModel, greedy_generate, tiny_config
from gpu_backend.model.attention import DenseCausalAttention
from gpu_backend.scheduler.policy import PolicyConfig
from shared_layout import ErrorCode, FinishReason, Ring, RingGeometry
from shared_layout.extra import SamplingExtra

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from frontend_player import FrontendPlayer  # noqa: E402

GEOM = RingGeometry(16, 4096, 4096, 1 << 16)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model():
    return LlamaModel.random(tiny_config(), seed=5)


def make_engine(model, max_prefill_tokens=16, eos=(), **applies):
    ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    cfg = model.config
    pool = KVPool(KVCacheConfig(128, 4, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim))
    engine = Engine(ring, CpuRunner(model, pool, cpu_kernels.load()),
                    EngineConfig(PolicyConfig(8, max_prefill_tokens, 4), 128),
                    IntakeConfig(cfg.vocab_size, cfg.max_position_embeddings, eos, **applies))
    return engine, FrontendPlayer(ring)


def run(engine, fe, slot):
    for _ in range(2000):
        if fe.done(slot):
            return
        engine.step()
    raise AssertionError("no completion")


@torch.inference_mode()
def reference_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log_softmax of the full-attention logits at every position: [T, vocab] float32."""
    ids = torch.tensor(tokens)
    hidden = model(ids, torch.arange(len(tokens)), DenseCausalAttention(model.config))
    return torch.log_softmax(model.compute_logits(hidden).float(), -1)


def test_logprob_records_equal_a_full_forward(model):
    rng = random.Random(0)
    prompt = [rng.randrange(3, 500) for _ in range(37)]
    engine, fe = make_engine(model)            # 16-token prefill chunks: the prompt's records span 3 steps
    slot = fe.submit(prompt, 6, logprobs=3, prompt_logprobs=2)
    run(engine, fe, slot)
    lp, rank, ids, top = fe.logprobs(slot)
    plp, prank, pids, ptop = fe.logprobs(slot, prompt=True)
    out = fe.collect(slot).tokens
    ref = reference_logprobs(model, prompt + out)                               # [T, vocab]
    want = ref[len(prompt) - 1:-1].gather(1, torch.tensor(out)[:, None])[:, 0]
    torch.testing.assert_close(torch.from_numpy(lp), want, atol=2e-4, rtol=0)
    assert rank.tolist() == [1] * len(out)                                        # greedy
    refk = ref[len(prompt) - 1:-1].topk(3)
    assert ids.tolist() == refk.indices.tolist()
    torch.testing.assert_close(torch.from_numpy(top), refk.values, atol=2e-4, rtol=0)
    pwant = ref[:len(prompt) - 1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.from_numpy(plp), pwant, atol=2e-4, rtol=0)
    assert pids.tolist() == ref[:len(prompt) - 1].topk(2).indices.tolist()
    assert (prank >= 1).all() and (prank == 1).tolist() == (torch.tensor(prompt[1:]) == pids[:, 0]).tolist()


def test_processors_change_greedy_runs_as_asked(model):
    rng = random.Random(1)
    prompt = [rng.randrange(3, 500) for _ in range(9)]
    ref = greedy_generate(model, prompt, 8)
    engine, fe = make_engine(model, eos=(ref[0],))
    plain = fe.submit(prompt, 8)
    late = fe.submit(prompt, 8, min_tokens=3)                                   # EOS masked for 3 tokens
    banned = fe.submit(prompt, 8, ignore_eos=True, extra=SamplingExtra(bad_words=((ref[0],),)))
    boosted = fe.submit(prompt, 8, ignore_eos=True, extra=SamplingExtra(logit_bias=((7, 100.0),)))
    allowed = fe.submit(prompt, 8, ignore_eos=True, extra=SamplingExtra(allowed_token_ids=(11, 12)))
    pen = fe.submit(prompt, 8, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0,
                    repetition_penalty=2.0)
    slots = [plain, late, banned, boosted, allowed, pen]
    for s in slots:
        run(engine, fe, s)
    res = {s: fe.collect(s) for s in slots}
    assert (res[plain].finish, res[plain].tokens) == (FinishReason.STOP, ref[:1])
    assert len(res[late].tokens) >= 4 and ref[0] not in res[late].tokens[:3]
    assert ref[0] not in res[banned].tokens and len(res[banned].tokens) == 8
    assert res[boosted].tokens == [7] * 8
    assert set(res[allowed].tokens) <= {11, 12}
    assert len(set(res[pen].tokens)) >= 6                                      # penalties spread the picks


def test_bad_sampling_data_ends_only_that_request(model):
    engine, fe = make_engine(model)
    bad = fe.submit([5, 6], 4, extra=SamplingExtra(allowed_token_ids=(model.config.vocab_size + 3,)))
    good = fe.submit([5, 6], 4)
    run(engine, fe, bad)
    run(engine, fe, good)
    r = fe.collect(bad)
    assert (r.finish, r.error) == (FinishReason.ERROR, ErrorCode.INVALID_REQUEST)
    assert fe.collect(good).finish == FinishReason.LENGTH


def test_a_runner_without_automata_or_prompt_logits_refuses_them_and_serves_the_rest(model):
    """The CUDA host loop's intake: a constrained request and a prompt_logprobs request end
    INVALID_REQUEST at their claim instead of being served without what they asked for."""
    from shared_layout.automaton import from_transitions
    engine, fe = make_engine(model, structured_outputs=False, prompt_logprobs=False)
    words = from_transitions({0: {7: 1}, 1: {}}, 0, {1})
    constrained = fe.submit([5, 6], 4, extra=SamplingExtra(automaton=words.tobytes()))
    prompt_lp = fe.submit([5, 6], 4, prompt_logprobs=2)
    plain = fe.submit([5, 6], 4, logprobs=2)
    for slot in (constrained, prompt_lp, plain):
        run(engine, fe, slot)
    for slot in (constrained, prompt_lp):
        r = fe.collect(slot)
        assert (r.finish, r.error) == (FinishReason.ERROR, ErrorCode.INVALID_REQUEST)
    assert fe.collect(plain).finish == FinishReason.LENGTH
    engine, fe = make_engine(model, eos=(3,))    # the CPU runner applies both
    constrained = fe.submit([5, 6], 4, extra=SamplingExtra(automaton=words.tobytes()))
    run(engine, fe, constrained)
    r = fe.collect(constrained)
    assert r.tokens[0] == 7 and r.finish == FinishReason.STOP, (r.tokens, r.finish)


class CountingRunner:
    """The CPU runner, counting the tokens it computes."""

    def __init__(self, runner):
        self.runner, self.tokens = runner, 0

    def run(self, batch):
        self.tokens += sum(c.num_tokens for c in batch.chunks)
        return self.runner.run(batch)

    def copy_blocks(self, pairs):
        self.runner.copy_blocks(pairs)


@pytest.mark.parametrize("plen", [23, 24, 1])    # a partial last block (copied), whole blocks only, no prefill
def test_a_group_prefills_once_and_each_choice_continues_alone(model, plen):
    rng = random.Random(plen)
    prompt = [rng.randrange(3, 500) for _ in range(plen)]
    ref = greedy_generate(model, prompt, 5)
    engine, fe = make_engine(model, max_prefill_tokens=64)
    counter = CountingRunner(engine.runner)
    engine.runner = counter
    slots = fe.submit_group(prompt, 5, 3, ignore_eos=True)
    engine.step()                                      # the prefill: the leader alone, its last token held
    if plen > 1:
        assert counter.tokens == plen - 1 and len(engine.scheduler.running) == 3
        shared = engine.scheduler.running[1].blocks[:(plen - 1) // 4]
        assert shared == engine.scheduler.running[0].blocks[:(plen - 1) // 4]
        assert engine.scheduler.allocator.extra_refs == 2 * len(shared)
    for s in slots:
        run(engine, fe, s)
    res = [fe.collect(s) for s in slots]
    assert [r.tokens for r in res] == [ref] * 3        # greedy: every choice the reference
    assert counter.tokens == (plen - 1 if plen > 1 else 0) + 3 * 5
    assert engine.scheduler.allocator.free_count == engine.scheduler.allocator.num_blocks and engine.scheduler.allocator.extra_refs == 0


def test_seeded_choices_are_reproducible_and_differ_from_each_other(model):
    prompt = list(range(10, 30))
    engine, fe = make_engine(model)

    def draw():
        slots = fe.submit_group(prompt, 6, 3, seeds=[7, 8, 9], temperature=1.0, ignore_eos=True)
        for s in slots:
            run(engine, fe, s)
        return [fe.collect(s).tokens for s in slots]

    a, b = draw(), draw()
    assert a == b and len({tuple(t) for t in a}) == 3
    alone = fe.submit(prompt, 6, seed=8, temperature=1.0, ignore_eos=True)   # choice 1 alone: the same draw
    run(engine, fe, alone)
    assert fe.collect(alone).tokens == a[1]


def test_a_member_cancelled_before_the_fork_ends_alone_and_the_leader_takes_its_members_along(model):
    engine, fe = make_engine(model, max_prefill_tokens=4)
    prompt = list(range(40, 60))
    slots = fe.submit_group(prompt, 4, 3, ignore_eos=True)
    engine.step()                                          # 4 of 19 prefill tokens: no fork yet
    fe.cancel(slots[1])
    for s in slots:
        run(engine, fe, s)
    res = [fe.collect(s) for s in slots]
    assert res[1].finish == FinishReason.ABORT and res[1].tokens == []
    assert res[0].finish == res[2].finish == FinishReason.LENGTH
    # another prompt: the first one's blocks are in the prefix cache, and a hit would fork at once
    slots = fe.submit_group(list(range(70, 90)), 4, 2, ignore_eos=True)
    engine.step()
    fe.cancel(slots[0])                                    # the leader, before the fork: both end
    for s in slots:
        run(engine, fe, s)
    assert [fe.collect(s).finish for s in slots] == [FinishReason.ABORT] * 2
    assert engine.scheduler.allocator.free_count == engine.scheduler.allocator.num_blocks and not engine.owned
