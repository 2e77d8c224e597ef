"""Policy simulator: drives policy.plan_step over a synthetic workload with no
model and records every decision as a Scenario (JSON) for the C++ twin.

    SimRequest list (arrival step, prompt length, output length, cancel step,
      priority, TTFT / TBT SLOs)
      -> per step: arrivals, cancellations, plan_step, apply the plan to
         integer state (block counts, computed tokens, outputs) -> Scenario

The clock advances STEP_US per step (now_us = step * STEP_US), so LVF's
Virtual Lag Times are deterministic. Every policy (FCFS, PRIORITY, LVF) runs
here; the invariants (no over-allocation, every request finishes, no block
leaked) hold for each.

    python -m gpu_backend.policy_sim --out DIR [--count N] [--seed S]

writes DIR/policy-scenario-<i>.json: mixed configurations, tiny KV pools that
force preemption, arrivals during decode, cancellations.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import random

from .policy import (PolicyConfig, PolicyInput, RunningReq, Scenario, SchedPolicy, StepKind, WaitingReq,
                     blocks_needed, plan_step)

STEP_US = 10_000     # simulated time per step


@dataclasses.dataclass(frozen=True)
class SimRequest:
    id: int
    arrival_step: int
    prompt_len: int
    output_len: int               # tokens generated before it finishes
    cancel_step: int | None = None
    priority: int = 0
    ttft_slo_us: int = 0
    tbt_slo_us: int = 0


class SimError(AssertionError):
    """The policy broke an invariant (over-allocation, a stuck queue)."""


def simulate(requests: list[SimRequest], cfg: PolicyConfig, num_blocks: int, name: str = "",
             max_steps: int = 100_000) -> Scenario:
    """Run the workload to completion; every (input, plan) is recorded."""
    for r in requests:
        if r.prompt_len + r.output_len > num_blocks * cfg.block_size:
            raise ValueError(f"request {r.id} cannot fit the pool alone")
    sc = Scenario(cfg, name=name)
    arrivals = collections.defaultdict(list)
    for r in sorted(requests, key=lambda r: (r.arrival_step, r.id)):
        arrivals[r.arrival_step].append(r)
    by_id = {r.id: r for r in requests}
    waiting: collections.deque[list[int]] = collections.deque()       # [id, num_tokens]
    running: list[dict] = []
    generated = {r.id: 0 for r in requests}
    last_us = {r.id: -1 for r in requests}                            # latest token's time
    free, prev, done = num_blocks, StepKind.IDLE, set()
    for step in range(max_steps):
        if len(done) == len(requests):
            if free != num_blocks:
                raise SimError(f"{num_blocks - free} blocks leaked")
            return sc
        for r in arrivals.get(step, ()):
            waiting.append([r.id, r.prompt_len])
        for r in requests:                                             # cancellations
            if r.cancel_step == step and r.id not in done:
                done.add(r.id)
                waiting = collections.deque(w for w in waiting if w[0] != r.id)
                for x in [x for x in running if x["id"] == r.id]:
                    free += x["blocks"]
                    running.remove(x)
        now = step * STEP_US
        inp = PolicyInput(tuple(WaitingReq(i, n, 0, 0, by_id[i].priority, by_id[i].arrival_step * STEP_US,
                                           last_us[i], by_id[i].ttft_slo_us, by_id[i].tbt_slo_us)
                                for i, n in waiting),
                          tuple(RunningReq(x["id"], x["tokens"], x["computed"], x["blocks"], by_id[x["id"]].priority,
                                           by_id[x["id"]].arrival_step * STEP_US, x["run_us"]) for x in running),
                          free, prev, now)
        plan = plan_step(inp, cfg)
        sc.record(inp, plan)
        for vid in plan.preempted:
            x = next(x for x in running if x["id"] == vid)
            running.remove(x)
            free += x["blocks"]
            waiting.appendleft([vid, x["tokens"]])
        for aid in plan.admitted:
            i, n = next(w for w in waiting if w[0] == aid)
            if cfg.policy == SchedPolicy.FCFS and waiting[0][0] != aid:
                raise SimError(f"admitted {aid} but {waiting[0][0]} heads the queue")
            waiting.remove([i, n])
            running.append(dict(id=i, tokens=n, computed=0, blocks=0, run_us=now))
        table = {x["id"]: x for x in running}
        for i, n in plan.new_blocks:
            table[i]["blocks"] += n
            free -= n
        if free < 0:
            raise SimError(f"step {step}: over-allocated by {-free} blocks")
        if len(running) > cfg.max_batch_size:
            raise SimError(f"step {step}: {len(running)} running > max_batch_size")
        if sum(n for _, n in plan.prefill) > cfg.max_prefill_tokens:
            raise SimError(f"step {step}: prefill budget exceeded")
        for i, n in list(plan.prefill) + [(i, 1) for i in plan.decode]:
            x = table[i]
            x["computed"] += n
            if blocks_needed(x["computed"], cfg.block_size) > x["blocks"]:
                raise SimError(f"step {step}: request {i} computed past its blocks")
            if x["computed"] == x["tokens"]:
                generated[i] += 1
                last_us[i] = now
                x["tokens"] += 1
                if generated[i] >= by_id[i].output_len:
                    done.add(i)
                    free += x["blocks"]
                    running.remove(x)
        prev = plan.kind
    raise SimError(f"workload not finished after {max_steps} steps")


def random_workload(rng: random.Random, n: int, max_prompt: int, max_output: int, horizon: int,
                    cancel_p: float = 0.1, slos: bool = False) -> list[SimRequest]:
    """Random requests; with `slos`, mixed priorities (-1..2) and SLO classes (tight TTFT and short
    outputs vs loose TTFT and long outputs; some with no SLO)."""
    out = []
    for i in range(n):
        arrival = rng.randrange(horizon)
        output = rng.randint(1, max_output)
        prio = ttft = tbt = 0
        if slos:
            prio = rng.choice([-1, 0, 0, 1, 2])
            cls = rng.choice(["interactive", "batch", "none"])
            if cls == "interactive":
                ttft, tbt, output = rng.choice([20_000, 50_000]), 30_000, max(1, output // 4)
            elif cls == "batch":
                ttft, tbt = rng.choice([500_000, 2_000_000]), rng.choice([100_000, 400_000])
        out.append(SimRequest(i, arrival, rng.randint(1, max_prompt), output,
                              arrival + rng.randint(0, 3 * max_output) if rng.random() < cancel_p else None,
                              prio, ttft, tbt))
    return out


def random_scenario(rng: random.Random, name: str = "", policy: SchedPolicy | None = None) -> Scenario:
    """A random configuration and workload; `policy` None keeps FCFS (the recorded FCFS traces
    stay reproducible), otherwise that policy over a workload with priorities and SLOs."""
    bs = rng.choice([1, 2, 4, 16])
    cfg = PolicyConfig(max_batch_size=rng.choice([1, 2, 4, 8, 32]),
                       max_prefill_tokens=rng.choice([1, 7, 16, 64, 512]), block_size=bs,
                       policy=policy or SchedPolicy.FCFS,
                       lvf_xfer_blocks=rng.choice([0, 4, 2400]) if policy else 2400,
                       lvf_beta_b_milli=rng.choice([0, 0, -500, 1000]) if policy else 0)
    max_prompt, max_output = rng.choice([(8, 8), (40, 20), (100, 50)])
    # Pools from "just one request fits" (heavy preemption) to roomy.
    min_blocks = blocks_needed(max_prompt + max_output, bs)
    num_blocks = rng.choice([min_blocks, min_blocks + 2, 2 * min_blocks, 8 * min_blocks])
    reqs = random_workload(rng, rng.randint(1, 24), max_prompt, max_output, horizon=rng.choice([1, 20, 200]),
                           slos=policy is not None)
    return simulate(reqs, cfg, num_blocks, name=name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", choices=[p.name.lower() for p in SchedPolicy], default=None,
                    help="record this policy over workloads with priorities and SLOs (default: FCFS, no SLOs)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(args.seed)
    policy = SchedPolicy[args.policy.upper()] if args.policy else None
    tag = f"{args.policy}-" if args.policy else ""
    for i in range(args.count):
        random_scenario(rng, name=f"random-{tag}{args.seed}-{i}", policy=policy).dump(
            os.path.join(args.out, f"policy-scenario-{tag}{i}.json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
