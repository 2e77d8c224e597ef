"""policy.plan_step under PRIORITY and LVF (rule 0): orders, preemption for waiting
requests, the VLT formula, SuperInfer's Fig. 9 rotation, and simulated workloads."""
from __future__ import annotations

import json
import random

from gpu_backend.scheduler.policy import (PolicyConfig, PolicyInput, RunningReq, Scenario, SchedPolicy, StepKind,
                                          WaitingReq, order_requests, plan_step, vlt_running, vlt_waiting)
from gpu_backend.scheduler.policy_sim import random_scenario

MS = 1000   # microseconds


def prio(**kw):
    return PolicyConfig(max_batch_size=kw.pop("batch", 4), max_prefill_tokens=64, block_size=4,
                        policy=SchedPolicy.PRIORITY, **kw)


def lvf(**kw):
    return PolicyConfig(max_batch_size=kw.pop("batch", 8), max_prefill_tokens=64, block_size=4,
                        policy=SchedPolicy.LVF, **kw)


def W(i, n, p=0, arr=0, last=-1, ttft=0, tbt=0):
    return WaitingReq(i, n, 0, 0, p, arr, last, ttft, tbt)


def D(i, computed, p=0, arr=0, run=0):
    """A decoder whose next token fits its blocks."""
    return RunningReq(i, computed + 1, computed, (computed + 4) // 4, p, arr, run)


def test_priority_orders_waiting_by_priority_then_arrival():
    waiting = (W(1, 3, p=1, arr=0), W(2, 3, p=0, arr=5), W(3, 3, p=-2, arr=9), W(4, 3, p=0, arr=2))
    plan = plan_step(PolicyInput(waiting, (), 100), prio())
    assert plan.admitted == (3, 4, 2, 1)
    # FCFS keeps the queue order with the same input
    assert plan_step(PolicyInput(waiting, (), 100), PolicyConfig(4, 64, 4)).admitted == (1, 2, 3, 4)


def test_priority_preempts_worse_running_when_seats_are_short():
    running = (D(10, 5, p=2, arr=0), D(11, 5, p=0, arr=1), D(12, 5, p=1, arr=2), D(13, 5, p=2, arr=3))
    plan = plan_step(PolicyInput((W(1, 3, p=0, arr=9),), running, 100, StepKind.DECODE), prio())
    assert plan.kind == StepKind.PREFILL
    assert plan.preempted == (13,)                 # the worst key: priority 2, latest arrival
    assert plan.admitted == (1,)
    # an equal priority waits (arrival breaks the tie: the running one came first)
    plan = plan_step(PolicyInput((W(1, 3, p=2, arr=9),), running, 100, StepKind.DECODE), prio())
    assert plan.kind == StepKind.DECODE and plan.preempted == () and plan.decode == (11, 12, 10, 13)


def test_priority_preempts_for_memory_only_when_that_makes_room():
    running = (D(10, 7, p=3), D(11, 7, p=0))       # 2 blocks each, none free
    need_4 = W(1, 16, p=1, arr=5)                   # 4 blocks: only 10's 2 can go -> no preemption
    plan = plan_step(PolicyInput((need_4,), running, 0, StepKind.DECODE), prio())
    assert plan.preempted == () and plan.kind == StepKind.DECODE
    need_2 = W(1, 8, p=1, arr=5)
    plan = plan_step(PolicyInput((need_2,), running, 0, StepKind.DECODE), prio())
    assert plan.preempted == (10,) and plan.prefill == ((1, 8),)


def test_priority_decode_victims_are_the_worst_priority():
    cfg = prio()
    # 12 tokens computed in 3 blocks: each decoder needs a fourth block, one is free
    running = (RunningReq(1, 13, 12, 3, 0, 0), RunningReq(2, 13, 12, 3, 5, 1), RunningReq(3, 13, 12, 3, 1, 2))
    plan = plan_step(PolicyInput((), running, 1, StepKind.DECODE), cfg)
    assert plan.preempted == (2,)
    assert plan.decode == (1, 3)


def test_vlt_formula():
    cfg = lvf()
    now = 10_000 * MS
    # waiting: ReLU(now - arrival - beta_F * TTFT SLO), beta_F = 0.5
    assert vlt_waiting(W(1, 1, arr=4000 * MS, ttft=2000 * MS), now, cfg) == 5000 * MS
    assert vlt_waiting(W(1, 1, arr=9000 * MS, ttft=4000 * MS), now, cfg) == 0
    # rotary: alpha * ReLU(now - last - beta_B * TBT SLO), alpha = 3, beta_B = 0
    assert vlt_waiting(W(1, 1, arr=0, last=9900 * MS, tbt=100 * MS), now, cfg) == 300 * MS
    neg = lvf(lvf_beta_b_milli=-1500)               # a negative tolerance rounds down, as in C
    assert vlt_waiting(W(1, 1, last=now, tbt=7), now, neg) == 3 * 11
    # running: -(now - run)
    assert vlt_running(D(1, 4, run=7000 * MS), now) == -3000 * MS


def test_lvf_falls_back_to_fcfs_without_contention():
    running = (D(10, 5, run=0), D(11, 5, run=0))
    waiting = (W(1, 3, arr=0, ttft=10), W(2, 3, arr=50, ttft=10))
    inp = PolicyInput(waiting, running, 100, StepKind.DECODE, now_us=10_000)
    assert order_requests(inp, lvf()) == (running, waiting, ())
    assert plan_step(inp, lvf()).admitted == (1, 2)


def test_fig9_rotation_four_requests_memory_for_two():
    """SuperInfer Fig. 9's setting: 4 requests, KV memory for 2, a transfer budget of one
    request's blocks per step. Each decision prioritizes the largest VLT and rotates out the
    running request with the smallest (most negative) one; alpha = 3 brings a rotary request
    back before a fresh one that lags less than three times as long."""
    cfg = lvf(lvf_xfer_blocks=2)
    slo = 20 * MS                                   # TTFT SLO: tolerance beta_F * 20 ms = 10 ms
    a_, b_ = D(1, 7, arr=0, run=0), D(2, 7, arr=1, run=10 * MS)
    c_, d_ = W(3, 8, arr=0, ttft=slo), W(4, 8, arr=20 * MS, ttft=slo)
    # t = 40 ms. VLT: C 30, D 10, B -30, A -40 (ms) -> C in, A out
    plan = plan_step(PolicyInput((c_, d_), (a_, b_), 0, StepKind.DECODE, 40 * MS), cfg)
    assert (plan.kind, plan.preempted, plan.admitted) == (StepKind.PREFILL, (1,), (3,))
    assert plan.prefill == ((3, 8),)
    # t = 60 ms, C runs since 40. VLT: A rotary 3 * (60 - 40) = 60, D 30, C -20, B -50 -> A back, B out
    a_rot = W(1, 8, arr=0, last=40 * MS, tbt=100 * MS)
    c_run = D(3, 7, arr=0, run=40 * MS)
    inp = PolicyInput((a_rot, d_), (b_, c_run), 0, StepKind.DECODE, 60 * MS)
    assert [vlt_waiting(w, inp.now_us, cfg) // MS for w in inp.waiting] == [60, 30]
    assert [vlt_running(r, inp.now_us) // MS for r in inp.running] == [-50, -20]
    plan = plan_step(inp, cfg)
    assert (plan.preempted, plan.admitted) == ((2,), (1,))
    # t = 80 ms. VLT: B rotary 3 * 20 = 60, D 50, A -20, C -40 -> B back, C out
    b_rot = W(2, 8, arr=1, last=60 * MS, tbt=100 * MS)
    a_run = D(1, 7, arr=0, run=60 * MS)
    plan = plan_step(PolicyInput((b_rot, d_), (c_run, a_run), 0, StepKind.DECODE, 80 * MS), cfg)
    assert (plan.preempted, plan.admitted) == ((3,), (2,))
    # t = 85 ms, D has lagged longest now: VLT D 55 > C rotary 3 * 5 = 15 -> D in, A out
    c_rot = W(3, 8, arr=0, last=80 * MS, tbt=100 * MS)
    b_run = D(2, 7, arr=1, run=80 * MS)
    plan = plan_step(PolicyInput((c_rot, d_), (a_run, b_run), 0, StepKind.DECODE, 85 * MS), cfg)
    assert (plan.preempted, plan.admitted) == ((1,), (4,))


def test_lvf_never_preempts_a_prefilling_request():
    cfg = lvf(batch=1)
    prefilling = RunningReq(1, 40, 8, 2, 0, 0, 0)
    late = W(2, 4, arr=0, ttft=10)
    plan = plan_step(PolicyInput((late,), (prefilling,), 100, StepKind.PREFILL, 10**9), cfg)
    assert plan.preempted == () and plan.prefill == ((1, 32),)


def test_policy_fields_round_trip_as_json():
    inp = PolicyInput((W(1, 9, p=-1, arr=5, last=7, ttft=100, tbt=30), W(2, 3)),
                      (D(3, 4, p=2, arr=1, run=4), D(4, 2)), 12, StepKind.DECODE, 99)
    cfg = lvf(lvf_beta_b_milli=-250)
    sc = Scenario(cfg, name="rt")
    sc.record(inp, plan_step(inp, cfg))
    back = Scenario.from_json(json.loads(json.dumps(sc.to_json())))
    assert back.config == cfg and back.steps == sc.steps and not back.mismatches()


def test_simulated_workloads_keep_the_invariants_under_every_policy():
    for policy in (SchedPolicy.PRIORITY, SchedPolicy.LVF):
        rng = random.Random(99)
        preempted = 0
        for i in range(25):
            sc = random_scenario(rng, name=str(i), policy=policy)   # simulate() raises on any violation
            assert sc.steps and not sc.mismatches()
            preempted += sum(len(p.preempted) for _, p in sc.steps)
        assert preempted > 0, policy
