"""Token reader (paper §4.4): one bulk read per poll, new tokens out to the handles.

    poll: read header + all slot records (one Transport.read)
          -> health.observe(header), tracker.refresh(states)
          -> slots whose generated count, state or seq moved (vectorised over the snapshot)
          -> read tokens [received, generated) per slot -> handle._deliver
          -> DECODE_COMPLETED: re-read the record, last tokens, handle._end, reset to EMPTY
    pace: spin while tokens flow, then `busy_interval_s` while requests are in flight,
          `idle_interval_s` when none are.

Newly submitted slots are "urgent": they are looked at first, so under a per-poll
cap the first token of a new request is never starved by long-running ones. A
slot's tokens are handed over only when its seq and epoch are the ones we wrote.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from shared_layout import ErrorCode, FinishReason, SlotState

from .backend_health import HealthMonitor
from .ring_session import Flight, RingSession

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


@dataclasses.dataclass(frozen=True)
class ReaderConfig:
    spin_s: float = 200e-6          # keep polling back to back this long after progress
    busy_interval_s: float = 0.001  # poll interval while requests are in flight
    idle_interval_s: float = 0.02   # poll interval with nothing in flight (health only)
    max_slots_per_poll: int = 1024  # token reads per poll; the rest next poll


@dataclasses.dataclass
class PollResult:
    progress: bool = False      # tokens delivered or slots completed
    freed: int = 0              # slots reset to EMPTY (the wait queue may move)
    backlog: bool = False       # capped: more slots to look at right away
    states: np.ndarray | None = None   # [slots] state words of this snapshot
    frontend_epoch: int = 0            # header word: changes if another frontend attached


class TokenReader:
    def __init__(self, session: RingSession, health: HealthMonitor, config: ReaderConfig = ReaderConfig()):
        self.session = session
        self.health = health
        self.config = config
        self.urgent: set[int] = set()     # slots submitted whose first token we have not seen
        self._last_progress_s = 0.0
        self.polls = 0

    def track(self, flight: Flight) -> None:
        self.urgent.add(flight.slot)
        self._last_progress_s = time.monotonic()   # spin for the first token

    def poll(self) -> PollResult:
        s = self.session
        header, slots = s.read_snapshot()
        now_s = time.monotonic()
        self.polls += 1
        self.health.observe(header, now_s)
        states = slots["state"]
        s.tracker.refresh(states)
        held = s.tracker.held
        res = PollResult(states=states, frontend_epoch=int(header["frontend_epoch"]))
        done = states == SlotState.DECODE_COMPLETED

        # Completed slots nobody here holds: left by an earlier frontend.
        foreign = np.flatnonzero(done & ~held).tolist()
        # Our slots that moved: new tokens, completion, or (never expected) another seq.
        moved = np.flatnonzero(held & (done | (slots["generated"] != s.received)
                                       | (slots["seq"] != s.seqs))).tolist()
        if len(moved) > self.config.max_slots_per_poll:
            first = [i for i in moved if i in self.urgent]
            rest = [i for i in moved if i not in self.urgent]
            moved = (first + rest)[:self.config.max_slots_per_poll]
            res.backlog = True

        resets: list[int] = list(foreign)
        for slot in moved:
            flight = s.flights.get(slot)
            if flight is None:   # held but unknown: cannot happen; never touch it
                continue
            if self._read_slot(flight, slots[slot], resets):
                res.progress = True
        if resets:
            s.write_resets(resets)
            for slot in resets:
                s.retire(slot)
                self.urgent.discard(slot)
            res.freed = len(resets)
            res.progress = True
            res.states = states.copy()
            res.states[resets] = SlotState.EMPTY   # what the ring holds now, for stats
        if res.progress:
            self._last_progress_s = now_s
        return res

    def _read_slot(self, flight: Flight, rec: np.void, resets: list[int]) -> bool:
        """Hand over what moved in one of our slots; True if anything did."""
        s = self.session
        if int(rec["seq"]) != flight.seq or int(rec["epoch"]) != s.epoch:
            # Another writer reused our slot (a second frontend on this ring). Its tokens are
            # not ours: end the request and forget the slot without touching it again.
            if flight.handle is not None:
                flight.handle._end("error", f"slot {flight.slot} was taken over by another frontend "
                                            f"(seq {int(rec['seq'])}, epoch {int(rec['epoch'])})")
            s.flights.pop(flight.slot, None)
            return True
        state = int(rec["state"])
        if state == SlotState.DECODE_COMPLETED:
            rec = s.read_slot(flight.slot)   # final count and finish words, read after the state
        gen = min(int(rec["generated"]), flight.max_tokens)
        h = flight.handle
        moved = False
        if gen > flight.received:
            tokens = s.read_tokens(flight, flight.received, gen)
            flight.received = gen
            s.received[flight.slot] = gen
            self.urgent.discard(flight.slot)
            moved = True
            if h is not None:
                h.t_picked_ns, h.t_first_ns, h.t_last_ns = (int(rec["t_picked_ns"]), int(rec["t_first_ns"]),
                                                            int(rec["t_last_ns"]))
                if flight.extra_stops:
                    tokens, stopped = _cut_at_stop(tokens, flight.extra_stops)
                    h._deliver(tokens)
                    if stopped and not h.finished:
                        h._end("stop")
                        flight.handle = None
                        if state != SlotState.DECODE_COMPLETED:
                            s.write_cancels([flight.slot])
                        h = None
                else:
                    h._deliver(tokens)
                h = flight.handle   # _deliver may have cancelled it (consumer too slow)
        if state == SlotState.DECODE_COMPLETED:
            if h is not None:
                h.t_picked_ns, h.t_first_ns, h.t_last_ns = (int(rec["t_picked_ns"]), int(rec["t_first_ns"]),
                                                            int(rec["t_last_ns"]))
                reason, err = finish_of(int(rec["finish_reason"]), int(rec["error_code"]))
                h._end(reason, err)
            resets.append(flight.slot)
            moved = True
        return moved

    def next_interval_s(self, res: PollResult | None) -> float:
        """How long to sleep before the next poll (0: just yield to the event loop)."""
        if res is not None and res.backlog:
            return 0.0
        if time.monotonic() - self._last_progress_s < self.config.spin_s:
            return 0.0
        if self.session.flights:
            return self.config.busy_interval_s
        return self.config.idle_interval_s


def _cut_at_stop(tokens: list[int], stops: frozenset[int]) -> tuple[list[int], bool]:
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[:i + 1], True
    return tokens, False
