"""Prefix caching through the scheduler and the engine: hits start a prefill at the first
uncached block and leave the last token to compute; partial blocks are not shared; nothing
is lost when cached blocks are evicted or sharers preempted (forks sharing a prefix:
tests/gpu_backend/test_engine_sampling.py, with the cache on); prompt-logprob requests never
skip a position; and greedy float32 outputs of the real embedded model are identical with
and without the cache."""
from __future__ import annotations

import pathlib
import random
import sys

import pytest
import torch

from gpu_backend import cpu_kernels
from gpu_backend.engine import Engine, EngineConfig
from gpu_backend.executors.cpu import CpuRunner
from gpu_backend.executors.null import EchoRunner
from gpu_backend.kv_pool import KVCacheConfig, KVPool
from gpu_backend.scheduler import PolicyConfig, SamplingParams, Scheduler, Sequence
from gpu_backend.scheduler.intake import IntakeConfig
from shared_layout import Ring, RingGeometry

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from frontend_player import FrontendPlayer  # noqa: E402

GEOM = RingGeometry(32, 16384, 8192)


def seq(slot: int, prompt: list[int], **params) -> Sequence:
    return Sequence(slot=slot, seq=slot, epoch=0, prompt=list(prompt), max_tokens=8,
                    params=SamplingParams(**params), stop_ids=frozenset(), max_len=4096)


def run_step(sched: Scheduler, tokens_out: int = 7):
    """One schedule -> (pretend) run -> update; sampled chunks get `tokens_out` appended."""
    out = sched.schedule()
    sched.update(out.batch)
    for c in out.batch.chunks:
        if c.sample:
            c.seq.output.append(tokens_out)
    return out


def first_chunk(sched: Scheduler, s: Sequence, limit: int = 4):
    """Step until `s` is scheduled (a decode step may come first); its chunk."""
    for _ in range(limit):
        out = run_step(sched)
        mine = [c for c in out.batch.chunks if c.seq is s]
        if mine:
            return mine[0]
    raise AssertionError("never scheduled")


def test_a_hit_starts_at_the_first_uncached_block_and_leaves_the_last_token():
    sched = Scheduler(PolicyConfig(8, 4096, 4), 64)
    a = seq(0, list(range(10)))                      # blocks [0..3] [4..7] and a partial [8, 9]
    sched.add(a)
    run_step(sched)
    assert a.num_computed == 10 and a.num_committed == 2 and sched.allocator.cached_count == 2
    b = seq(1, list(range(10)) + [50, 51])          # same first 10 tokens: 2 full blocks hit
    sched.add(b)
    chunk = first_chunk(sched, b)
    assert chunk.start == 8 and chunk.num_tokens == 4 and chunk.sample
    assert b.blocks[:2] == a.blocks[:2] and b.blocks[2] != a.blocks[2]   # the partial block is not shared
    assert sched.stats.hit_tokens == 8 and sched.stats.hit_blocks == 2
    c = seq(2, list(range(8)))                       # the whole prompt cached: the last block is recomputed
    sched.add(c)
    chunk = first_chunk(sched, c)
    assert chunk.start == 4 and chunk.num_tokens == 4 and c.blocks[0] == a.blocks[0]


def test_prompt_logprob_requests_compute_every_position():
    sched = Scheduler(PolicyConfig(8, 4096, 4), 64)
    sched.add(seq(0, list(range(12))))
    run_step(sched)
    b = seq(1, list(range(12)), prompt_logprobs=1)
    sched.add(b)
    chunk = first_chunk(sched, b)
    assert chunk.start == 0 and chunk.num_tokens == 12


def test_off_means_no_hits_and_no_cached_blocks():
    sched = Scheduler(PolicyConfig(8, 4096, 4), 64, prefix_caching=False)
    sched.add(seq(0, list(range(12))))
    run_step(sched)
    b = seq(1, list(range(12)))
    sched.add(b)
    assert first_chunk(sched, b).start == 0
    assert sched.allocator.cached_count == 0 and sched.stats.hit_tokens == 0


def test_policy_counts_idle_hit_blocks_leaving_the_free_count():
    """A pool exactly full of evictable cached blocks: a hitting request must not be planned
    more new blocks than remain after it takes its own hits."""
    sched = Scheduler(PolicyConfig(8, 4096, 4), 6)
    a = seq(0, list(range(24)))                       # 6 blocks, all committed
    sched.add(a)
    run_step(sched)
    a_blocks = list(a.blocks)
    sched.remove(a)
    assert sched.allocator.evictable_count == 6 and sched.free_blocks == 6
    b = seq(1, list(range(16)) + [99] * 8)            # hits 4, needs 2 new: exactly the pool
    sched.add(b)
    first_chunk(sched, b)
    assert b.blocks[:4] == a_blocks[:4] and len(b.blocks) == 6 and b.num_computed == 24
    assert sched.allocator.free_count == 0


# -- through the engine ----------------------------------------------------------------

def echo_engine(num_blocks: int, block_size: int = 4, max_batch_size: int = 8, max_len: int = 256,
                prefix_caching: bool = True):
    ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    engine = Engine(ring, EchoRunner(), EngineConfig(PolicyConfig(max_batch_size, 64, block_size), num_blocks,
                                                     prefix_caching=prefix_caching),
                    IntakeConfig(1000, max_len))
    return engine, FrontendPlayer(ring)


def drain(engine, fe, slots, limit=20000):
    out = {}
    for _ in range(limit):
        for s in [s for s in slots if s not in out and fe.done(s)]:
            out[s] = fe.collect(s)
        if len(out) == len(slots):
            return out
        engine.step()
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize("seed", range(4))
def test_nothing_lost_under_pressure_with_sharing_eviction_and_preemption(seed):
    """A small pool, many requests over a few shared prefixes, and cancels: every
    request ends with the echo it would get alone, the pool comes back whole, and the header
    counters add up."""
    rng = random.Random(seed)
    engine, fe = echo_engine(num_blocks=64 // 4 + 8, max_len=64)
    prefixes = [[rng.randrange(3, 1000) for _ in range(rng.randint(4, 20))] for _ in range(3)]
    want, slots, cancelled = {}, [], set()
    for i in range(30):
        prompt = (rng.choice(prefixes) + [rng.randrange(3, 1000) for _ in range(rng.randint(0, 9))])[:40]
        n = rng.randint(1, 20)
        group = [fe.submit(prompt, n)]
        for s in group:
            want[s] = [prompt[j % len(prompt)] for j in range(n)]
            slots.append(s)
        if rng.random() < 0.1:
            fe.cancel(group[0])
            cancelled.update(group)
        for _ in range(rng.randint(0, 3)):
            engine.step()
        if len(slots) > 20:                   # the ring has 32 slots: let some finish
            for s, r in drain(engine, fe, slots).items():
                assert r.tokens == want[s][:len(r.tokens)], s
                assert s in cancelled or r.tokens == want[s], s
            slots = []
    for s, r in drain(engine, fe, slots).items():
        assert s in cancelled or r.tokens == want[s], s
    sched = engine.scheduler
    assert sched.allocator.free_count == sched.num_blocks and sched.allocator.extra_refs == 0
    assert sched.stats.hit_tokens > 0 and sched.allocator.evictions > 0
    h = engine.ring.header
    assert int(h["prefix_caching"]) == 1
    assert int(h["prefix_hit_tokens"]) == sched.stats.hit_tokens
    assert int(h["prefix_miss_blocks"]) == sched.stats.miss_blocks
    assert int(h["kv_blocks_free"]) == sched.num_blocks


def real_engine(model, prefix_caching: bool, num_blocks: int = 512, block_size: int = 16):
    ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    cfg = model.config
    pool = KVPool(KVCacheConfig(num_blocks, block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim))
    engine = Engine(ring, CpuRunner(model, pool, cpu_kernels.load()),
                    EngineConfig(PolicyConfig(4, 512, block_size), num_blocks, prefix_caching=prefix_caching),
                    IntakeConfig(cfg.vocab_size, 2048, (2,)))
    return engine, FrontendPlayer(ring)


@pytest.mark.slow
def test_greedy_float32_outputs_of_the_embedded_model_are_identical_with_and_without():
    from gpu_backend.model import load_model
    from gpu_backend.executors.cpu_linear import prepare_model
    torch.manual_seed(0)
    model = prepare_model(load_model("default", dtype=torch.float32).model, cpu_kernels.load())
    rng = random.Random(1)
    system = [rng.randrange(3, 49000) for _ in range(300)]             # a shared "system prompt"
    prompts = [system + [rng.randrange(3, 49000) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    prompts.append(system[:160])                                        # a prompt that is all cached blocks
    results = {}
    for on in (False, True):
        engine, fe = real_engine(model, on)
        got = []
        for i, p in enumerate(prompts):                                  # one after another: later ones hit
            s = fe.submit(p, 12, ignore_eos=True)
            got.append(drain(engine, fe, [s])[s].tokens)
        if on:
            assert engine.scheduler.stats.hit_tokens == 3 * 288 + 144   # 18 blocks x 3, all 9 of the last
        results[on] = got
    assert results[True] == results[False]
