"""policy.plan_step: the batching rules, one by one, plus simulated workloads."""
from __future__ import annotations

import json
import pathlib
import random

import pytest

from gpu_backend.scheduler.policy import (PolicyConfig, PolicyInput, RunningReq, Scenario, StepKind, StepPlan, WaitingReq,
                                plan_step)
from gpu_backend.scheduler.policy_sim import SimRequest, random_scenario, simulate

DATA = pathlib.Path(__file__).parents[1] / "data"    # tests/gpu_backend/data: the CUDA diff tests replay it too
CFG = PolicyConfig(max_batch_size=4, max_prefill_tokens=64, block_size=4)


def W(i, n):
    return WaitingReq(i, n)


def D(i, computed, blocks=None):
    """A decoder: one token pending."""
    return RunningReq(i, computed + 1, computed, (computed + 4) // 4 if blocks is None else blocks)


def test_fcfs_admission_in_queue_order():
    plan = plan_step(PolicyInput((W(7, 3), W(2, 5), W(9, 1)), (), 100), CFG)
    assert plan.kind == StepKind.PREFILL
    assert plan.admitted == (7, 2, 9)
    assert plan.prefill == ((7, 3), (2, 5), (9, 1))
    assert plan.new_blocks == ((7, 1), (2, 2), (9, 1))


def test_blocked_head_is_not_overtaken():
    # 2 free blocks: request 1 (12 tokens, 3 blocks) gets a chunk of 8, request 2 must not jump it
    plan = plan_step(PolicyInput((W(1, 12), W(2, 1)), (), 2), CFG)
    assert plan.prefill == ((1, 8),) and plan.admitted == (1,)
    plan = plan_step(PolicyInput((W(1, 12), W(2, 1)), (), 0), CFG)
    assert plan.kind == StepKind.IDLE and plan.admitted == ()


def test_max_batch_size_limits_admissions():
    running = (D(1, 5), D(2, 5), D(3, 5))
    plan = plan_step(PolicyInput((W(4, 2), W(5, 2)), running, 100, StepKind.DECODE), CFG)
    assert plan.admitted == (4,)
    full = running + (D(4, 5),)
    plan = plan_step(PolicyInput((W(5, 2),), full, 100, StepKind.DECODE), CFG)
    assert plan.kind == StepKind.DECODE and plan.decode == (1, 2, 3, 4)


def test_max_prefill_tokens_chunks_long_prompts():
    cfg = PolicyConfig(max_batch_size=8, max_prefill_tokens=10, block_size=4)
    plan = plan_step(PolicyInput((W(1, 25), W(2, 3)), (), 100), cfg)
    assert plan.prefill == ((1, 10),) and plan.admitted == (1,)
    # the continuation comes first, the rest of the budget goes to the next in line
    cont = RunningReq(1, 25, 20, 5)
    plan = plan_step(PolicyInput((W(2, 3),), (cont,), 100), cfg)
    assert plan.prefill == ((1, 5), (2, 3)) and plan.admitted == (2,)
    assert plan.new_blocks == ((1, 2), (2, 1))


def test_new_arrival_starts_within_one_decode_step():
    running = (D(1, 9), D(2, 3))
    after_decode = plan_step(PolicyInput((W(3, 6),), running, 100, StepKind.DECODE), CFG)
    assert after_decode.kind == StepKind.PREFILL and after_decode.prefill == ((3, 6),)
    assert after_decode.decode == ()                     # decode pauses for this step
    # right after a prefill step, decode resumes even though another request waits
    after_prefill = plan_step(PolicyInput((W(4, 6),), running + (D(3, 6),), 100, StepKind.PREFILL), CFG)
    assert after_prefill.kind == StepKind.DECODE and after_prefill.decode == (1, 2, 3)
    # with nobody decoding, prefill steps may follow each other
    alone = plan_step(PolicyInput((W(4, 6),), (), 100, StepKind.PREFILL), CFG)
    assert alone.kind == StepKind.PREFILL


def test_preemption_victim_order_and_self_preemption():
    # 1, 2, 3 each need a fresh block (computed % 4 == 0), none free: 3 (newest) goes to 1,
    # then 2 is the newest alive and preempts itself
    running = (D(1, 8, 2), D(2, 4, 1), D(3, 4, 1))
    plan = plan_step(PolicyInput((), running, 0, StepKind.DECODE), CFG)
    assert plan == StepPlan(StepKind.DECODE, decode=(1,), preempted=(3, 2), new_blocks=((1, 1),))
    # with one free block, 1 takes it, 2 takes 3's block, 3 is gone
    plan = plan_step(PolicyInput((), running, 1, StepKind.DECODE), CFG)
    assert plan == StepPlan(StepKind.DECODE, decode=(1, 2), preempted=(3,), new_blocks=((1, 1), (2, 1)))
    # decoders that fit their current block need nothing and preempt nobody
    plan = plan_step(PolicyInput((), (D(1, 5, 2), D(2, 6, 2)), 0, StepKind.DECODE), CFG)
    assert plan.preempted == () and plan.decode == (1, 2) and plan.new_blocks == ((1, 0), (2, 0))


def test_partial_prefill_can_be_a_victim():
    running = (D(1, 8, 2), RunningReq(2, 30, 8, 2))     # 2 is prefilling (chunked), newer
    plan = plan_step(PolicyInput((), running, 0, StepKind.PREFILL), CFG)
    assert plan.kind == StepKind.DECODE and plan.preempted == (2,) and plan.decode == (1,)


def test_admission_keeps_a_block_for_each_growing_decoder():
    running = (D(1, 8, 2), D(2, 7, 2))                 # 1 needs a block next step, 2 does not
    plan = plan_step(PolicyInput((W(3, 8),), running, 2, StepKind.DECODE), CFG)
    assert plan.prefill == ((3, 4),) and plan.new_blocks == ((3, 1),)
    plan = plan_step(PolicyInput((W(3, 8),), running, 1, StepKind.DECODE), CFG)
    assert plan.kind == StepKind.DECODE                # no room beyond the reserve: decode instead


def test_deadlock_between_prefills_preempts_the_newest():
    running = (RunningReq(1, 30, 8, 2), RunningReq(2, 30, 8, 2))
    plan = plan_step(PolicyInput((), running, 0, StepKind.PREFILL), CFG)
    assert plan == StepPlan(StepKind.IDLE, preempted=(2,))


def test_idle_when_nothing_to_do():
    assert plan_step(PolicyInput((), (), 10), CFG) == StepPlan(StepKind.IDLE)


def test_json_round_trip():
    inp = PolicyInput((W(3, 6),), (D(1, 9), RunningReq(2, 30, 8, 2)), 17, StepKind.DECODE)
    plan = plan_step(inp, CFG)
    assert PolicyInput.from_json(json.loads(json.dumps(inp.to_json()))) == inp
    assert StepPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


def test_config_rejects_nonsense():
    with pytest.raises(ValueError):
        PolicyConfig(max_batch_size=0)
    with pytest.raises(ValueError):
        PolicyConfig(block_size=-1)


def test_simulated_workloads_keep_the_invariants():
    rng = random.Random(1234)
    for i in range(150):
        sc = random_scenario(rng, name=str(i))     # simulate() raises SimError on any violation
        assert sc.steps and not sc.mismatches()


def test_simulated_arrival_latency_is_one_decode_step():
    # roomy pool and seats: every request's first prefill is at most one step after it arrives
    cfg = PolicyConfig(max_batch_size=64, max_prefill_tokens=4096, block_size=16)
    reqs = [SimRequest(i, 3 * i, 20, 200) for i in range(20)]
    sc = simulate(reqs, cfg, num_blocks=1000)
    first = {}
    for step, (_, plan) in enumerate(sc.steps):
        for i in plan.admitted:
            first.setdefault(i, step)
    assert all(first[r.id] - r.arrival_step <= 1 for r in reqs)


def test_tiny_pool_finishes_everything_with_preemptions():
    cfg = PolicyConfig(max_batch_size=8, max_prefill_tokens=32, block_size=4)
    reqs = [SimRequest(i, 0, 10, 30) for i in range(6)]
    sc = simulate(reqs, cfg, num_blocks=12)
    assert sum(len(p.preempted) for _, p in sc.steps) > 0


def test_recorded_scenarios_replay():
    """Golden scenarios (also what the CUDA scheduler's diff test replays) still hold."""
    files = sorted(DATA.glob("policy-scenario-*.json"))
    assert files
    for f in files:
        sc = Scenario.from_json(json.loads(f.read_text()))
        assert sc.mismatches() == [], f.name
