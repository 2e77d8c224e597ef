"""Accessors over a ring held in any writable buffer (mmap, bytearray, numpy).

`Ring` maps the header, the slot records and both token arenas as numpy views
of one buffer. The two sides use it through `FrontendPort` and `BackendPort`,
which only offer the writes their side owns and check every state change
against the transition table (states.py):

    frontend: submit (prompt tokens, request fields, then the state word)
              -> poll progress (state, seq, generated) -> read tokens below the count
              -> reset a completed slot to EMPTY; cancel any time
    backend:  claim a pending slot -> publish tokens (token first, count after)
              -> complete (finish reason, error code, then the state word)

Transports that cannot map the ring (RDMA) use `submit_writes`, which turns a
submission into the same ordered list of byte writes the shared-memory path
applies, so both paths follow one recipe.
"""
from __future__ import annotations

import dataclasses
import math
import threading
import time

import numpy as np

from .layout import (FLAG_HAS_SEED, FLAG_IGNORE_EOS, HEADER, HEADER_DTYPE, MAX_STOP_IDS, SLOT,
                     SLOT_DTYPE, TOKEN_DTYPE, LayoutMismatch, RingGeometry)
from .states import (BackendStatus, ErrorCode, FinishReason, IllegalTransition, Side, SlotState,
                     check_transition, check_write)

_FENCE_LOCK = threading.Lock()
_PREFILL_PENDING = int(SlotState.PREFILL_PENDING)     # compared against the whole state array each step


def fence() -> None:
    """Full memory barrier between this process's earlier and later ring accesses.

    CPython has no fence primitive; acquiring and releasing a pthread mutex is a
    full barrier on every architecture (x86 needs none for store->store order,
    aarch64 DPU cores do).
    """
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


def now_ns() -> int:
    """The clock both Python sides stamp with (monotonic, shared across processes)."""
    return time.monotonic_ns()


@dataclasses.dataclass(frozen=True)
class SlotRequest:
    """What the frontend writes into a slot to submit one request."""
    seq: int
    prompt_offset: int
    prompt_len: int
    output_offset: int
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_ids: tuple[int, ...] = ()
    epoch: int = 0
    t_submit_ns: int = 0

    def __post_init__(self):
        if len(self.stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids fit in a slot, got {len(self.stop_ids)}")

    def record(self) -> np.ndarray:
        """This request as one slot record (state EMPTY, progress zeroed)."""
        rec = np.zeros(1, SLOT_DTYPE)
        r = rec[0]
        for name in ("seq", "epoch", "prompt_offset", "prompt_len", "output_offset", "max_tokens",
                     "temperature", "top_p", "top_k", "t_submit_ns"):
            r[name] = getattr(self, name)
        r["flags"] = (FLAG_IGNORE_EOS if self.ignore_eos else 0) | (FLAG_HAS_SEED if self.seed is not None else 0)
        r["seed"] = 0 if self.seed is None else self.seed & 0xFFFFFFFFFFFFFFFF
        r["n_stop_ids"] = len(self.stop_ids)
        r["stop_ids"][:len(self.stop_ids)] = self.stop_ids
        return rec

    @classmethod
    def from_record(cls, r: np.void) -> "SlotRequest":
        flags = int(r["flags"])
        n_stop = min(int(r["n_stop_ids"]), MAX_STOP_IDS)
        return cls(seq=int(r["seq"]), prompt_offset=int(r["prompt_offset"]), prompt_len=int(r["prompt_len"]),
                   output_offset=int(r["output_offset"]), max_tokens=int(r["max_tokens"]),
                   temperature=float(r["temperature"]), top_p=float(r["top_p"]), top_k=int(r["top_k"]),
                   seed=int(r["seed"]) if flags & FLAG_HAS_SEED else None,
                   ignore_eos=bool(flags & FLAG_IGNORE_EOS),
                   stop_ids=tuple(int(t) for t in r["stop_ids"][:n_stop]),
                   epoch=int(r["epoch"]), t_submit_ns=int(r["t_submit_ns"]))


def request_error(geom: RingGeometry, r: np.void) -> ErrorCode:
    """Validate a slot record as the backend must before touching the arenas.

    Works on the raw record (not SlotRequest) so corrupted fields cannot raise.
    """
    plen, poff = int(r["prompt_len"]), int(r["prompt_offset"])
    mt, ooff = int(r["max_tokens"]), int(r["output_offset"])
    if plen <= 0 or poff + plen > geom.prompt_arena_tokens:
        return ErrorCode.INVALID_REQUEST
    if mt <= 0 or ooff + mt > geom.output_arena_tokens:
        return ErrorCode.INVALID_REQUEST
    temp, top_p = float(r["temperature"]), float(r["top_p"])
    if not math.isfinite(temp) or temp < 0 or not (0.0 < top_p <= 1.0) or int(r["top_k"]) < 0:
        return ErrorCode.INVALID_REQUEST
    if int(r["n_stop_ids"]) > MAX_STOP_IDS:
        return ErrorCode.INVALID_REQUEST
    return ErrorCode.NONE


def submit_writes(geom: RingGeometry, slot: int, req: SlotRequest, prompt: np.ndarray
                  ) -> list[tuple[int, bytes]]:
    """A submission as ordered (byte offset, data) writes; the last is the state word.

    Apply in order with a fence (or ordered RDMA WRITEs on one QP) before the last.
    """
    prompt = np.ascontiguousarray(prompt, dtype=TOKEN_DTYPE)
    if prompt.shape != (req.prompt_len,):
        raise ValueError(f"prompt has {prompt.size} tokens, request says {req.prompt_len}")
    rec = req.record().tobytes()
    body_start = SLOT.offset("cancel")          # everything after the state word
    state = np.array([SlotState.PREFILL_PENDING], "<u4").tobytes()
    return [
        (geom.prompt_token_offset(req.prompt_offset), prompt.tobytes()),
        (geom.slot_offset(slot) + body_start, rec[body_start:]),
        (geom.slot_field_offset(slot, "state"), state),
    ]


class Ring:
    """Views of one ring: header, slots, arenas. Construct with `create` or `attach`."""

    def __init__(self, buf, geom: RingGeometry):
        mv = memoryview(buf).cast("B")
        if mv.nbytes < geom.total_size:
            raise LayoutMismatch(f"buffer of {mv.nbytes} bytes cannot hold a {geom.total_size}-byte ring")
        self.buf = buf
        self.geom = geom
        self.header = np.frombuffer(mv, HEADER_DTYPE, 1, 0)[0]
        self.slots = np.frombuffer(mv, SLOT_DTYPE, geom.slot_count, geom.slots_offset)
        self.prompt_arena = np.frombuffer(mv, TOKEN_DTYPE, geom.prompt_arena_tokens, geom.prompt_arena_offset)
        self.output_arena = np.frombuffer(mv, TOKEN_DTYPE, geom.output_arena_tokens, geom.output_arena_offset)
        # Column views for the hot paths: one strided load per slot.
        self.state = self.slots["state"]
        self.cancel_flags = self.slots["cancel"]
        self.seq = self.slots["seq"]
        self.generated = self.slots["generated"]

    @classmethod
    def create(cls, buf, geom: RingGeometry) -> "Ring":
        """Format `buf` as an empty ring: header written, every slot EMPTY."""
        mv = memoryview(buf).cast("B")
        if mv.nbytes < geom.total_size:
            raise LayoutMismatch(f"buffer of {mv.nbytes} bytes cannot hold a {geom.total_size}-byte ring")
        mv[:geom.prompt_arena_offset] = bytes(geom.prompt_arena_offset)
        ring = cls(buf, geom)
        for name, value in geom.header_values().items():
            if name != "magic":
                ring.header[name] = value
        ring.header["backend_status"] = BackendStatus.DOWN
        fence()  # geometry before magic: an attacher that sees the magic sees a whole header
        ring.header["magic"] = geom.header_values()["magic"]
        return ring

    @classmethod
    def attach(cls, buf, expected: RingGeometry | None = None) -> "Ring":
        """Open an existing ring; LayoutMismatch names what does not match."""
        mv = memoryview(buf).cast("B")
        geom = RingGeometry.from_header(bytes(mv[:HEADER.size]), expected)
        return cls(buf, geom)

    # -- header words ---------------------------------------------------------
    def get(self, name: str) -> int:
        return int(self.header[name])

    def set(self, name: str, value: int) -> None:
        self.header[name] = value

    def slot_request(self, slot: int) -> SlotRequest:
        return SlotRequest.from_record(self.slots[slot])

    def tokens(self, slot: int, start: int, stop: int) -> np.ndarray:
        """Copy of output tokens [start, stop) of `slot` (caller checked the count)."""
        off = int(self.slots[slot]["output_offset"])
        return self.output_arena[off + start: off + stop].copy()

    def counts_by_state(self) -> dict[SlotState, int]:
        counts = np.bincount(np.minimum(self.state, len(SlotState)), minlength=len(SlotState) + 1)
        return {s: int(counts[s]) for s in SlotState}


class FrontendPort:
    """The frontend's writes: submit, cancel, reset. Reads are free for both sides."""

    side = Side.FRONTEND

    def __init__(self, ring: Ring):
        self.ring = ring

    def submit(self, slot: int, req: SlotRequest, prompt: np.ndarray) -> None:
        """Write the prompt and the request, then publish PREFILL_PENDING."""
        check_transition(int(self.ring.state[slot]), SlotState.PREFILL_PENDING, self.side)
        writes = submit_writes(self.ring.geom, slot, req, prompt)
        mv = memoryview(self.ring.buf).cast("B")
        for off, data in writes[:-1]:
            mv[off:off + len(data)] = data
        fence()  # prompt and request before the state word: the backend reads them after seeing PENDING
        off, data = writes[-1]
        mv[off:off + len(data)] = data

    def cancel(self, slot: int) -> None:
        """Raise the cancel flag; the backend ends the request within one step."""
        self.ring.cancel_flags[slot] = 1

    def poll(self, slot: int) -> tuple[SlotState, int, int]:
        """(state, seq, generated) of one slot; read tokens below `generated` afterwards."""
        r = self.ring.slots[slot]
        state, seq, gen = int(r["state"]), int(r["seq"]), int(r["generated"])
        fence()  # state and count before the tokens they cover
        return SlotState(state), seq, gen

    def reset(self, slot: int) -> None:
        """Hand a completed slot back: DECODE_COMPLETED -> EMPTY."""
        check_transition(int(self.ring.state[slot]), SlotState.EMPTY, self.side)
        fence()  # our reads of the finished tokens before the slot can be reused
        self.ring.state[slot] = SlotState.EMPTY


class BackendPort:
    """The backend's writes: claim, publish tokens, move states, complete."""

    side = Side.BACKEND

    def __init__(self, ring: Ring):
        self.ring = ring

    def pending(self) -> np.ndarray:
        """Indices of slots in PREFILL_PENDING, lowest submit sequence first (FCFS)."""
        idx = (self.ring.state == _PREFILL_PENDING).nonzero()[0]
        fence()  # the state words before the request fields read after this scan
        if idx.size > 1:
            order = np.lexsort((idx, self.ring.slots["t_submit_ns"][idx], self.ring.seq[idx]))
            idx = idx[order]
        return idx

    def claim(self, slot: int, now: int | None = None) -> None:
        """PREFILL_PENDING -> PREFILL_PROCESSING, stamping the pick-up time."""
        self.move(slot, SlotState.PREFILL_PROCESSING, stamp="t_picked_ns", now=now)

    def move(self, slot: int, to: SlotState, stamp: str | None = None, now: int | None = None) -> None:
        check_transition(int(self.ring.state[slot]), to, self.side)
        if stamp:
            self.ring.slots[slot][stamp] = now_ns() if now is None else now
        fence()  # fields written by this side before the state word that hands them over
        self.ring.state[slot] = to

    def publish(self, slot: int, tokens, now: int | None = None) -> None:
        """Append tokens to the slot's output, then raise the generated count."""
        check_write(int(self.ring.state[slot]), self.side)
        r = self.ring.slots[slot]
        gen, off, cap = int(r["generated"]), int(r["output_offset"]), int(r["max_tokens"])
        tokens = np.atleast_1d(np.asarray(tokens, TOKEN_DTYPE))
        if gen + tokens.size > cap:
            raise IllegalTransition(f"slot {slot}: {gen + tokens.size} tokens exceed max_tokens {cap}")
        self.ring.output_arena[off + gen: off + gen + tokens.size] = tokens
        t = now_ns() if now is None else now
        if gen == 0:
            r["t_first_ns"] = t
        r["t_last_ns"] = t
        fence()  # tokens before the count that makes them visible
        r["generated"] = gen + tokens.size

    def complete(self, slot: int, finish: FinishReason, error: ErrorCode = ErrorCode.NONE,
                 now: int | None = None) -> None:
        """Record why the request ended, then hand the slot back (DECODE_COMPLETED)."""
        check_transition(int(self.ring.state[slot]), SlotState.DECODE_COMPLETED, self.side)
        r = self.ring.slots[slot]
        r["finish_reason"] = finish
        r["error_code"] = error
        if int(r["t_last_ns"]) == 0:
            r["t_last_ns"] = now_ns() if now is None else now
        fence()  # finish reason, error and last tokens before the state word
        self.ring.state[slot] = SlotState.DECODE_COMPLETED

    def beat(self) -> None:
        """Advance the heartbeat (the frontend's /health watches it)."""
        h = self.ring.header
        h["backend_heartbeat_ns"] = now_ns()
        h["backend_heartbeat"] = int(h["backend_heartbeat"]) + 1
