"""Token reader (paper §4.4): one bulk read per poll, new tokens out to the handles.

    poll: read header + slot records (slot_snapshot.py: every slot now and then,
          else the arc covering our in-flight slots: one Transport.read, two if it wraps)
          -> health.observe(header) when its bytes changed, tracker.refresh(states) on full reads
          -> slots whose generated count, state or seq moved (one struct unpack per flight
             while few are in flight, numpy over the snapshot when many are)
          -> read tokens [received, generated) per slot (and their logprob records, and once the
             prompt's, when the request asked) -> handle._deliver
          -> DECODE_COMPLETED: re-read the record, last tokens, handle._end, reset to EMPTY
    pace (next_interval_s): poll finely for spin_s after progress (not when the step is known
          complete), and for first_token_spin_s after a submission while a request waits for its
          first token and no step cadence is known; with requests in flight and a steady daemon
          step (its publish stamps `step_merge_s` apart or more, period >= predict_min_step_s),
          sleep until `lead_s` before the next step is due (predict_lead_precise_s when the caller's
          sleeps are precise, RingClient's timerfd; else predict_lead_s), then poll finely (with
          precise sleeps and jittery steps: a tenth of the jitter apart, predict_poll_s at most)
          until `predict_window_s` after it; otherwise `busy_interval_s` while requests are in
          flight, `idle_interval_s` when none are. (0 = poll again soon: the ring client then
          yields, or blocks for `fine_sleep_s` when nothing else wants the loop; see
          RingClient._sleep.) With a doorbell heard lately (a daemon on this host rings after each
          step that wrote tokens or ended slots: shared_layout.doorbell), none of that: sleep until
          the next bell, bell_fallback_s at most.

Step prediction: a model's decode steps come at a steady cadence (20 ms for SmolLM2 on a small
CPU), and every running stream gets its token in the same step. Polling every millisecond
costs a wake-up each time and still adds up to a millisecond (plus timer slack) per token;
polling just around the predicted step costs a few fine polls per step and finds the tokens
within a fine poll of their publication. The period is the shortest of the last few gaps
between steps (the daemon's own stamps), so a step that comes early shows at once; a late one
(a long prefill) falls back to busy polling at the end of the window.

Newly submitted slots are "urgent": they are looked at first, so under a per-poll
cap the first token of a new request is never starved by long-running ones. A
slot's tokens are handed over only when its seq and epoch are the ones we wrote.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import NamedTuple

import numpy as np

from shared_layout import ErrorCode, FinishReason, SlotState

from .backend_health import HealthMonitor
from .ring_session import Flight, RingSession
from .slot_snapshot import PROGRESS_FIELDS

_ERROR_TEXT = {
    ErrorCode.INVALID_REQUEST: "the backend rejected the request as invalid",
    ErrorCode.INVALID_TOKEN: "the prompt contains a token id outside the model's vocabulary",
    ErrorCode.PROMPT_TOO_LONG: "the prompt does not fit the model's context",
    ErrorCode.OUT_OF_MEMORY: "the request can never fit the backend's KV cache",
    ErrorCode.BACKEND_SHUTDOWN: "the backend shut down while the request ran",
    ErrorCode.STALE_EPOCH: "the request was submitted by a frontend that has since restarted",
    ErrorCode.INTERNAL: "the backend failed while running the request",
}


def finish_of(finish_reason: int, error_code: int) -> tuple[str, str | None]:
    """The handle's (finish_reason, error) for a completed slot's words."""
    try:
        fr = FinishReason(finish_reason)
    except ValueError:
        return "error", f"backend reported unknown finish reason {finish_reason}"
    try:
        ec = ErrorCode(error_code)
    except ValueError:
        ec = ErrorCode.INTERNAL
    if fr == FinishReason.STOP:
        return "stop", None
    if fr == FinishReason.LENGTH:
        return "length", None
    if fr == FinishReason.ABORT and ec == ErrorCode.NONE:
        return "abort", None
    return "error", _ERROR_TEXT.get(ec, f"request failed ({fr.name.lower()}, {ec.name.lower()})")


_COMPLETED = int(SlotState.DECODE_COMPLETED)


class _Progress(NamedTuple):
    """The words of one slot record the reader acts on (slot_snapshot.PROGRESS_FIELDS, in order)."""
    state: int
    seq: int
    epoch: int
    generated: int
    t_picked_ns: int
    t_first_ns: int
    t_last_ns: int


@dataclasses.dataclass(frozen=True)
class ReaderConfig:
    spin_s: float = 200e-6          # keep polling finely this long after progress
    first_token_spin_s: float = 0.002   # without a step cadence to predict: poll finely this long after a
                                    # submission while a request waits for its first token (the daemon's
                                    # pick-up and a short prefill; busy polling would add up to 1 ms to TTFT)
    busy_interval_s: float = 0.001  # poll interval while requests are in flight
    idle_interval_s: float = 0.02   # poll interval with nothing in flight (health only)
    max_slots_per_poll: int = 1024  # token reads per poll; the rest next poll
    full_scan_interval_s: float = 0.1   # read every slot this often; otherwise only the watched arc
    scalar_max_flights: int = 128   # up to this many requests in flight, check slots one by one (struct),
                                    # above it with numpy over the snapshot
    # step prediction (see the module docstring); predict_min_step_s = 0 turns it off
    step_merge_s: float = 0.002         # publishes closer than this to a step's first one belong to that step
    predict_min_step_s: float = 0.004   # shorter steps: busy polling is close enough
    predict_lead_s: float = 0.0015      # wake this long before the step is due with event-loop timers (~1 ms coarse)
    predict_lead_precise_s: float = 0.0003   # ... with the ring client's wake-up timer (wakeup_timer.py):
                                        # the wake-up itself (~0.1 ms on a VM) plus the step's jitter
    predict_window_s: float = 0.003     # poll finely until this long after it was due, then busy polling
    predict_poll_s: float = 0.0002      # with precise wake-ups, poll around a due step every
                                        # spread / predict_polls_per_spread (spread: longest minus shortest
                                        # recent step gap), at most this; below fine_sleep_s: fine polls.
    predict_polls_per_spread: int = 10  # A steady daemon (null, --step-ms) is met with fine polls; one whose
                                        # steps jitter by ms (a model on a shared core) with 0.2 ms polls, not
                                        # ~50 fine polls a step that took the daemon's CPU (SmolLM2, 1 stream,
                                        # frontend and daemon on one core: 1.7 ms of frontend CPU a token)
    predict_history: int = 8            # step gaps remembered
    fine_sleep_s: float = 10e-6         # fine polls with an idle event loop block this long in between
                                        # (~0.08 ms with the wake-up on a VM) instead of spinning; 0: spin
    bell_trust_s: float = 0.25          # a doorbell heard this recently wakes the reader: it polls on the bell
                                        # (and every bell_fallback_s); longer without one (a long prefill, a
                                        # daemon that stopped ringing): step prediction again
    bell_fallback_s: float = 0.01       # with a trusted bell, poll at least this often anyway
    fine_sleep_when_flowing: bool = True   # also while tokens flow (an empty poll right after progress):
                                        # a reader spinning on the core its clients share starved them (null
                                        # daemon, 1 stream: p99 4.4 -> 0.35 ms, tokens/s +18%, fewer events)


@dataclasses.dataclass
class PollResult:
    progress: bool = False      # tokens delivered or slots completed
    freed: int = 0              # slots reset to EMPTY (the wait queue may move)
    backlog: bool = False       # capped: more slots to look at right away
    states: np.ndarray | None = None   # [slots] state words as the frontend now knows them
    frontend_epoch: int = 0            # header word: changes if another frontend attached


class TokenReader:
    def __init__(self, session: RingSession, health: HealthMonitor, config: ReaderConfig = ReaderConfig(),
                 precise_wake: bool = False):
        self.session = session
        self.health = health
        self.config = config
        self.set_precise_wake(precise_wake)
        self.urgent: set[int] = set()     # slots submitted whose first token we have not seen
        self._last_progress_s = 0.0
        self._last_submit_s = 0.0
        self._last_full_s = 0.0
        self._header: bytes | None = None   # header bytes last given to the health monitor
        self._frontend_epoch = 0
        self.polls = 0
        # step prediction: the newest step's first publish stamp (daemon clock, ns), when that was on
        # our monotonic clock (s), and the gaps between recent steps (ns)
        self._shares_clock = bool(getattr(session.transport, "shares_clock", False))
        self._step_ns = 0
        self._prev_step_ns = 0
        self._step_local_s = 0.0
        self._slot_last_ns: dict[int, int] = {}   # slot -> stamp of the newest token handed over
        self._step_gaps: collections.deque[int] = collections.deque(maxlen=max(1, config.predict_history))
        self._newest_ns = 0    # the newest t_last_ns handed over in this poll
        self.fine = False      # the last next_interval_s() == 0 allows a fine (blocking) sleep
        self._bell_s = 0.0     # when the daemon's doorbell last rang (monotonic s; 0: not on this session)

    def heard_bell(self, now_s: float) -> None:
        """The daemon's doorbell rang (the ring client polls right after)."""
        self._bell_s = now_s

    def set_precise_wake(self, precise: bool) -> None:
        """Whether the caller's sleeps end within microseconds of their time (RingClient's timerfd):
        then wake closer to a predicted step and poll around it by its jitter."""
        self.precise_wake = precise
        self.lead_s = self.config.predict_lead_precise_s if precise else self.config.predict_lead_s

    def track(self, flight: Flight) -> None:
        self.urgent.add(flight.slot)
        self._slot_last_ns.pop(flight.slot, None)
        self._last_progress_s = self._last_submit_s = time.monotonic()   # spin for the first token

    def poll(self) -> PollResult:
        s = self.session
        snap = s.snapshot
        tracker = s.tracker
        now_s = time.monotonic()
        full = now_s - self._last_full_s >= self.config.full_scan_interval_s
        if full:
            snap.refresh_full(tracker.held)
            self._last_full_s = now_s
        else:
            snap.refresh_watched(tracker.held, tracker.version)
        self.polls += 1
        header = snap.header_bytes()
        if header != self._header:
            # observe() of an unchanged header changes nothing: skip the record decoding then.
            self._header = header
            rec = snap.header[0]
            self.health.observe(rec, now_s)
            self._frontend_epoch = int(rec["frontend_epoch"])
        states = snap.states
        if full:
            # Between full reads the cache only changes where we watch, and the tracker
            # already follows our own takes and resets.
            tracker.refresh(states)
        res = PollResult(states=states, frontend_epoch=self._frontend_epoch)

        # Completed slots nobody here holds: left by an earlier frontend.
        foreign = [i for i in snap.foreign_slots if states[i] == _COMPLETED]
        # Our slots that moved: new tokens, completion, or (never expected) another seq.
        if len(s.flights) <= self.config.scalar_max_flights:
            moved = self._moved_scalar()
        else:
            moved = self._moved_vector()
        if len(moved) > self.config.max_slots_per_poll:
            urgent = self.urgent
            first = [m for m in moved if m[0] in urgent]
            rest = [m for m in moved if m[0] not in urgent]
            moved = (first + rest)[:self.config.max_slots_per_poll]
            res.backlog = True

        resets: list[int] = foreign
        flights = s.flights
        self._newest_ns = 0
        for slot, words in moved:
            flight = flights.get(slot)
            if flight is None:   # held but unknown: cannot happen; never touch it
                continue
            if self._read_slot(flight, _Progress._make(words), resets):
                res.progress = True
        if resets:
            s.write_resets(resets)
            for slot in resets:
                s.retire(slot)
                self._slot_last_ns.pop(slot, None)
                self.urgent.discard(slot)
            snap.mark_empty(resets)
            res.freed = len(resets)
            res.progress = True
        if res.progress:
            # After the handover, which may have written chunks (stream_push): spin from here.
            self._last_progress_s = time.monotonic()
        if self._newest_ns:
            self._observe_step(self._newest_ns, now_s)
        return res

    def _observe_step(self, t_ns: int, now_s: float) -> None:
        """A token stamped t_ns (daemon clock) was handed over: a new step if it is step_merge_s
        past the current step's first stamp."""
        if t_ns - self._step_ns < self.config.step_merge_s * 1e9:
            return
        if self._step_ns:
            self._step_gaps.append(t_ns - self._step_ns)
        self._prev_step_ns, self._step_ns = self._step_ns, t_ns
        # Our clock: the stamp itself when we share the daemon's, else when we saw it.
        self._step_local_s = t_ns / 1e9 if self._shares_clock else now_s

    def step_period_s(self) -> float | None:
        """The daemon's step period as seen lately, or None (too few steps, or too short to predict)."""
        cfg = self.config
        if cfg.predict_min_step_s <= 0 or len(self._step_gaps) < 2:
            return None
        period = min(self._step_gaps) / 1e9
        return period if period >= cfg.predict_min_step_s else None

    def step_spread_s(self) -> float:
        """How much the recent step gaps differ (longest minus shortest): the predicted step's jitter."""
        gaps = self._step_gaps
        return (max(gaps) - min(gaps)) / 1e9 if len(gaps) >= 2 else 0.0

    def _step_complete(self) -> bool:
        """Every request that got a token in the previous step has got one in the newest step too
        (a step's tokens are published slot after slot: a preempted daemon can leave a tail)."""
        merge = int(self.config.step_merge_s * 1e9)   # a step's stamps: up to this before its anchor too
        prev, cur = self._prev_step_ns - merge, self._step_ns - merge
        last = self._slot_last_ns
        for slot in self.session.flights:
            t = last.get(slot, 0)
            if prev <= t < cur:
                return False
        return True

    def _moved_scalar(self) -> list[tuple[int, tuple]]:
        """(slot, progress words) of our slots that moved, one struct unpack per flight: cheaper
        than the numpy gathers when few requests are in flight."""
        progress = self.session.snapshot.progress
        moved = []
        for slot, f in self.session.flights.items():
            w = progress(slot)
            if w[0] == _COMPLETED or w[3] != f.received or w[1] != f.seq:
                moved.append((slot, w))
        if len(moved) > 1:
            moved.sort()
        return moved

    def _moved_vector(self) -> list[tuple[int, tuple]]:
        """The same as `_moved_scalar`, vectorised over the snapshot: for many requests in flight."""
        s = self.session
        slots = s.snapshot.slots
        hidx = np.flatnonzero(s.tracker.held)
        mine = slots[hidx]   # [held] records, gathered
        moved = hidx[(mine["state"] == SlotState.DECODE_COMPLETED) | (mine["generated"] != s.received[hidx])
                     | (mine["seq"] != s.seqs[hidx])]
        if moved.size == 0:
            return []
        # One gather per column, then plain ints: per-slot numpy record access is slow.
        cols = [slots[name][moved].tolist() for name in PROGRESS_FIELDS]
        return list(zip(moved.tolist(), zip(*cols)))

    def _read_slot(self, flight: Flight, p: "_Progress", resets: list[int]) -> bool:
        """Hand over what moved in one of our slots; True if anything did."""
        s = self.session
        if p.seq != flight.seq or p.epoch != s.epoch:
            # Another writer reused our slot (a second frontend on this ring). Its tokens are
            # not ours: end the request and forget the slot without touching it again.
            if flight.handle is not None:
                flight.handle._end("error", f"slot {flight.slot} was taken over by another frontend "
                                            f"(seq {p.seq}, epoch {p.epoch})")
            s.flights.pop(flight.slot, None)
            return True
        completed = p.state == SlotState.DECODE_COMPLETED
        if completed:
            # Final count, finish words and timestamps, read after the state word that covers them.
            rec = s.read_slot(flight.slot)
            p = _Progress(*(int(rec[name]) for name in PROGRESS_FIELDS))
        gen = min(p.generated, flight.max_tokens)
        if gen == flight.max_tokens > flight.received and not completed:
            # The request's last token, published before the daemon marks the slot complete (the
            # same step): hold it for the completion, a poll or two later, so the end of the stream
            # (last chunk, finish reason, usage, [DONE]) leaves in one write, not two.
            return False
        h = flight.handle
        moved = False
        if gen > flight.received:
            tokens = s.read_tokens(flight, flight.received, gen) if h is not None else []
            records = None
            if h is not None and flight.logprobs is not None:
                records = s.read_logprobs(flight, flight.received, gen)
            if h is not None and flight.prompt_logprobs is not None and flight.received == 0:
                h.prompt_logprobs = s.read_prompt_logprobs(flight)
            flight.received = gen
            s.received[flight.slot] = gen
            self.urgent.discard(flight.slot)
            moved = True
            self._slot_last_ns[flight.slot] = p.t_last_ns
            if p.t_last_ns > self._newest_ns:
                self._newest_ns = p.t_last_ns
            if h is not None:   # nobody listens to an abandoned slot: its tokens are skipped
                h.t_picked_ns, h.t_first_ns, h.t_last_ns = p.t_picked_ns, p.t_first_ns, p.t_last_ns
                if flight.extra_stops:
                    tokens, stopped = _cut_at_stop(tokens, flight.extra_stops)
                    h._deliver(tokens, final=completed or stopped,
                               records=None if records is None else records[:len(tokens)])
                    if stopped and not h.finished:
                        h._end("stop")
                        flight.handle = None
                        if not completed:
                            s.write_cancels([flight.slot])
                else:
                    h._deliver(tokens, final=completed, records=records)
                h = flight.handle   # None if the stop cut it or _deliver cancelled it (consumer too slow)
        if completed:
            if h is not None:
                h.t_picked_ns, h.t_first_ns, h.t_last_ns = p.t_picked_ns, p.t_first_ns, p.t_last_ns
                h._end(*finish_of(int(rec["finish_reason"]), int(rec["error_code"])))
            resets.append(flight.slot)
            moved = True
        return moved

    def next_interval_s(self, res: PollResult | None) -> float:
        """How long to sleep before the next poll (0: poll again soon; `fine` says whether the
        ring client may block for fine_sleep_s first instead of only yielding)."""
        cfg = self.config
        self.fine = False
        if res is not None and res.backlog:
            return 0.0   # capped: more to read right away
        now = time.monotonic()
        if self._bell_s and self.session.flights and now - self._bell_s < cfg.bell_trust_s:
            return cfg.bell_fallback_s   # the next bell wakes us: every step's words are out by then
        period = self.step_period_s() if self.session.flights else None
        complete = period is not None and self._step_complete()
        if now - self._last_progress_s < cfg.spin_s and (not complete or self.urgent):
            # Right after progress, unless the step is known complete and nothing waits for a first
            # token: then the next tokens come with the next step, and the reader sleeps until then.
            self.fine = cfg.fine_sleep_when_flowing and res is not None and not res.progress
            return 0.0
        if not self.session.flights:
            return cfg.idle_interval_s
        if period is None and self.urgent and now - self._last_submit_s < cfg.first_token_spin_s:
            self.fine = True
            return 0.0
        if period is not None:
            start = self._step_local_s
            if not complete:
                # Part of the newest step is still to come: poll finely for a while, then busily.
                if now <= start + cfg.predict_window_s:
                    self.fine = True
                    return 0.0
                return cfg.busy_interval_s
            due = start + period
            if now < due - self.lead_s:
                return min(due - self.lead_s - now, cfg.idle_interval_s)
            if now <= due + cfg.predict_window_s:
                if self.precise_wake:
                    every = self.step_spread_s() / max(1, cfg.predict_polls_per_spread)
                    if every > cfg.fine_sleep_s:
                        return min(every, cfg.predict_poll_s)
                self.fine = True
                return 0.0
        return cfg.busy_interval_s


def _cut_at_stop(tokens: list[int], stops: frozenset[int]) -> tuple[list[int], bool]:
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[:i + 1], True
    return tokens, False
