"""The batched, paged CPU engine against the plain full-attention reference, through a
real Ring (in a bytearray) with FrontendPort playing the frontend."""
from __future__ import annotations

import pathlib
import random
import sys

import pytest
import torch

from gpu_backend import cpu_kernels
from gpu_backend.engine import Engine, EngineConfig
from gpu_backend.executors import ExecutorOptions
from gpu_backend.executors.cpu import CpuExecutor, CpuRunner
from gpu_backend.scheduler.intake import IntakeConfig
from gpu_backend.kv_pool import KVCacheConfig, KVPool
from gpu_backend.model import LlamaModel, greedy_generate, tiny_config
from gpu_backend.scheduler.policy import PolicyConfig, StepKind
from shared_layout import ErrorCode, FinishReason, Ring, RingGeometry, SlotState

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from frontend_player import FrontendPlayer  # noqa: E402

GEOM = RingGeometry(32, 8192, 8192)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: a second intra-op thread only adds spin-waits on a shared 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module", params=["pytorch", "kernels"])
def model(request):
    """The same weights run by the PyTorch layer, and fused (q|k|v, gate|up) so that the
    runner takes the C++ kernel layer (cpu_forward.KernelForward)."""
    m = LlamaModel.random(tiny_config(), seed=3)
    if request.param == "kernels":
        if cpu_kernels.load() is None:
            pytest.skip("the CPU kernels cannot be built here (no g++)")
        m.fuse_projections()
    return m


def make_engine(model, *, num_blocks=256, block_size=4, max_batch_size=8, max_prefill_tokens=64, max_len=None,
                eos=(), runner=None):
    ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    cfg = model.config
    pool = KVPool(KVCacheConfig(num_blocks, block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim))
    policy = PolicyConfig(max_batch_size, max_prefill_tokens, block_size)
    if runner is None:
        runner = CpuRunner(model, pool, cpu_kernels.load())
        assert (runner.kernel_forward is not None) == (model.layers[0].mlp.gate_up_proj is not None)
    engine = Engine(ring, runner, EngineConfig(policy, num_blocks),
                    IntakeConfig(cfg.vocab_size, max_len or cfg.max_position_embeddings, eos))
    return engine, FrontendPlayer(ring)


def rand_prompt(rng, n, vocab=512):
    return [rng.randrange(3, vocab) for _ in range(n)]


def drain(engine, fe, slots, limit=5000):
    """Step until every slot in `slots` completes; return {slot: Result}."""
    out = {}
    for _ in range(limit):
        for s in [s for s in slots if s not in out and fe.done(s)]:
            out[s] = fe.collect(s)
        if len(out) == len(slots):
            return out
        engine.step()
    raise AssertionError("engine did not finish")


def test_greedy_equals_reference_with_arrivals_and_cancels(model):
    rng = random.Random(0)
    engine, fe = make_engine(model)
    lengths = [1, 5, 17, 33, 60, 3]
    prompts = [rand_prompt(rng, n) for n in lengths]
    want = [greedy_generate(model, p, 24) for p in prompts]
    slots = {fe.submit(p, 24): i for i, p in enumerate(prompts[:3])}
    for _ in range(6):                       # the first three are decoding when the rest arrive
        engine.step()
    assert all(fe.tokens_so_far(s) for s in slots)
    slots.update({fe.submit(p, 24): i + 3 for i, p in enumerate(prompts[3:])})
    victim = next(s for s, i in slots.items() if i == 1)
    fe.cancel(victim)
    cancelled_at = len(fe.tokens_so_far(victim))
    engine.step()                            # honoured within one step
    assert fe.done(victim)
    res = drain(engine, fe, list(slots))
    for slot, i in slots.items():
        r = res[slot]
        if slot == victim:
            assert r.finish == FinishReason.ABORT and r.tokens == want[i][:len(r.tokens)]
            assert len(r.tokens) == cancelled_at
        else:
            assert (r.finish, r.tokens) == (FinishReason.LENGTH, want[i]), i
    assert engine.scheduler.allocator.free_count == engine.scheduler.allocator.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_chunked_prefill_and_eos_and_stop_ids(model):
    rng = random.Random(1)
    p = rand_prompt(rng, 150)
    ref = greedy_generate(model, p, 20)
    engine, fe = make_engine(model, max_prefill_tokens=16, eos=(ref[7],))
    a = fe.submit(p, 20)                               # EOS at ref[7] (first occurrence)
    b = fe.submit(p, 20, ignore_eos=True)
    c = fe.submit(p, 20, ignore_eos=True, stop_ids=(ref[3],))
    res = drain(engine, fe, [a, b, c])
    k = ref.index(ref[7])
    assert (res[a].finish, res[a].tokens) == (FinishReason.STOP, ref[:k + 1])
    assert (res[b].finish, res[b].tokens) == (FinishReason.LENGTH, ref)
    j = ref.index(ref[3])
    assert (res[c].finish, res[c].tokens) == (FinishReason.STOP, ref[:j + 1])


def test_preemption_under_a_tiny_pool_matches_reference_and_frees_everything(model):
    rng = random.Random(2)
    prompts = [rand_prompt(rng, n) for n in (9, 14, 6, 11, 20, 4)]
    want = [greedy_generate(model, p, 30) for p in prompts]
    # 14 blocks of 4 = 56 tokens: one 50-token request fits, six need preemption
    engine, fe = make_engine(model, num_blocks=14, max_len=56)
    slots = [fe.submit(p, 30) for p in prompts]
    paused_seen, res = False, {}
    for _ in range(5000):
        engine.step()
        paused_seen |= bool((engine.ring.state == SlotState.DECODE_PAUSED).any())
        for s in [s for s in slots if s not in res and fe.done(s)]:
            res[s] = fe.collect(s)
        if len(res) == len(slots):
            break
    assert paused_seen
    for s, p, w in zip(slots, prompts, want):
        assert res[s].tokens == w[:56 - len(p)][:30]
    assert engine.scheduler.allocator.free_count == 14


def test_seeded_sampling_is_reproducible_and_independent_of_neighbours(model):
    rng = random.Random(3)
    p, other = rand_prompt(rng, 12), rand_prompt(rng, 30)
    params = dict(temperature=1.0, top_p=0.9, top_k=50)

    def run(neighbours: int, seed: int) -> list[int]:
        engine, fe = make_engine(model)
        extra = [fe.submit(other, 40, temperature=0.8, seed=100 + i) for i in range(neighbours)]
        s = fe.submit(p, 30, seed=seed, **params)
        return drain(engine, fe, extra + [s])[s].tokens

    alone = run(0, 42)
    assert run(0, 42) == alone
    assert run(3, 42) == alone
    assert run(0, 43) != alone


def test_sampling_params_shape_the_distribution(model):
    rng = random.Random(4)
    p = rand_prompt(rng, 8)
    engine, fe = make_engine(model)
    greedy = greedy_generate(model, p, 16)
    s_k1 = fe.submit(p, 16, temperature=1.5, top_k=1, seed=1)          # top-k 1 is greedy
    s_p = fe.submit(p, 16, temperature=1.5, top_p=1e-6, seed=2)        # nucleus of one token too
    s_t = fe.submit(p, 16, temperature=0.0, seed=3)
    res = drain(engine, fe, [s_k1, s_p, s_t])
    assert res[s_k1].tokens == greedy and res[s_p].tokens == greedy and res[s_t].tokens == greedy


def test_executor_failure_ends_the_batch_with_internal_error_and_keeps_serving(model):
    class Flaky(CpuRunner):
        fail_next = False

        def run(self, batch):
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("simulated kernel failure")
            return super().run(batch)

    cfg = model.config
    runner = Flaky(model, KVPool(KVCacheConfig(256, 4, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)))
    engine, fe = make_engine(model, runner=runner)
    rng = random.Random(5)
    p1, p2 = rand_prompt(rng, 10), rand_prompt(rng, 10)
    a = fe.submit(p1, 20)
    engine.step()
    runner.fail_next = True
    engine.step()
    assert fe.done(a)
    r = fe.collect(a)
    assert (r.finish, r.error) == (FinishReason.ERROR, ErrorCode.INTERNAL)
    b = fe.submit(p2, 5)
    assert drain(engine, fe, [b])[b].tokens == greedy_generate(model, p2, 5)
    assert engine.scheduler.allocator.free_count == engine.scheduler.allocator.num_blocks


def test_context_limit_ends_with_length(model):
    rng = random.Random(6)
    p = rand_prompt(rng, 30)
    engine, fe = make_engine(model, max_len=40)
    s = fe.submit(p, 100)
    r = drain(engine, fe, [s])[s]
    assert r.finish == FinishReason.LENGTH and r.tokens == greedy_generate(model, p, 10)
    long = fe.submit(rand_prompt(rng, 40), 5)
    r = drain(engine, fe, [long])[long]
    assert (r.finish, r.error) == (FinishReason.ERROR, ErrorCode.PROMPT_TOO_LONG)


def test_new_arrival_starts_within_one_decode_step(model):
    rng = random.Random(7)
    engine, fe = make_engine(model)
    first = fe.submit(rand_prompt(rng, 10), 50)
    for _ in range(5):
        engine.step()
    late = fe.submit(rand_prompt(rng, 10), 5)
    engine.step()                                   # decode paused for one step: the newcomer prefills
    assert engine.scheduler.prev_kind == StepKind.PREFILL and len(fe.tokens_so_far(late)) == 1
    before = len(fe.tokens_so_far(first))
    engine.step()                                   # and decode resumes for both
    assert len(fe.tokens_so_far(first)) == before + 1 and len(fe.tokens_so_far(late)) == 2
    drain(engine, fe, [first, late])


def test_cpu_executor_sizes_its_pool_and_caps_the_context(model):
    ex = CpuExecutor(ExecutorOptions(kv_cache_mb=1, block_size=16), model=model)
    cfg = model.config
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    assert ex.pool.config.num_blocks == 1024 * 1024 // per_block
    assert ex.max_model_len == min(cfg.max_position_embeddings, ex.pool.config.num_blocks * 16)
    assert ex.vocab_size == cfg.vocab_size and ex.eos_ids == cfg.eos_token_ids


def test_an_engine_bug_ends_requests_with_internal_error_and_serving_goes_on(model):
    import threading
    engine, fe = make_engine(model)
    rng = random.Random(8)
    a = fe.submit(rand_prompt(rng, 5), 50)
    engine.step()
    engine.scheduler.schedule = lambda: 1 / 0     # sabotage: a bug outside the runner
    assert engine._safe_step()
    del engine.scheduler.schedule
    r = fe.collect(a)
    assert (r.finish, r.error) == (FinishReason.ERROR, ErrorCode.INTERNAL)
    assert not engine.owned and engine.scheduler.allocator.free_count == engine.scheduler.allocator.num_blocks
    p = rand_prompt(rng, 6)
    b = fe.submit(p, 4)
    stop = threading.Event()
    t = threading.Thread(target=engine.serve, args=(stop,))
    t.start()
    try:
        r = fe.wait(b)
    finally:
        stop.set()
        t.join()
    assert r.tokens == greedy_generate(model, p, 4)
