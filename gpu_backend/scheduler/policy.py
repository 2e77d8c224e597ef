"""Batching policy: which requests run in the next step (continuous batching with
inline prefill and preemption; FCFS, priority or LVF order). Pure, integer-only,
deterministic, no torch.

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
       taken) * block_size), and the free count drops by its new blocks plus
       taken: cached_idle, the hit blocks no request held (counted free until
       taken), plus its other hit blocks that may be idle when it takes them
       (`hit_taken`): those held only by this step's victims (counted freed
       for the step; at most the victims' blocks) and idle ones counted in the
       cached_idle of a request ahead of it in the engine's queue that is not
       admitted so far (PRIORITY and LVF reorder the queue). Without victims
       and in queue order (FCFS) taken is cached_idle.
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

Policies (PolicyConfig.policy). The rules above are FCFS. The other two only
reorder the lists the rules walk and may preempt running requests for waiting
ones at the start of a PREFILL step (rule 0); everything else is unchanged:
"queue order" becomes the policy's waiting order, "admission order" its
running order (best first), and victims of rules 3 and 4 come off its end.

 PRIORITY (vLLM's priority scheduling): both lists sorted by (priority,
    arrival_us, id), lower first. Rule 0: waiting requests in that order each
    need blocks(min(num_tokens - num_cached, max_prefill_tokens)) + cached_idle
    blocks (beyond the decoders' reserve) and a seat; one that does not fit
    preempts running requests of a strictly worse key, worst first, when that
    makes it fit (else nothing is preempted for it and the scan stops).
 LVF (SuperInfer, seed 001, Algorithm 1): Largest Virtual Lag Time first, in
    integer microseconds (now_us, times on the scheduler's clock):
      rotary  (preempted after producing a token):
              VLT = alpha * max(0, now - last_us - beta_B * tbt_slo_us)
      waiting (no token yet): VLT = max(0, now - arrival_us - beta_F * ttft_slo_us)
      running: VLT = -(now - run_us)
    alpha, beta_B, beta_F in thousandths (defaults 3, 0, 0.5, the paper's).
    The paper writes S_B, S_F as "the TTFT and TBT SLO, respectively", but its
    Figs. 19-20 tie beta_F to TTFT and beta_B to TBT, and a rotary request
    lags on TBT: here beta_B scales the TBT SLO and beta_F the TTFT SLO.
    Rule 0 is Algorithm 1 with seats as a second resource: (1) contention
    check: if the free blocks (less the reserve) cover every waiting request's
    need (PRIORITY's measure) and the free seats their count, the step is
    plain FCFS. (2) L = waiting and running sorted by VLT descending (then
    arrival_us, id). (3) B_left = free + lvf_xfer_blocks; waiting requests
    of L with VLT >= 0 whose need fits B_left are prioritized (R) if a free
    seat is left, or if they are fresh (no token yet), lag (VLT > 0) and a
    candidate's seat is left (seats_swap counts those). (4) B_swap =
    lvf_xfer_blocks - B_left; candidates from L's tail are preempted while
    B_swap > 0 or seats_swap > 0. Seats are not in the paper (HBM blocks
    are its only resource): only a request lagging its TTFT target takes a
    running one's seat, and a rotary request gets a seat back as one frees.
    Letting rotary requests take seats too (their VLT is positive the moment
    they stop, with beta_B 0) rotated every running request out at every
    PREFILL step: 0.32x FCFS's throughput on the 2-core box
    (bench/slo_sched.py). Candidates are running
    requests with VLT < 0 that decode (remaining == 1): one still prefilling
    is never preempted for another, so every admission yields a token before
    its request can rotate out (without that, rotation can starve a chunked
    prefill forever).
    The waiting order is R, then the others in L order; the running order is
    L's. Ties never depend on sort stability: every key ends with the id.
"""
from __future__ import annotations

import dataclasses
import enum
import json


class StepKind(enum.IntEnum):
    IDLE = 0
    PREFILL = 1
    DECODE = 2


class SchedPolicy(enum.IntEnum):
    FCFS = 0
    PRIORITY = 1
    LVF = 2


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    max_batch_size: int = 32         # running requests (seats) at most
    max_prefill_tokens: int = 2048   # tokens scheduled in one PREFILL step at most
    block_size: int = 16             # tokens per KV block
    policy: SchedPolicy = SchedPolicy.FCFS
    lvf_alpha_milli: int = 3000      # LVF alpha x 1000 (rotary lag weight)
    lvf_beta_b_milli: int = 0        # LVF beta_B x 1000 (rotary tolerance, in TBT SLOs)
    lvf_beta_f_milli: int = 500      # LVF beta_F x 1000 (waiting tolerance, in TTFT SLOs)
    lvf_xfer_blocks: int = 2400      # LVF B_xfer: blocks preemption may free for one step

    def __post_init__(self):
        for name in ("max_batch_size", "max_prefill_tokens", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        object.__setattr__(self, "policy", SchedPolicy(self.policy))
        for name in ("lvf_alpha_milli", "lvf_xfer_blocks"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class WaitingReq:
    id: int
    num_tokens: int      # tokens to prefill: the prompt, or prompt + generated after a preemption
    num_cached: int = 0  # leading tokens whose K/V is in prefix-cache blocks (block-aligned, < num_tokens)
    cached_idle: int = 0 # of those blocks, the ones no request holds (they leave the free count when taken)
    priority: int = 0    # lower runs first (PRIORITY)
    arrival_us: int = 0  # arrival on the scheduler's clock; ties go to the earlier
    last_us: int = -1    # its latest token's time if it produced one (a preempted, rotary request), else -1
    ttft_slo_us: int = 0
    tbt_slo_us: int = 0

    def ext(self) -> list[int]:
        return [self.priority, self.arrival_us, self.last_us, self.ttft_slo_us, self.tbt_slo_us]


@dataclasses.dataclass(frozen=True)
class RunningReq:
    id: int
    num_tokens: int      # prompt + generated so far
    num_computed: int    # tokens whose K/V is cached
    num_blocks: int      # KV blocks held
    priority: int = 0
    arrival_us: int = 0
    run_us: int = 0      # when it last entered the running list

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.num_computed


@dataclasses.dataclass(frozen=True)
class PolicyInput:
    waiting: tuple[WaitingReq, ...]    # queue order: preempted first, then arrival order
    running: tuple[RunningReq, ...]    # admission order, oldest first
    free_blocks: int
    prev_kind: StepKind = StepKind.IDLE
    now_us: int = 0                    # the scheduler's clock (LVF)

    def to_json(self) -> dict:
        d = {"waiting": [_waiting_json(w) for w in self.waiting],
             "running": [[r.id, r.num_tokens, r.num_computed, r.num_blocks]
                         + ([r.priority, r.arrival_us, r.run_us] if (r.priority, r.arrival_us, r.run_us) != (0, 0, 0)
                            else []) for r in self.running],
             "free_blocks": self.free_blocks, "prev_kind": int(self.prev_kind)}
        if self.now_us:
            d["now_us"] = self.now_us
        return d

    @classmethod
    def from_json(cls, d: dict) -> "PolicyInput":
        return cls(tuple(WaitingReq(*w) for w in d["waiting"]),
                   tuple(RunningReq(*r) for r in d["running"]),
                   d["free_blocks"], StepKind(d["prev_kind"]), d.get("now_us", 0))


def _waiting_json(w: WaitingReq) -> list[int]:
    ext = w.ext() != WaitingReq(0, 0).ext()
    return ([w.id, w.num_tokens] + ([w.num_cached, w.cached_idle] if w.num_cached or ext else [])
            + (w.ext() if ext else []))


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


def floor_div(a: int, b: int) -> int:
    """a // b rounded down (the C twin spells it out: C division truncates)."""
    return a // b


def vlt_waiting(w: WaitingReq, now_us: int, cfg: PolicyConfig) -> int:
    """LVF's Virtual Lag Time of a waiting request (rotary if it produced a token), microseconds."""
    if w.last_us >= 0:
        lag = now_us - w.last_us - floor_div(cfg.lvf_beta_b_milli * w.tbt_slo_us, 1000)
        return cfg.lvf_alpha_milli * max(0, lag) // 1000
    return max(0, now_us - w.arrival_us - floor_div(cfg.lvf_beta_f_milli * w.ttft_slo_us, 1000))


def vlt_running(r: RunningReq, now_us: int) -> int:
    return -(now_us - r.run_us)


def first_blocks(w: WaitingReq, cfg: PolicyConfig) -> int:
    """Blocks a waiting request's first chunk takes (rule 0's need)."""
    return blocks_needed(min(w.num_tokens - w.num_cached, cfg.max_prefill_tokens), cfg.block_size) + w.cached_idle


def _reserve(running, cfg: PolicyConfig) -> int:
    """Decoders whose next token needs a fresh block."""
    return sum(1 for d in running if d.remaining == 1 and blocks_needed(d.num_computed + 1, cfg.block_size) > d.num_blocks)


def order_requests(inp: PolicyInput, cfg: PolicyConfig
                   ) -> tuple[tuple[RunningReq, ...], tuple[WaitingReq, ...], tuple[int, ...]]:
    """Rule 0: (running order, best first; waiting order; ids to preempt for waiting ones, worst first)."""
    if cfg.policy == SchedPolicy.PRIORITY:
        return _order_priority(inp, cfg)
    if cfg.policy == SchedPolicy.LVF:
        return _order_lvf(inp, cfg)
    return inp.running, inp.waiting, ()


def _order_priority(inp: PolicyInput, cfg: PolicyConfig):
    running = tuple(sorted(inp.running, key=lambda r: (r.priority, r.arrival_us, r.id)))
    waiting = tuple(sorted(inp.waiting, key=lambda w: (w.priority, w.arrival_us, w.id)))
    free = inp.free_blocks - _reserve(inp.running, cfg)
    seats = cfg.max_batch_size - len(running)
    alive = len(running)                   # running[:alive] not preempted
    victims: list[int] = []
    for w in waiting:
        need = first_blocks(w, cfg)
        f, s, k = free, seats, alive
        while (need > f or s <= 0) and k > 0 and \
                (running[k - 1].priority, running[k - 1].arrival_us, running[k - 1].id) > (w.priority, w.arrival_us, w.id):
            k -= 1
            f += running[k].num_blocks
            s += 1
        if need > f or s <= 0:
            break
        for j in range(alive - 1, k - 1, -1):
            victims.append(running[j].id)
        alive, free, seats = k, f - need, s - 1
    return running, waiting, tuple(victims)


def _order_lvf(inp: PolicyInput, cfg: PolicyConfig):
    now = inp.now_us
    free = inp.free_blocks - _reserve(inp.running, cfg)
    seats = cfg.max_batch_size - len(inp.running)
    total = 0
    for w in inp.waiting:
        total += first_blocks(w, cfg)
    if total <= free and len(inp.waiting) <= seats:            # step 1: no contention, FCFS
        return inp.running, inp.waiting, ()
    # step 2: one list, VLT descending; (vlt, is_running, arrival, id) -> key
    entries = [(-vlt_waiting(w, now, cfg), w.arrival_us, w.id, 0, i) for i, w in enumerate(inp.waiting)]
    entries += [(-vlt_running(r, now), r.arrival_us, r.id, 1, i) for i, r in enumerate(inp.running)]
    entries.sort()
    b_left = free + cfg.lvf_xfer_blocks                       # step 3
    cand = [e[3] == 1 and e[0] > 0 and inp.running[e[4]].remaining == 1 for e in entries]
    s_free, s_cand, s_swap = seats, sum(cand), 0
    chosen: list[int] = []                                     # indices into inp.waiting
    for e in entries:
        if e[3] == 0 and e[0] <= 0:
            need = first_blocks(inp.waiting[e[4]], cfg)
            if need > b_left:
                continue
            if s_free > 0:
                s_free -= 1
            elif inp.waiting[e[4]].last_us < 0 and e[0] < 0 and s_cand > 0:
                s_cand -= 1
                s_swap += 1
            else:
                continue
            chosen.append(e[4])
            b_left -= need
    b_swap = cfg.lvf_xfer_blocks - b_left                      # step 4
    victims: list[int] = []
    for k in range(len(entries) - 1, -1, -1):
        e = entries[k]
        if cand[k] and (b_swap > 0 or s_swap > 0):
            victims.append(e[2])
            b_swap -= inp.running[e[4]].num_blocks
            s_swap -= 1
    waiting = tuple(inp.waiting[i] for i in chosen) + tuple(
        inp.waiting[e[4]] for e in entries if e[3] == 0 and e[4] not in chosen)
    running = tuple(inp.running[e[4]] for e in entries if e[3] == 1)
    return running, waiting, tuple(victims)


def plan_step(inp: PolicyInput, cfg: PolicyConfig) -> StepPlan:
    """The next step's plan (rules 0-4 of the module docstring)."""
    running, waiting, victims = order_requests(inp, cfg)
    decoders = [r for r in running if r.remaining == 1]
    live = [r for r in running if r.id not in victims]        # victims leave only if a PREFILL step runs
    prefilling = [r for r in live if r.remaining > 1]
    seats = cfg.max_batch_size - len(live)
    prefill_work = bool(prefilling) or (bool(waiting) and seats > 0)
    if prefill_work and (not decoders or inp.prev_kind != StepKind.PREFILL):
        freed = sum(r.num_blocks for r in running if r.id in victims)
        plan = _plan_prefill(waiting, inp.free_blocks + freed, cfg, [d for d in live if d.remaining == 1],
                             prefilling, seats, inp.waiting, freed)
        if plan.prefill:
            return dataclasses.replace(plan, preempted=victims)
    if decoders:
        return _plan_decode(running, inp.free_blocks, cfg)
    if len([r for r in running if r.remaining > 1]) and len(running) > 1:
        return StepPlan(StepKind.IDLE, preempted=(running[-1].id,))
    return StepPlan(StepKind.IDLE)


def hit_taken(w: WaitingReq, queue: tuple[WaitingReq, ...], admitted: list[int], freed: int, bs: int) -> int:
    """Free blocks that admitting `w` may take for its prefix-cache hit: cached_idle, plus those of
    its other hit blocks (held when the input was taken, or idle but counted for another waiting
    request) that can be idle when it takes them: ones whose holders are all this step's victims
    (at most `freed`, their blocks), and idle ones claimed by a request ahead of it in the queue
    (`queue`, the engine's order: the first hitting request counts an idle block) not admitted so far
    (their cached_idle). Without victims and admitting in queue order (FCFS) that is cached_idle."""
    held = w.num_cached // bs - w.cached_idle
    if held <= 0:
        return w.cached_idle
    avail = freed
    for q in queue:
        if q.id == w.id:
            break
        if q.id not in admitted:
            avail += q.cached_idle
    return w.cached_idle + min(held, avail)


def _plan_prefill(waiting: tuple[WaitingReq, ...], free: int, cfg: PolicyConfig, decoders: list[RunningReq],
                  prefilling: list[RunningReq], seats: int, queue: tuple[WaitingReq, ...] = (),
                  freed: int = 0) -> StepPlan:
    bs = cfg.block_size
    budget = cfg.max_prefill_tokens
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
    for w in waiting:                                              # rule 2b
        if budget == 0 or seats == 0:
            break
        taken = hit_taken(w, queue, admitted, freed, bs)
        chunk = min(w.num_tokens - w.num_cached, budget, (free - reserve - taken) * bs)
        if chunk <= 0:
            break
        need = blocks_needed(chunk, bs)    # num_cached is block-aligned: new blocks from there
        free -= need + taken
        budget -= chunk
        seats -= 1
        prefill.append((w.id, chunk))
        new_blocks.append((w.id, need))
        admitted.append(w.id)
    return StepPlan(StepKind.PREFILL, tuple(prefill), admitted=tuple(admitted), new_blocks=tuple(new_blocks))


def _plan_decode(running: tuple[RunningReq, ...], free: int, cfg: PolicyConfig) -> StepPlan:
    bs = cfg.block_size
    alive = list(running)                  # the policy's running order; victims come off the end
    decode: list[int] = []
    new_blocks: list[tuple[int, int]] = []
    preempted: list[int] = []
    for r in running:                                              # rule 3
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
