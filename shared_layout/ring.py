"""Accessors over a ring held in any writable buffer (mmap, bytearray, numpy).

`Ring` maps the header, the slot records and both token arenas as numpy views
of one buffer. The two sides use it through `FrontendPort` and `BackendPort`,
which only offer the writes their side owns and check every state change
against the transition table (states.py):

    frontend: submit (prompt tokens + sampling data, request fields, then the state word)
              -> poll progress (state, seq, generated) -> read tokens (and their logprob
              records) below the count -> reset a completed slot to EMPTY; cancel any time
    backend:  claim a pending slot -> publish prompt logprobs (before the first count)
              -> publish tokens (token and its logprob record first, count after)
              -> complete (finish reason, error code, then the state word)

Transports that cannot map the ring (RDMA) use `submit_writes`, which turns a
submission into the same ordered list of byte writes the shared-memory path
applies, so both paths follow one recipe.
"""
from __future__ import annotations

import dataclasses
import math
import struct
import threading
import time

import numpy as np

from .extra import SamplingExtra, encode_extra
from .layout import (FLAG_HAS_SEED, FLAG_IGNORE_EOS, FLAG_LOGPROBS, FLAG_PROMPT_LOGPROBS, HEADER, HEADER_DTYPE, LOGPROBS_OFF, MAX_LOGPROBS,
                     MAX_STOP_IDS, SLOT, SLOT_DTYPE, TOKEN_DTYPE, LayoutMismatch, RingGeometry, extra_words,
                     logprob_record_words)
from .states import (BackendStatus, ErrorCode, FinishReason, IllegalTransition, Side, SlotState,
                     OWNER, check_transition, check_write)

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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logprobs: int = LOGPROBS_OFF          # top entries per generated token's record; LOGPROBS_OFF: no records
    prompt_logprobs: int = LOGPROBS_OFF   # top entries per prompt token's record
    logprobs_offset: int = 0              # logprob arena words of the records (frontend-allocated)
    prompt_logprobs_offset: int = 0
    extra_offset: int = 0                 # prompt arena word of `extra`'s encoding
    extra: SamplingExtra = SamplingExtra()
    group_size: int = 0                   # n choices of one prompt (0 / 1: alone)
    group_index: int = 0                  # 0: the group's leader
    group_seq: int = 0                    # the leader's seq
    priority: int = 0                     # lower runs first
    ttft_slo_ms: int = 0                  # 0: the daemon's default
    tbt_slo_ms: int = 0

    def __post_init__(self):
        if len(self.stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids fit in a slot, got {len(self.stop_ids)}")

    def logprob_words(self) -> tuple[int, int]:
        """(words for the generated tokens' records, words for the prompt tokens' records)."""
        gen = self.max_tokens * logprob_record_words(self.logprobs) if self.logprobs >= 0 else 0
        prompt = ((self.prompt_len - 1) * logprob_record_words(self.prompt_logprobs)
                  if self.prompt_logprobs >= 0 else 0)
        return gen, prompt

    def record(self) -> np.ndarray:
        """This request as one slot record (state EMPTY, progress zeroed)."""
        return np.frombuffer(bytearray(self.record_bytes()), SLOT_DTYPE, 1)

    def record_bytes(self) -> bytes:
        """The same record as bytes (one struct pack: the submit path's cost per request)."""
        v = dict(
            seq=self.seq, epoch=self.epoch, prompt_offset=self.prompt_offset, prompt_len=self.prompt_len,
            output_offset=self.output_offset, max_tokens=self.max_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, t_submit_ns=self.t_submit_ns,
            flags=((FLAG_IGNORE_EOS if self.ignore_eos else 0) | (FLAG_HAS_SEED if self.seed is not None else 0)
                   | (FLAG_LOGPROBS if self.logprobs >= 0 else 0)
                   | (FLAG_PROMPT_LOGPROBS if self.prompt_logprobs >= 0 else 0)),
            seed=0 if self.seed is None else self.seed & 0xFFFFFFFFFFFFFFFF,
            n_stop_ids=len(self.stop_ids), stop_ids=self.stop_ids + (0,) * (MAX_STOP_IDS - len(self.stop_ids)),
            priority=self.priority, ttft_slo_ms=self.ttft_slo_ms, tbt_slo_ms=self.tbt_slo_ms)
        if self.extra or self.logprobs >= 0 or self.prompt_logprobs >= 0 or self.group_size:
            v.update(logprobs=max(self.logprobs, 0), prompt_logprobs=max(self.prompt_logprobs, 0),
                     logprobs_offset=self.logprobs_offset, prompt_logprobs_offset=self.prompt_logprobs_offset,
                     extra_offset=self.extra_offset, group_size=self.group_size, group_index=self.group_index,
                     group_seq=self.group_seq)
            v["n_logit_bias"], v["n_allowed_ids"], v["bad_words_words"] = self.extra.counts
            v["automaton_words"] = self.extra.automaton_words
        v.update(presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                 repetition_penalty=self.repetition_penalty, min_p=self.min_p, min_tokens=self.min_tokens)
        return _SLOT_PACK(*_slot_values(v))

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
                   epoch=int(r["epoch"]), t_submit_ns=int(r["t_submit_ns"]),
                   presence_penalty=float(r["presence_penalty"]), frequency_penalty=float(r["frequency_penalty"]),
                   repetition_penalty=float(r["repetition_penalty"]), min_p=float(r["min_p"]),
                   min_tokens=int(r["min_tokens"]),
                   logprobs=int(r["logprobs"]) if flags & FLAG_LOGPROBS else LOGPROBS_OFF,
                   prompt_logprobs=int(r["prompt_logprobs"]) if flags & FLAG_PROMPT_LOGPROBS else LOGPROBS_OFF, logprobs_offset=int(r["logprobs_offset"]),
                   prompt_logprobs_offset=int(r["prompt_logprobs_offset"]), extra_offset=int(r["extra_offset"]),
                   group_size=int(r["group_size"]), group_index=int(r["group_index"]), group_seq=int(r["group_seq"]),
                   priority=int(r["priority"]), ttft_slo_ms=int(r["ttft_slo_ms"]), tbt_slo_ms=int(r["tbt_slo_ms"]))


def _slot_struct() -> tuple[struct.Struct, list[tuple[str, int]]]:
    """A struct packing a whole slot record (padding as zero bytes), and its fields in order."""
    fmt, at, order = "<", 0, []
    for f in SLOT.fields:
        fmt += f"{f.offset - at}x" if f.offset > at else ""
        fmt += {"u32": "I", "i32": "i", "u64": "Q", "i64": "q", "f32": "f"}[f.kind] * f.count
        at = f.offset + f.size
        order.append((f.name, f.count))
    fmt += f"{SLOT.size - at}x" if SLOT.size > at else ""
    return struct.Struct(fmt), order


_SLOT_STRUCT, _SLOT_ORDER = _slot_struct()
_SLOT_PACK = _SLOT_STRUCT.pack


def _slot_values(v: dict) -> list:
    """Field values in record order (missing ones 0; arrays spread)."""
    out = []
    for name, count in _SLOT_ORDER:
        x = v.get(name, 0)
        if count == 1:
            out.append(x)
        else:
            out.extend(x if x else (0,) * count)
    return out


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
    pres, freq, rep, min_p = (float(r[n]) for n in ("presence_penalty", "frequency_penalty",
                                                     "repetition_penalty", "min_p"))
    if not all(math.isfinite(v) for v in (pres, freq, rep, min_p)):
        return ErrorCode.INVALID_REQUEST
    if not (-2.0 <= pres <= 2.0 and -2.0 <= freq <= 2.0 and 0.0 <= rep <= 2.0 and 0.0 <= min_p <= 1.0):
        return ErrorCode.INVALID_REQUEST
    if int(r["min_tokens"]) > mt:
        return ErrorCode.INVALID_REQUEST
    extra = extra_words(int(r["n_logit_bias"]), int(r["n_allowed_ids"]), int(r["bad_words_words"]),
                        int(r["automaton_words"]))
    if int(r["extra_offset"]) + extra > geom.prompt_arena_tokens:
        return ErrorCode.INVALID_REQUEST
    gsize, gidx = int(r["group_size"]), int(r["group_index"])
    if gsize > 1 and (gidx >= gsize or (gidx == 0 and int(r["group_seq"]) != int(r["seq"]))):
        return ErrorCode.INVALID_REQUEST
    flags = int(r["flags"])
    for flag, k_name, off_name, records in ((FLAG_LOGPROBS, "logprobs", "logprobs_offset", mt),
                                            (FLAG_PROMPT_LOGPROBS, "prompt_logprobs", "prompt_logprobs_offset",
                                             plen - 1)):
        if not flags & flag:
            continue
        k = int(r[k_name])
        if not 0 <= k <= MAX_LOGPROBS or int(r[off_name]) + records * logprob_record_words(k) > geom.logprob_arena_words:
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
    rec = req.record_bytes()
    body_start = SLOT.offset("cancel")          # everything after the state word
    state = np.array([SlotState.PREFILL_PENDING], "<u4").tobytes()
    writes = [(geom.prompt_token_offset(req.prompt_offset), prompt.tobytes())]
    if req.extra:
        writes.append((geom.prompt_token_offset(req.extra_offset), encode_extra(req.extra).tobytes()))
    return writes + [
        (geom.slot_offset(slot) + body_start, rec[body_start:]),
        (geom.slot_field_offset(slot, "state"), state),
    ]


def doorbell_write(value: int) -> tuple[int, bytes]:
    """The header write that rings the frontend doorbell with `value`: after a batch's state words
    and cancel flags, so a scheduler that sees the new value sees them (layout.py)."""
    return HEADER.offset("frontend_doorbell"), np.array([value], "<u8").tobytes()


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
        self.logprob_arena = np.frombuffer(mv, "<i4", geom.logprob_arena_words, geom.logprob_arena_offset)  # f32/i32 words
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
        self.ring_doorbell()

    def cancel(self, slot: int) -> None:
        """Raise the cancel flag; the backend ends the request within one step."""
        self.ring.cancel_flags[slot] = 1
        self.ring_doorbell()

    def ring_doorbell(self) -> None:
        """Bump the header's frontend_doorbell (this side is its only writer)."""
        fence()  # the state words and cancel flags before the bell that announces them
        self.ring.header["frontend_doorbell"] = int(self.ring.header["frontend_doorbell"]) + 1

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
        self.writes = 0     # publish() and complete() calls: what a frontend waits for (the doorbell)
        # publish()'s columns: a field of a record (ring.slots[slot]["..."]) costs a record object and a
        # field lookup each; one token's publish was ~90 us of a 1-row decode step's Python that way
        slots = ring.slots
        self._output_offset, self._max_tokens = slots["output_offset"], slots["max_tokens"]
        self._t_first_ns, self._t_last_ns = slots["t_first_ns"], slots["t_last_ns"]
        self._writable = frozenset(int(s) for s in SlotState if OWNER[s] == self.side)   # what check_write passes

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

    def publish(self, slot: int, tokens, now: int | None = None, logprob_records: np.ndarray | None = None) -> None:
        """Append tokens (and their logprob records, [tokens, stride] words, when the slot asks for
        them) to the slot's output, then raise the generated count."""
        ring = self.ring
        state = int(ring.state[slot])
        if state not in self._writable:
            check_write(state, self.side)     # raises, naming the owner
        gen, off, cap = int(ring.generated[slot]), int(self._output_offset[slot]), int(self._max_tokens[slot])
        tokens = np.atleast_1d(np.asarray(tokens, TOKEN_DTYPE))
        if gen + tokens.size > cap:
            raise IllegalTransition(f"slot {slot}: {gen + tokens.size} tokens exceed max_tokens {cap}")
        if logprob_records is not None:
            self._write_records(ring.slots[slot], "logprobs", "logprobs_offset", gen, logprob_records)
        ring.output_arena[off + gen: off + gen + tokens.size] = tokens
        t = now_ns() if now is None else now
        if gen == 0:
            self._t_first_ns[slot] = t
        self._t_last_ns[slot] = t
        fence()  # tokens before the count that makes them visible
        ring.generated[slot] = gen + tokens.size
        self.writes += 1

    def publish_prompt_logprobs(self, slot: int, records: np.ndarray) -> None:
        """The prompt tokens' logprob records ([prompt_len - 1, stride] words), before the first
        token's count (which covers them: the frontend reads them once it sees a token)."""
        check_write(int(self.ring.state[slot]), self.side)
        self._write_records(self.ring.slots[slot], "prompt_logprobs", "prompt_logprobs_offset", 0, records)

    def _write_records(self, r: np.void, k_name: str, off_name: str, first: int, records: np.ndarray) -> None:
        """Records [n, stride] int32 words (float32 logprobs as their bits) at record index `first`."""
        stride = logprob_record_words(int(r[k_name]))
        if records.ndim != 2 or records.shape[1] != stride:
            raise IllegalTransition(f"logprob records of shape {records.shape}, the slot's stride is {stride}")
        start = int(r[off_name]) + first * stride
        self.ring.logprob_arena[start:start + records.size] = records.reshape(-1)

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
        self.writes += 1

    def beat(self) -> None:
        """Advance the heartbeat (the frontend's /health watches it)."""
        h = self.ring.header
        h["backend_heartbeat_ns"] = now_ns()
        h["backend_heartbeat"] = int(h["backend_heartbeat"]) + 1
