"""Batching policy: which requests run in the next step (FCFS continuous batching,
inline prefill, recompute preemption). Pure, integer-only, deterministic, no torch.

    engine state -> PolicyInput (waiting, running, free_blocks, prev_kind)
        -> plan_step(input, config) -> StepPlan (kind, prefill chunks, decodes,
           preemptions, admissions, new blocks per request)
        -> the engine applies it: free the victims' blocks, allocate the new
           blocks, run the batch, publish tokens.

The CUDA scheduler (C++ on the device) implements the same rules and is
diff-tested against this module with scenarios recorded as JSON
(`Scenario`, `policy_sim.py`). Everything here is plain ints, tuples and
in-order loops so the C++ twin can mirror it line by line.

Terms. A request knows `num_tokens` tokens (prompt + generated so far) and has
`num_computed` of them in the KV cache. `remaining = num_tokens - num_computed`.
A running request with remaining == 1 is a *decoder* (its last sampled token
goes in next); with remaining > 1 it is *prefilling* (a prompt chunked over
several steps, or a preempted request being recomputed). Waiting requests hold
no blocks; they start at num_computed == num_cached (0 without a prefix hit). `blocks(n) = ceil(n / block_size)`.
Whenever a scheduled chunk reaches num_tokens the engine samples one token.

Decision rules, in order:

 1. Step kind. Prefill work exists if some running request is prefilling, or
    a request waits and a batch seat is free (running < max_batch_size). A
    PREFILL step is planned when prefill work exists and either no decoder
    runs or the previous step was not a PREFILL step: decode pauses for one
    step to admit arrivals and then resumes (paper §4.2), so a new request
    starts within one decode step and decoders are never starved by a stream
    of arrivals. If that PREFILL step would schedule nothing, fall through.
    Otherwise a DECODE step runs every decoder. With neither, IDLE.
 2. PREFILL step, budget = max_prefill_tokens tokens:
    a. prefilling running requests first, oldest admission first:
       chunk = min(remaining, budget, room) where room = (held + free) *
       block_size - num_computed. A chunk of 0 stops the step's scheduling
       (FCFS: no younger request overtakes a blocked older one).
    b. then waiting requests in queue order (FCFS; preempted requests were put
       back at the front), while a seat and budget remain: chunk =
       min(num_tokens, budget, (free - reserve) * block_size), where reserve is
       the number of decoders whose next token needs a fresh block (so
       admitting never forces an immediate preemption). A chunk of 0 stops.
       A request with a prefix-cache hit (num_cached leading tokens in cached
       blocks, block-aligned, fewer than num_tokens) computes from there:
       chunk = min(num_tokens - num_cached, budget, (free - reserve -
       cached_idle) * block_size), and the free count drops by its new blocks
       plus cached_idle, the hit blocks no request held (counted free until taken).
    No preemption happens in a PREFILL step.
 3. DECODE step: decoders in admission order each need blocks(num_computed + 1)
    - held blocks (0 or 1). While one needs more than is free, the most
    recently admitted running request still alive is preempted (as vLLM
    does): its blocks are freed and it goes back to the front of the waiting
    queue to be recomputed later. If the victim is the request itself, it is
    not scheduled and the scan ends (every request after it was preempted too).
 4. Deadlock breaker: if no step could be planned, no decoder runs and more
    than one request is running (all prefilling, blocked on blocks), the most
    recently admitted one is preempted (IDLE step with a preemption). The
    engine caps the context so one request alone always fits the pool.

Preempted ids are listed newest first; the engine puts each at the front of
the waiting queue in that order, which restores admission order.
"""
from __future__ import annotations

import dataclasses
import enum
import json


class StepKind(enum.IntEnum):
    IDLE = 0
    PREFILL = 1
    DECODE = 2


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    max_batch_size: int = 32         # running requests (seats) at most
    max_prefill_tokens: int = 2048   # tokens scheduled in one PREFILL step at most
    block_size: int = 16             # tokens per KV block

    def __post_init__(self):
        for name in ("max_batch_size", "max_prefill_tokens", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")


@dataclasses.dataclass(frozen=True)
class WaitingReq:
    id: int
    num_tokens: int      # tokens to prefill: the prompt, or prompt + generated after a preemption
    num_cached: int = 0  # leading tokens whose K/V is in prefix-cache blocks (block-aligned, < num_tokens)
    cached_idle: int = 0 # of those blocks, the ones no request holds (they leave the free count when taken)


@dataclasses.dataclass(frozen=True)
class RunningReq:
    id: int
    num_tokens: int      # prompt + generated so far
    num_computed: int    # tokens whose K/V is cached
    num_blocks: int      # KV blocks held

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.num_computed


@dataclasses.dataclass(frozen=True)
class PolicyInput:
    waiting: tuple[WaitingReq, ...]    # queue order: preempted first, then arrival order
    running: tuple[RunningReq, ...]    # admission order, oldest first
    free_blocks: int
    prev_kind: StepKind = StepKind.IDLE

    def to_json(self) -> dict:
        return {"waiting": [[w.id, w.num_tokens] + ([w.num_cached, w.cached_idle] if w.num_cached else [])
                            for w in self.waiting],
                "running": [[r.id, r.num_tokens, r.num_computed, r.num_blocks] for r in self.running],
                "free_blocks": self.free_blocks, "prev_kind": int(self.prev_kind)}

    @classmethod
    def from_json(cls, d: dict) -> "PolicyInput":
        return cls(tuple(WaitingReq(*w) for w in d["waiting"]),
                   tuple(RunningReq(*r) for r in d["running"]),
                   d["free_blocks"], StepKind(d["prev_kind"]))


@dataclasses.dataclass(frozen=True)
class StepPlan:
    kind: StepKind
    prefill: tuple[tuple[int, int], ...] = ()     # (id, tokens this step): running ones first, then admissions
    decode: tuple[int, ...] = ()                  # ids, admission order
    preempted: tuple[int, ...] = ()               # ids, newest first
    admitted: tuple[int, ...] = ()                # ids leaving the waiting queue, in order
    new_blocks: tuple[tuple[int, int], ...] = ()  # (id, blocks to allocate), for every scheduled id

    def to_json(self) -> dict:
        return {"kind": int(self.kind), "prefill": [list(p) for p in self.prefill],
                "decode": list(self.decode), "preempted": list(self.preempted),
                "admitted": list(self.admitted), "new_blocks": [list(b) for b in self.new_blocks]}

    @classmethod
    def from_json(cls, d: dict) -> "StepPlan":
        return cls(StepKind(d["kind"]), tuple(tuple(p) for p in d["prefill"]), tuple(d["decode"]),
                   tuple(d["preempted"]), tuple(d["admitted"]), tuple(tuple(b) for b in d["new_blocks"]))


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold `num_tokens` tokens."""
    return (num_tokens + block_size - 1) // block_size


def plan_step(inp: PolicyInput, cfg: PolicyConfig) -> StepPlan:
    """The next step's plan (rules 1-4 of the module docstring)."""
    decoders = [r for r in inp.running if r.remaining == 1]
    prefilling = [r for r in inp.running if r.remaining > 1]
    seats = cfg.max_batch_size - len(inp.running)
    prefill_work = bool(prefilling) or (bool(inp.waiting) and seats > 0)
    if prefill_work and (not decoders or inp.prev_kind != StepKind.PREFILL):
        plan = _plan_prefill(inp, cfg, decoders, prefilling, seats)
        if plan.prefill:
            return plan
    if decoders:
        return _plan_decode(inp, cfg)
    if prefilling and len(inp.running) > 1:
        return StepPlan(StepKind.IDLE, preempted=(inp.running[-1].id,))
    return StepPlan(StepKind.IDLE)


def _plan_prefill(inp: PolicyInput, cfg: PolicyConfig, decoders: list[RunningReq],
                  prefilling: list[RunningReq], seats: int) -> StepPlan:
    bs = cfg.block_size
    budget, free = cfg.max_prefill_tokens, inp.free_blocks
    prefill: list[tuple[int, int]] = []
    new_blocks: list[tuple[int, int]] = []
    admitted: list[int] = []
    for r in prefilling:                                           # rule 2a
        if budget == 0:
            break
        chunk = min(r.remaining, budget, (r.num_blocks + free) * bs - r.num_computed)
        if chunk <= 0:
            return StepPlan(StepKind.PREFILL, tuple(prefill), new_blocks=tuple(new_blocks))
        need = max(0, blocks_needed(r.num_computed + chunk, bs) - r.num_blocks)
        free -= need
        budget -= chunk
        prefill.append((r.id, chunk))
        new_blocks.append((r.id, need))
    reserve = sum(1 for d in decoders if blocks_needed(d.num_computed + 1, bs) > d.num_blocks)
    for w in inp.waiting:                                          # rule 2b
        if budget == 0 or seats == 0:
            break
        chunk = min(w.num_tokens - w.num_cached, budget, (free - reserve - w.cached_idle) * bs)
        if chunk <= 0:
            break
        need = blocks_needed(chunk, bs)    # num_cached is block-aligned: new blocks from there
        free -= need + w.cached_idle
        budget -= chunk
        seats -= 1
        prefill.append((w.id, chunk))
        new_blocks.append((w.id, need))
        admitted.append(w.id)
    return StepPlan(StepKind.PREFILL, tuple(prefill), admitted=tuple(admitted), new_blocks=tuple(new_blocks))


def _plan_decode(inp: PolicyInput, cfg: PolicyConfig) -> StepPlan:
    bs = cfg.block_size
    free = inp.free_blocks
    alive = list(inp.running)              # admission order; victims come off the end
    decode: list[int] = []
    new_blocks: list[tuple[int, int]] = []
    preempted: list[int] = []
    for r in inp.running:                                          # rule 3
        if r.id in preempted:
            break                          # preempted as a victim: everyone after it is gone too
        if r.remaining != 1:
            continue
        need = max(0, blocks_needed(r.num_computed + 1, bs) - r.num_blocks)
        self_preempted = False
        while need > free:
            victim = alive.pop()
            preempted.append(victim.id)
            free += victim.num_blocks
            if victim.id == r.id:
                self_preempted = True
                break
        if self_preempted:
            break
        free -= need
        decode.append(r.id)
        new_blocks.append((r.id, need))
    return StepPlan(StepKind.DECODE, decode=tuple(decode), preempted=tuple(preempted),
                    new_blocks=tuple(new_blocks))


@dataclasses.dataclass
class Scenario:
    """Recorded policy decisions: config plus (input, plan) per step, as JSON.

    A C++ twin replays a scenario by feeding every input to its own planner and
    comparing the plans field by field.
    """
    config: PolicyConfig
    steps: list[tuple[PolicyInput, StepPlan]] = dataclasses.field(default_factory=list)
    name: str = ""

    def record(self, inp: PolicyInput, plan: StepPlan) -> None:
        self.steps.append((inp, plan))

    def to_json(self) -> dict:
        return {"name": self.name, "config": dataclasses.asdict(self.config),
                "steps": [{"input": i.to_json(), "plan": p.to_json()} for i, p in self.steps]}

    @classmethod
    def from_json(cls, d: dict) -> "Scenario":
        return cls(PolicyConfig(**d["config"]),
                   [(PolicyInput.from_json(s["input"]), StepPlan.from_json(s["plan"])) for s in d["steps"]],
                   d.get("name", ""))

    def dump(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, separators=(",", ":"))

    def mismatches(self) -> list[int]:
        """Indices of steps whose recorded plan differs from what plan_step decides now."""
        return [i for i, (inp, plan) in enumerate(self.steps) if plan_step(inp, self.config) != plan]
