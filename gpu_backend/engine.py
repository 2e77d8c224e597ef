"""Engine: the host-side serving step, schedule -> run -> postprocess, over one ring.

    intake (claim + validate pending slots) -> Scheduler.add (the waiting queue)
    reap (cancel flags, stale frontend epochs) -> slots completed ABORT, blocks freed
    Scheduler.schedule() (scheduler/: policy.plan_step, preempt victims, admit, allocate
           KV blocks) -> SchedulerOutput: a StepBatch (chunks of tokens per sequence) and
           the sequences preempted, whose slots go DECODE_PAUSED
    Runner.run(StepBatch) -> one sampled token per chunk that reaches its sequence's end
           (it raises: each chunk again alone, and only the chunks that fail alone end
           ERROR/INTERNAL; a token -1, a row that could not be sampled: that request alone)
    fork: a group leader whose prefill reached its held-back last prompt token gets its
           members running beside it, sharing its full KV blocks (the partial last block
           copied for each: Runner.copy_blocks); every choice then computes that token
           and samples its own first token
    postprocess: publish tokens (BackendPort: the prompt's logprob records before the
           first token, each token with its logprob record, then the count), finish STOP /
           LENGTH, complete the slot, free its blocks

The CPU executor and the null executor share this loop and differ only in
the Runner. All state (the scheduler's queues, block tables) lives in host memory; the ring
sees only published tokens, counts and states. The engine is single-threaded;
the daemon's heartbeat runs beside it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from typing import Protocol

import numpy as np

from shared_layout import BackendPort, ErrorCode, FinishReason, IllegalTransition, Ring, SlotState
from shared_layout.doorbell import Doorbell
from shared_layout.layout import logprob_record_words
from shared_layout.timers import fine_timer_slack

from .scheduler import (Intake, IntakeConfig, PolicyConfig, Scenario, Scheduler, Sequence, StepBatch, StepKind)

log = logging.getLogger("blink.gpu_daemon")

# Up to this many owned requests, a step checks their cancel flags one by one; above it,
# one vectorised scan of the whole flag array is cheaper (a 4096-slot scan costs ~5 us).
REAP_SCAN_LIMIT = 64

# Header words _publish_kv keeps current, in the order it computes them.
_KV_WORDS = ("kv_blocks_free", "prefix_hit_tokens", "prefix_miss_tokens", "prefix_hit_blocks", "prefix_miss_blocks",
             "kv_blocks_cached")


class Runner(Protocol):
    def run(self, batch: StepBatch) -> list[int]:
        """Compute every chunk (K/V into the sequences' blocks); return one token per
        chunk with sample=True, in chunk order (-1 for a row that could not be sampled)."""
        ...

    # Optional: copy_blocks(pairs: list[tuple[int, int]]) -> None copies each src block's K/V
    # into dst (a runner without a KV cache has nothing to copy and may leave it out).
    # Optional: timing() -> dict[str, int], cumulative nanoseconds of the runner's own parts
    # (the host loop's launch call and wait), for EngineConfig.period_log.


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    policy: PolicyConfig
    num_blocks: int                  # KV pool size in blocks
    idle_sleep_max_s: float = 0.002  # polling back-off ceiling when the ring is quiet
    idle_fine_polls: int = 20        # 50 us apart after the last work before backing off (~1-2 ms)
    shutdown_grace_s: float = 2.0    # in-flight requests get this long to finish on stop
    prefix_caching: bool = True      # the scheduler shares cached KV blocks of a common prefix
    doorbell: str | None = None      # ring name: after a step that published or ended requests, ring
                                     # this ring's bell for a frontend on this host (shared_layout.doorbell)
    # log one `engine period {json}` line per busy period (steps until the ring is quiet): wall time,
    # steps, the runner's share and its own parts (Runner.timing); bench.cuda_graphs sets it (env
    # BLINK_ENGINE_PERIODS=1) to split the host loop's makespan
    period_log: bool = dataclasses.field(default_factory=lambda: os.environ.get("BLINK_ENGINE_PERIODS") == "1")


def _records_or_blank(records: np.ndarray | None, n: int, k: int) -> np.ndarray:
    """The runner's logprob records, or n records with a NaN logprob (shown as null) from a
    runner that computes none (the null executor)."""
    if records is not None and records.shape == (n, logprob_record_words(k)):
        return records
    blank = np.zeros((n, logprob_record_words(k)), "<i4")
    blank[:, 0] = np.float32("nan").view("<i4")
    return blank


class Engine:
    def __init__(self, ring: Ring, runner: Runner, config: EngineConfig, intake: IntakeConfig,
                 scenario: Scenario | None = None):
        if config.num_blocks * config.policy.block_size < intake.max_model_len:
            raise ValueError(f"KV pool of {config.num_blocks} x {config.policy.block_size} tokens cannot hold "
                             f"one {intake.max_model_len}-token context")
        self.ring, self.runner, self.config = ring, runner, config
        self.port = BackendPort(ring)
        self.intake = Intake(ring, self.port, intake, owned=lambda: self.owned.values())
        self.scheduler = Scheduler(config.policy, config.num_blocks, scenario, config.prefix_caching)
        self.admitting = True
        self.owned: dict[int, Sequence] = {}     # slot -> its sequence, waiting or running
        self._epoch_checked = ring.get("frontend_epoch")
        self.steps = 0
        self.run_ns = 0                          # time inside Runner.run, every step
        self.bell = Doorbell.create(config.doorbell) if config.doorbell else None
        self._rung_writes = 0
        ring.set("kv_blocks_total", config.num_blocks)
        ring.set("prefix_caching", int(config.prefix_caching))
        self._publish_kv()

    def _publish_kv(self) -> None:
        """Free KV blocks (evictable cached ones included) and the prefix cache's counters into the
        header, where the frontend's /metrics shows them."""
        st = self.scheduler.stats
        values = (self.scheduler.free_blocks, st.hit_tokens, st.miss_tokens, st.hit_blocks, st.miss_blocks,
                  self.scheduler.allocator.cached_count)
        for name, value in zip(_KV_WORDS, values):
            self.ring.set(name, value)

    # -- the step ---------------------------------------------------------------
    def step(self) -> bool:
        """One scheduling step; False when there was nothing to do."""
        if self.admitting:
            for s in self.intake.scan():
                alone = [] if s.hold_last else s.forks   # a one-token prompt has no prefill to share
                if alone:
                    s.forks = []
                for x in [s] + s.forks + alone:
                    old = self.owned.get(x.slot)
                    if old is not None:      # the frontend reused a slot we still held: forget the old request
                        log.error("slot %d resubmitted while its request %d ran; dropping that one", x.slot, old.seq)
                        self._drop(old)
                    self.owned[x.slot] = x
                for x in [s] + alone:
                    self.scheduler.add(x)
        self._reap()
        out = self.scheduler.schedule()
        self._pause(out.preempted)
        if out.batch.kind == StepKind.IDLE:
            self._publish_kv()
            return bool(out.preempted)
        self.steps += 1
        t = time.perf_counter_ns()
        batch, tokens = self._run(out.batch)
        self.run_ns += time.perf_counter_ns() - t
        self._postprocess(batch, tokens)
        self._publish_kv()
        return True

    def _run_checked(self, batch: StepBatch) -> list[int]:
        tokens = self.runner.run(batch)
        if len(tokens) != sum(c.sample for c in batch.chunks):
            raise RuntimeError(f"runner returned {len(tokens)} tokens for "
                               f"{sum(c.sample for c in batch.chunks)} sampled chunks")
        return tokens

    def _run(self, batch: StepBatch) -> tuple[StepBatch, list[int]]:
        """Runner.run; when it raises, each chunk again alone, so a failure that belongs to one
        request (its sampling, its data) ends that request with ERROR/INTERNAL and not its batch.
        Running a chunk again is safe: it writes the same K/V at the same positions. A batch of
        one chunk is not run again. Returns the chunks that ran and their tokens."""
        try:
            return batch, self._run_checked(batch)
        except Exception:
            if len(batch.chunks) == 1:
                log.exception("executor step failed; ending its request with ERROR/INTERNAL")
                self._finish(batch.chunks[0].seq, FinishReason.ERROR, ErrorCode.INTERNAL)
                return StepBatch(batch.kind, ()), []
            log.exception("executor step failed; running its %d chunks one by one", len(batch.chunks))
        ran, tokens = [], []
        for c in batch.chunks:
            try:
                tokens += self._run_checked(StepBatch(batch.kind, (c,)))
            except Exception as e:
                log.error("slot %d: the executor failed on its request alone (%r); ending it with ERROR/INTERNAL",
                          c.seq.slot, e)
                self._finish(c.seq, FinishReason.ERROR, ErrorCode.INTERNAL)
                continue
            ran.append(c)
        return StepBatch(batch.kind, tuple(ran)), tokens

    def _reap(self) -> None:
        """End cancelled requests and those of a restarted frontend (within one step)."""
        epoch = self.ring.get("frontend_epoch")
        if epoch != self._epoch_checked:     # a frontend restart: every older request is stale
            for s in [s for s in self.owned.values() if s.epoch != epoch]:
                self._finish(s, FinishReason.ABORT, ErrorCode.STALE_EPOCH)
            self._epoch_checked = epoch
        flags = self.ring.cancel_flags
        if len(self.owned) <= REAP_SCAN_LIMIT:     # few requests: look at their flags, not the whole ring
            cancelled = [slot for slot in self.owned if flags[slot]]
        else:
            cancelled = flags.nonzero()[0].tolist()
        for slot in cancelled:
            s = self.owned.get(slot)
            if s is not None:
                self._finish(s, FinishReason.ABORT)

    def _pause(self, preempted: tuple[Sequence, ...]) -> None:
        """Preempted requests (back in the waiting queue, blocks freed): their slots go DECODE_PAUSED."""
        for s in preempted:
            try:
                if int(self.ring.state[s.slot]) != SlotState.DECODE_PAUSED:
                    self.port.move(s.slot, SlotState.DECODE_PAUSED)
            except IllegalTransition as e:   # the frontend scribbled on a slot we own
                log.error("slot %d: %s; dropping its request", s.slot, e)
                self._drop(s)

    def _postprocess(self, batch: StepBatch, tokens: list[int]) -> None:
        self.scheduler.update(batch)
        it = iter(tokens)
        for c in batch.chunks:
            if c.sample:
                self._emit(c.seq, int(next(it)))
            elif c.seq.hold_last and c.seq.num_computed == c.seq.num_tokens and c.seq.slot in self.owned:
                self._fork(c.seq)

    def _fork(self, leader: Sequence) -> None:
        """The leader computed its prompt but the last token: its members still owned start beside
        it (Scheduler.fork), and the runner copies their partial last blocks."""
        live = [f for f in leader.forks if self.owned.get(f.slot) is f]   # not ended while it waited
        copies = self.scheduler.fork(leader, live)
        copy = getattr(self.runner, "copy_blocks", None)
        if copies and copy is not None:
            copy(copies)

    def _emit(self, s: Sequence, token: int) -> None:
        """Publish one new token, then finish the request or keep it decoding. A token outside the
        vocabulary (the runner's -1: this row could not be sampled, e.g. NaN logits) ends the
        request alone with ERROR/INTERNAL."""
        if not 0 <= token < self.intake.config.vocab_size:
            log.error("slot %d: the executor sampled no valid token (%d); ending its request", s.slot, token)
            self._finish(s, FinishReason.ERROR, ErrorCode.INTERNAL)
            return
        s.output.append(token)
        try:
            p = s.params
            if p.prompt_logprobs is not None and len(s.output) == 1:
                self.port.publish_prompt_logprobs(s.slot, _records_or_blank(s.prompt_logprobs, len(s.prompt) - 1,
                                                                            p.prompt_logprobs))
                s.prompt_logprobs = None      # published: never needed again (members hold their own reference)
            records = None
            if p.logprobs is not None:
                records = _records_or_blank(s.step_logprobs, 1, p.logprobs)
            self.port.publish(s.slot, [token], logprob_records=records)
            if token in s.stop_ids:
                self._finish(s, FinishReason.STOP)
            elif len(s.output) >= s.max_tokens or s.num_tokens >= s.max_len:
                self._finish(s, FinishReason.LENGTH)
            elif int(self.ring.state[s.slot]) != SlotState.DECODE_PROCESSING:
                self.port.move(s.slot, SlotState.DECODE_PROCESSING)
        except ValueError as e:   # IllegalTransition, or output fields rewritten out of range (someone else
            # wrote a slot we own): end that request alone, keep serving the others
            log.error("slot %d: %s; ending its request", s.slot, e)
            self._finish(s, FinishReason.ERROR, ErrorCode.INVALID_REQUEST)

    def _finish(self, s: Sequence, finish: FinishReason, error: ErrorCode = ErrorCode.NONE) -> None:
        for f in [s] + [f for f in s.forks if self.owned.get(f.slot) is f]:   # a leader before its fork: its
            try:                                                                # members end with it
                self.port.complete(f.slot, finish, error)
            except IllegalTransition as e:
                log.error("slot %d: %s; dropping its request", f.slot, e)
        self._drop(s)

    def _drop(self, s: Sequence) -> None:
        self.scheduler.remove(s)
        self.owned.pop(s.slot, None)
        for f in s.forks:       # a leader dropped before its fork: so are its members
            if self.owned.get(f.slot) is f:
                del self.owned[f.slot]
        s.forks = []

    # -- the loop -----------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def abort_all(self, error: ErrorCode = ErrorCode.BACKEND_SHUTDOWN) -> None:
        for s in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._finish(s, FinishReason.ABORT, error)

    def serve(self, stop: threading.Event) -> None:
        """Step until `stop` is set; then finish in-flight work within the grace period
        (no new claims) and abort whatever is left with ABORT/BACKEND_SHUTDOWN."""
        fine_timer_slack()   # the idle back-off's 50 us sleeps, not 100+
        idle = 0
        period = None        # (clock, steps, run_ns, runner timing) where the busy period began
        while not stop.is_set():
            start = (time.perf_counter_ns(), self.steps, self.run_ns, self._runner_timing()) \
                if self.config.period_log and period is None else None
            if self._safe_step():
                idle = 0
                if start is not None:
                    period = start
            else:
                if period is not None:
                    self._log_period(*period)
                    period = None
                # 50 us sleeps for the first idle_fine_polls (a closed-loop client's next request
                # comes within a millisecond), then back off to idle_sleep_max_s so a quiet ring
                # costs little CPU.
                idle += 1
                time.sleep(min(self.config.idle_sleep_max_s, 50e-6 * max(1, idle - self.config.idle_fine_polls)))
        self.admitting = False
        deadline = time.monotonic() + self.config.shutdown_grace_s
        while self.has_work() and time.monotonic() < deadline:
            if not self._safe_step():
                time.sleep(0.0005)
        self.abort_all(ErrorCode.BACKEND_SHUTDOWN)
        self._ring_bell()
        if self.bell is not None:
            self.bell.close()

    def _runner_timing(self) -> dict[str, int]:
        timing = getattr(self.runner, "timing", None)
        return timing() if timing is not None else {}

    def _log_period(self, t0: int, steps0: int, run0: int, parts0: dict[str, int]) -> None:
        """One busy period (EngineConfig.period_log), in ms: wall, the engine's own Python (intake,
        reap, scheduler, publish), the runner's, and the runner's parts."""
        wall, run = time.perf_counter_ns() - t0, self.run_ns - run0
        rec = {"steps": self.steps - steps0, "wall_ms": round(wall / 1e6, 3), "engine_ms": round((wall - run) / 1e6, 3),
               "runner_ms": round(run / 1e6, 3)}
        rec.update({k.removesuffix("_ns") + "_ms": round((v - parts0.get(k, 0)) / 1e6, 3)
                    for k, v in self._runner_timing().items()})
        log.info("engine period %s", json.dumps(rec))

    def _ring_bell(self) -> None:
        """Ring the doorbell when the ring got tokens or ended slots since the last bell."""
        if self.bell is not None and self.port.writes != self._rung_writes:
            self._rung_writes = self.port.writes
            self.bell.ring()

    def _safe_step(self) -> bool:
        """step(), with a last-resort net: an engine bug ends the requests in flight with
        ERROR/INTERNAL and starts over from a clean pool instead of killing the daemon. Either
        way the doorbell rings after it when the step wrote tokens or ended slots."""
        try:
            return self.step()
        except Exception:
            log.exception("engine step failed; ending %d requests with ERROR/INTERNAL", len(self.owned))
            for s in list(self.owned.values()):
                try:
                    self.port.complete(s.slot, FinishReason.ERROR, ErrorCode.INTERNAL)
                except Exception:
                    pass
            self.owned.clear()
            self.scheduler.reset()
            return True
        finally:
            self._ring_bell()
