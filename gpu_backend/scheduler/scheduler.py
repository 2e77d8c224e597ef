"""Scheduler: the queues, the policy applied to them, preemption and the KV blocks of every request.

    Engine: add(Sequence) (claimed by intake) -> waiting queue
    schedule() -> prefix-cache lookup for the waiting (hash chain of their full
           blocks -> the longest cached run, at least one token left to compute)
        -> PolicyInput (queues, hits, free blocks) -> policy.plan_step -> StepPlan
        -> preempt victims (blocks freed, back to the waiting front) -> admit a
           prefix of the waiting queue (each takes its cached blocks and starts
           at num_computed = the hit) -> allocate new blocks -> SchedulerOutput
           (StepBatch of chunks, the sequences preempted this step)
    Engine runs the batch (Runner.run), then update(batch): num_computed advances,
           the blocks that became full are committed to the prefix cache
    fork(leader): a group leader's members start beside it, sharing its full blocks
    remove(seq): finished / cancelled / dropped: blocks back, out of the queues

Everything is host memory and plain Python; the scheduler never touches the
ring (the engine moves slot states and publishes). The CUDA persistent
scheduler implements the same decisions in csrc/sched_policy.h and
csrc/kv_alloc.h, diff-tested against policy.py and kv_cache.py.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

from .kv_cache import ROOT_HASH, BlockAllocator, block_hash
from .policy import (PolicyConfig, PolicyInput, RunningReq, Scenario, SchedPolicy, StepKind, StepPlan, WaitingReq,
                     plan_step)
from .sequence import Sequence


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int          # position of the first token computed this step (= seq.num_computed)
    num_tokens: int     # tokens computed this step
    sample: bool        # the chunk reaches seq.num_tokens: sample the next token


@dataclasses.dataclass(frozen=True)
class StepBatch:
    kind: StepKind
    chunks: tuple[ScheduledChunk, ...]


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    batch: StepBatch                   # kind IDLE with no chunks: nothing to run
    preempted: tuple[Sequence, ...]    # back at the front of the waiting queue, blocks freed


@dataclasses.dataclass
class PrefixStats:
    """Prefix-cache outcome of every admission (counters, from the start)."""
    hit_tokens: int = 0      # prompt (+ output, after a preemption) tokens found cached
    miss_tokens: int = 0     # tokens to compute
    hit_blocks: int = 0
    miss_blocks: int = 0     # blocks_needed(num_tokens) - hit blocks


def monotonic_us() -> int:
    return time.monotonic_ns() // 1000


class Scheduler:
    """Continuous batching over one KV pool (policy.py's rules; FCFS, PRIORITY or LVF as
    `policy.policy` says), with automatic prefix caching unless `prefix_caching` is False;
    single-threaded. A preempted request's full blocks stay in the prefix cache: readmitted,
    it takes them back and recomputes only its partial last block, unless they were evicted
    meanwhile (then it recomputes them). `clock_us` is the time LVF's lags are measured on
    (intake stamps arrivals with monotonic_us too)."""

    def __init__(self, policy: PolicyConfig, num_blocks: int, scenario: Scenario | None = None,
                 prefix_caching: bool = True, clock_us: Callable[[], int] = monotonic_us):
        self.policy = policy
        self.clock_us = clock_us
        self._now_us = 0
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.allocator = BlockAllocator(num_blocks)
        self.waiting: collections.deque[Sequence] = collections.deque()   # queue order
        self.running: list[Sequence] = []                                  # admission order
        self.prev_kind = StepKind.IDLE
        self.scenario = scenario
        self.stats = PrefixStats()
        self._hits: dict[int, list[int]] = {}      # slot -> cached blocks it takes if admitted this step

    @property
    def free_blocks(self) -> int:
        return self.allocator.free_count

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        inp = self._policy_input()
        plan = plan_step(inp, self.policy)
        if self.scenario is not None:
            self.scenario.record(inp, plan)
        preempted = tuple(self._preempt(slot) for slot in plan.preempted)
        if plan.kind == StepKind.IDLE:
            return SchedulerOutput(StepBatch(StepKind.IDLE, ()), preempted)
        self.prev_kind = plan.kind
        return SchedulerOutput(self._batch(plan), preempted)

    def update(self, batch: StepBatch) -> None:
        """The chunks that ran: their tokens' K/V is in the cache now; blocks that became full
        are committed to the prefix cache."""
        now = self.clock_us()
        for c in batch.chunks:
            c.seq.num_computed += c.num_tokens
            if c.sample:
                c.seq.last_us = now
            if self.prefix_caching:
                self._commit(c.seq)

    def _keys(self, s: Sequence, n: int) -> list[int]:
        """The prefix-cache keys of s's first `n` full blocks (extending its chain as needed)."""
        bs, keys = self.policy.block_size, s.block_hashes
        parent = keys[-1] if keys else ROOT_HASH
        for j in range(len(keys), n):
            parent = block_hash(parent, s.token_slice(j * bs, (j + 1) * bs))
            keys.append(parent)
        return keys[:n]

    def _commit(self, s: Sequence) -> None:
        full = min(s.num_computed // self.policy.block_size, len(s.blocks))
        if full > s.num_committed:
            for b, key in zip(s.blocks[s.num_committed:full], self._keys(s, full)[s.num_committed:]):
                self.allocator.commit(b, key)
            s.num_committed = full

    def _hit(self, s: Sequence) -> list[int]:
        """Cached blocks a waiting request can start from. At least one token is left to compute
        (a token is sampled from its logits); none for a request that wants prompt logprobs,
        which need the logits of every prompt position."""
        if not self.prefix_caching or s.params.prompt_logprobs is not None:
            return []
        return self.allocator.lookup(self._keys(s, (s.num_tokens - 1) // self.policy.block_size))

    def _waiting_req(self, s: Sequence, claimed: set[int]) -> WaitingReq:
        hit = self._hits[s.slot] = self._hit(s)
        idle = [b for b in hit if self.allocator.idle(b) and b not in claimed]   # counted once in the queue
        claimed.update(idle)
        return WaitingReq(s.slot, s.num_tokens, len(hit) * self.policy.block_size, len(idle), *_times(s))

    def _policy_input(self) -> PolicyInput:
        self._hits.clear()
        claimed: set[int] = set()
        seats = self.policy.max_batch_size - len(self.running)    # only these many can be admitted
        if self.policy.policy != SchedPolicy.FCFS:
            seats = len(self.waiting)       # any of them may be admitted (reordered, or after preemptions)
        self._now_us = self.clock_us()
        return PolicyInput(
            waiting=tuple(self._waiting_req(s, claimed) if i < seats else WaitingReq(s.slot, s.num_tokens, 0, 0,
                                                                                    *_times(s))
                          for i, s in enumerate(self.waiting)),
            running=tuple(RunningReq(s.slot, s.num_tokens, s.num_computed, len(s.blocks), s.priority, s.arrival_us,
                                     s.run_us) for s in self.running),
            now_us=self._now_us,
            # Shared blocks counted as held by each sharer: a preempted sharer frees fewer than the
            # policy assumes, so the free count it sees is lowered by the extra references. Not
            # clamped at 0: with many sharers it goes negative, and a clamp would credit the policy
            # blocks that preempting them never frees (it then over-allocates).
            free_blocks=self.allocator.free_count - self.allocator.extra_refs, prev_kind=self.prev_kind)

    def _preempt(self, slot: int) -> Sequence:
        """Recompute preemption: free the blocks, requeue at the front."""
        s = next(x for x in self.running if x.slot == slot)
        self.running.remove(s)
        self.allocator.free(s.blocks)
        s.blocks, s.num_computed, s.num_committed = [], 0, 0
        self.waiting.appendleft(s)
        return s

    def _batch(self, plan: StepPlan) -> StepBatch:
        for slot in plan.admitted:
            if self.policy.policy == SchedPolicy.FCFS:
                s = self.waiting.popleft()
                assert s.slot == slot, "FCFS admits a prefix of the waiting queue"
            else:
                s = next(x for x in self.waiting if x.slot == slot)
                self.waiting.remove(s)
            s.run_us = self._now_us
            self._admit(s, self._hits.get(slot, []))
        by_slot = {s.slot: s for s in self.running}
        for slot, n in plan.new_blocks:
            if n:
                by_slot[slot].blocks.extend(self.allocator.allocate(n))
        chunks = [(by_slot[slot], n) for slot, n in plan.prefill] + [(by_slot[slot], 1) for slot in plan.decode]
        return StepBatch(plan.kind, tuple(
            ScheduledChunk(s, s.num_computed, n, s.num_computed + n == s.num_tokens and not s.hold_last)
            for s, n in chunks))

    def _admit(self, s: Sequence, hit: list[int]) -> None:
        """Into the running list, holding its cached prefix blocks (taken before any allocation of
        this step, so none of them is evicted under it)."""
        bs = self.policy.block_size
        s.blocks = self.allocator.take(hit)
        s.num_computed = s.num_committed = len(hit)
        s.num_computed *= bs
        need = (s.num_tokens + bs - 1) // bs
        st = self.stats
        st.hit_tokens += s.num_computed
        st.miss_tokens += s.num_tokens - s.num_computed
        st.hit_blocks += len(hit)
        st.miss_blocks += need - len(hit)
        self.running.append(s)

    def fork(self, leader: Sequence, members: list[Sequence]) -> list[tuple[int, int]]:
        """The leader computed its prompt but the last token: `members` (its live forks) start
        beside it, sharing its full blocks; each gets a copy of the partial last block (or,
        with no block free, recomputes that block's tokens itself). Returns the (src, dst)
        block copies the runner must make."""
        leader.hold_last = False
        done = leader.num_computed                          # prompt_len - 1
        bs = self.policy.block_size
        full = done // bs
        copies = []
        for f in members:
            f.blocks = self.allocator.share(leader.blocks[:full])
            f.num_computed = full * bs
            f.num_committed = min(full, leader.num_committed)
            f.prompt_logprobs = leader.prompt_logprobs      # the prompt's records, computed once
            if done % bs and self.allocator.can_allocate(1):
                (b,) = self.allocator.allocate(1)
                copies.append((leader.blocks[full], b))
                f.blocks.append(b)
                f.num_computed = done
            self.running.append(f)
        leader.forks = []
        return copies

    def remove(self, s: Sequence) -> None:
        """A request leaves (finished, cancelled, dropped): its blocks back, out of the queues."""
        self.allocator.free(s.blocks)
        s.blocks, s.num_committed = [], 0
        if s in self.running:
            self.running.remove(s)
        else:
            try:
                self.waiting.remove(s)
            except ValueError:
                pass

    def reset(self) -> None:
        """Forget every request and start over from a clean pool (the engine's last-resort net)."""
        self.waiting.clear()
        self.running.clear()
        self.allocator = BlockAllocator(self.num_blocks)


def _times(s: Sequence) -> tuple[int, int, int, int, int]:
    """WaitingReq's policy fields of a waiting sequence."""
    return s.priority, s.arrival_us, s.last_us, s.ttft_slo_us, s.tbt_slo_us
