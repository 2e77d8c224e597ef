"""PRIORITY and LVF scheduling through the engine with the real embedded SmolLM2 (float32):
the slot's priority and SLO fields reach the scheduler, better / lagging requests preempt
running ones, and every token of a preempted request equals an unpreempted greedy run."""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from gpu_backend import cpu_kernels
from gpu_backend.engine import Engine, EngineConfig
from gpu_backend.executors.cpu import CpuRunner
from gpu_backend.kv_pool import KVCacheConfig, KVPool
from gpu_backend.model import greedy_generate
from gpu_backend.scheduler.intake import IntakeConfig
from gpu_backend.scheduler.policy import PolicyConfig, SchedPolicy
from shared_layout import FinishReason, Ring, RingGeometry, SlotState

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from frontend_player import FrontendPlayer  # noqa: E402

GEOM = RingGeometry(16, 8192, 8192)
CHATS = ["What is the capital of France?", "Name three colors.", "Count from one to five.",
         "Why is the sky blue?"]
NEW = 16


@pytest.fixture(scope="module")
def smollm2():
    from tokenizers import Tokenizer

    from gpu_backend.model.loader import load_model, prepare_default_model
    tok = Tokenizer.from_file(str(prepare_default_model() / "tokenizer.json"))
    prompts = [tok.encode(f"<|im_start|>user\n{c}<|im_end|>\n<|im_start|>assistant\n").ids for c in CHATS]
    n = torch.get_num_threads()
    torch.set_num_threads(1)          # the shared 2-core box
    model = load_model("default", torch.float32).model
    # ignore_eos below: every request runs its NEW tokens, so preemptions land mid-output
    wants = [greedy_generate(model, p, NEW) for p in prompts]
    yield model, prompts, wants
    torch.set_num_threads(n)


def make_engine(model, policy: SchedPolicy, ttft_slo_ms: int = 5000):
    ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    cfg = model.config
    pool = KVPool(KVCacheConfig(64, 16, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim))
    engine = Engine(ring, CpuRunner(model, pool, cpu_kernels.load()),
                    EngineConfig(PolicyConfig(2, 256, 16, policy=policy), 64),
                    IntakeConfig(cfg.vocab_size, 1024, (2,), ttft_slo_ms=ttft_slo_ms))
    return engine, FrontendPlayer(ring)


def run(engine, fe, submit_later, steps=4000):
    """Step until every request ends; `submit_later(step)` may submit more. Returns
    (results by slot, slots seen DECODE_PAUSED)."""
    res, paused, slots = {}, set(), list(fe.inflight)
    for step in range(steps):
        slots += submit_later(step)
        engine.step()
        paused.update(int(s) for s in (engine.ring.state == SlotState.DECODE_PAUSED).nonzero()[0])
        for s in [s for s in list(fe.inflight) if fe.done(s)]:
            res[s] = fe.collect(s)
        if len(res) == len(slots) and step > 10:
            return res, paused
    raise AssertionError("requests did not finish")


def test_priority_preempts_worse_requests_and_loses_nothing(smollm2):
    model, prompts, wants = smollm2
    engine, fe = make_engine(model, SchedPolicy.PRIORITY)
    low = [fe.submit(prompts[i], NEW, priority=5, ignore_eos=True) for i in (0, 1)]
    late = {}

    def submit_later(step):
        if step == 6:                 # both low ones are decoding, both seats taken
            late["hi"] = fe.submit(prompts[2], NEW, priority=-1, ignore_eos=True)
            return [late["hi"]]
        return []
    res, paused = run(engine, fe, submit_later)
    assert paused & set(low), "a priority-5 request should have been preempted for the priority -1 one"
    hi = late["hi"]
    assert res[hi].finish == FinishReason.LENGTH and res[hi].tokens == wants[2]
    for s, i in zip(low, (0, 1)):
        assert res[s].tokens == wants[i], f"request {i}"
    assert engine.scheduler.allocator.free_count == 64


def test_lvf_rotates_lagging_requests_in_and_loses_nothing(smollm2):
    model, prompts, wants = smollm2
    engine, fe = make_engine(model, SchedPolicy.LVF)
    first = [fe.submit(prompts[i], NEW, ignore_eos=True, ttft_slo_ms=60_000) for i in (0, 1)]
    late = []

    def submit_later(step):
        if step == 4:                 # tight targets: they lag at once, the running ones rotate out
            late.extend(fe.submit(prompts[i], NEW, ignore_eos=True, ttft_slo_ms=1) for i in (2, 3))
            return list(late)
        return []
    res, paused = run(engine, fe, submit_later)
    assert paused, "LVF should have rotated running requests out"
    for s, i in zip(first + late, range(4)):
        assert res[s].finish == FinishReason.LENGTH and res[s].tokens == wants[i], f"request {i}"
    # the preempted requests took their full blocks back from the prefix cache (no recompute)
    assert engine.scheduler.stats.hit_tokens > 0
    assert engine.scheduler.allocator.free_count == 64
