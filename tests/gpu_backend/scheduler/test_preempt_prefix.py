"""Issue 23: a running request preempted to make room frees blocks that a waiting request's
prefix-cache hit then takes back. Those blocks were held when the policy's input was taken
(not in cached_idle), so the policy counted them both as freed for the new blocks and as the
hit: the plan asked for more blocks than exist (kv_cache MemoryError). A plan never needs more
blocks than are free; a request that does not fit waits, and nothing is lost."""
from __future__ import annotations

import random

import pytest

from gpu_backend.scheduler import PolicyConfig, SamplingParams, Scheduler, Sequence
from gpu_backend.scheduler.policy import PolicyInput, SchedPolicy, StepKind, WaitingReq, RunningReq, plan_step


class Clock:
    def __init__(self):
        self.t = 1_000_000

    def __call__(self) -> int:
        self.t += 1000
        return self.t


def seq(slot: int, prompt: list[int], max_tokens: int = 8, **kw) -> Sequence:
    return Sequence(slot=slot, seq=slot, epoch=0, prompt=list(prompt), max_tokens=max_tokens,
                    params=SamplingParams(), stop_ids=frozenset(), max_len=4096, **kw)


def step(sched: Scheduler):
    out = sched.schedule()
    sched.update(out.batch)
    for c in out.batch.chunks:
        if c.sample:
            c.seq.output.append(7)
    for s in list(sched.running):
        if len(s.output) >= s.max_tokens:
            sched.remove(s)
    return out


def test_lvf_preemption_for_a_hit_on_the_victims_blocks_fits_the_pool():
    """A (10 tokens: 2 full blocks cached + a partial one) and C (10 unrelated tokens) decode in a
    7-block pool, 1 block free; B (24 tokens) shares A's first 8, lags its TTFT and takes A's seat.
    Preempting A frees 3 blocks, 2 of which are B's hit: 1 + 3 - 2 = 2 blocks are left for B's
    new ones, not 4."""
    clock = Clock()
    sched = Scheduler(PolicyConfig(2, 64, 4, policy=SchedPolicy.LVF), 7, clock_us=clock)
    prefix = list(range(8))
    t0 = clock.t
    a = seq(0, prefix + [100, 101], 3, arrival_us=t0 + 10)
    c = seq(2, list(range(300, 310)), 3, arrival_us=t0)    # earlier arrival: A is LVF's tail, the victim
    sched.add(a)
    sched.add(c)
    step(sched)                                     # both prefill
    step(sched)                                     # both decode (the previous step was a PREFILL)
    assert len(a.blocks) == len(c.blocks) == 3 and sched.free_blocks == 1
    b = seq(1, prefix + list(range(200, 216)), 1, arrival_us=t0)
    sched.add(b)
    out = step(sched)                               # was: MemoryError (4 KV blocks asked, 2 free)
    assert [s.slot for s in out.preempted] == [0]
    (chunk,) = out.batch.chunks
    assert chunk.seq is b and chunk.start == 8 and chunk.num_tokens == 8    # 2 new blocks, not 4
    assert sched.free_blocks == 0
    for _ in range(200):                            # nothing lost: all finish
        if not sched.has_work():
            break
        step(sched)
    assert not sched.has_work() and (len(a.output), len(b.output), len(c.output)) == (3, 1, 3)
    assert sched.free_blocks == 7 and sched.allocator.extra_refs == 0


def test_policy_counts_hit_blocks_a_victim_frees():
    """The same step as a PolicyInput: B's hit (2 blocks) is held by A, not idle."""
    cfg = PolicyConfig(2, 64, 4, policy=SchedPolicy.LVF)
    inp = PolicyInput(waiting=(WaitingReq(1, 24, 8, 0, 0, 0),),
                      running=(RunningReq(2, 12, 11, 3, 0, 0, 4000), RunningReq(0, 12, 11, 3, 0, 10, 4000)),
                      free_blocks=1, prev_kind=StepKind.DECODE, now_us=10000)
    plan = plan_step(inp, cfg)
    assert plan.preempted == (0,) and plan.admitted == (1,)
    assert plan.prefill == ((1, 8),) and plan.new_blocks == ((1, 2),)


def test_a_hit_on_blocks_claimed_by_a_request_not_admitted_is_counted():
    """Idle hit blocks count once in the queue, for the first request hitting them. PRIORITY admits
    the second first; if the first is not admitted in that step, the second's taking them must
    still leave the free count."""
    cfg = PolicyConfig(2, 64, 4, policy=SchedPolicy.PRIORITY)
    # queue: w1 (priority 1) claims the 2 idle blocks; w2 (priority 0, better) hits the same ones
    inp = PolicyInput(waiting=(WaitingReq(1, 40, 8, 2, 1, 0), WaitingReq(2, 20, 8, 0, 0, 1),
                               WaitingReq(3, 16, 0, 0, 0, 2)),
                      running=(), free_blocks=8, prev_kind=StepKind.IDLE)
    plan = plan_step(inp, cfg)
    # w2 takes the 2 idle blocks + 3 new; 3 are left for w3's 4 (was: all 4, one block too many)
    assert plan.admitted == (2, 3) and plan.prefill == ((2, 12), (3, 12))
    assert plan.new_blocks == ((2, 3), (3, 3))


@pytest.mark.parametrize("policy", list(SchedPolicy), ids=lambda p: p.name.lower())
@pytest.mark.parametrize("seed", range(12))
def test_no_plan_over_allocates_with_shared_prefixes_in_a_tight_pool(policy, seed):
    """Random arrivals sharing two prefixes, mixed priorities and SLOs, a pool that fits one
    request at a time plus a little: every step allocates without MemoryError and every
    request gets all its tokens."""
    rng = random.Random(seed)
    clock = Clock()
    bs, max_len = 4, 64
    sched = Scheduler(PolicyConfig(4, 32, bs, policy=policy, lvf_xfer_blocks=8), max_len // bs + 3,
                      clock_us=clock)
    prefixes = [[rng.randrange(1000) for _ in range(21)], [rng.randrange(1000) for _ in range(13)]]
    pending = []
    for i in range(20):
        tail = [rng.randrange(1000) for _ in range(rng.randrange(1, 12))]
        prompt = prefixes[i % 2] + tail if i % 5 else [rng.randrange(1000) for _ in range(rng.randrange(5, 30))]
        pending.append(seq(i, prompt, rng.randrange(2, 20), priority=rng.randrange(-2, 3),
                           ttft_slo_us=rng.choice([0, 5000, 50000]), tbt_slo_us=rng.choice([0, 2000])))
    added = []
    for _ in range(5000):
        if pending and rng.random() < 0.3:
            added.append(pending.pop(0))
            added[-1].arrival_us = clock.t
            sched.add(added[-1])
        step(sched)
        if not pending and not sched.has_work():
            break
    assert not pending and not sched.has_work() and len(added) == 20
    assert all(len(s.output) == s.max_tokens for s in added)
    assert sched.free_blocks == max_len // bs + 3 and sched.allocator.extra_refs == 0
