"""One attachment of the frontend to one ring instance, and what it holds there.

    transport -> attach (bump frontend_epoch, reset leftovers) -> reserve (slot + arena
    ranges: prompt and its sampling data, output, logprob records) -> submission writes
    (a burst's, then one doorbell write) ... cancel writes (+ doorbell) ... completion
    -> reset writes -> free

A session owns the frontend-side state that is only meaningful for this ring
file: the epoch, the request sequence numbers, the slot tracker and the three
arenas' free space, and one `Flight` per slot this frontend wrote and has not reset. When
the ring is replaced (daemon recreated the file) the whole session is dropped
and a new one attaches; nothing carries over.
"""
from __future__ import annotations

import dataclasses
import struct
import sys

import numpy as np

from shared_layout import SLOT, SLOT_DTYPE, SlotRequest, SlotState, doorbell_write, submit_writes
from shared_layout.layout import HEADER, HEADER_DTYPE, LOGPROBS_OFF, logprob_record_words
from shared_layout.arena import ArenaFull, TokenArena

from .request_handle import RequestHandle, SamplingParams
from .slot_snapshot import SlotSnapshot
from .slot_tracker import SlotTracker
from .transport.base import Transport

_EMPTY = np.array([SlotState.EMPTY], "<u4").tobytes()
_ONE = np.array([1], "<u4").tobytes()
_NATIVE_LE = sys.byteorder == "little" and struct.calcsize("i") == 4   # ring tokens are <i4


@dataclasses.dataclass(eq=False)
class Flight:
    """A slot this frontend submitted into and has not reset yet."""
    slot: int
    seq: int
    prompt_offset: int
    output_offset: int
    max_tokens: int
    received: int = 0                        # tokens already read out of the ring
    handle: RequestHandle | None = None      # None: nobody listens any more (cancelled, lost)
    extra_stops: frozenset[int] = frozenset()  # stop ids beyond the slot's MAX_STOP_IDS
    prompt_len: int = 0
    logprobs: int | None = None              # top entries per generated token's record; None: none
    prompt_logprobs: int | None = None
    logprob_offset: int | None = None        # logprob arena words held: generated records, then the prompt's

    def logprob_words(self) -> tuple[int, int]:
        """(words of the generated tokens' records, words of the prompt tokens' records)."""
        gen = self.max_tokens * logprob_record_words(self.logprobs) if self.logprobs is not None else 0
        prompt = ((self.prompt_len - 1) * logprob_record_words(self.prompt_logprobs)
                  if self.prompt_logprobs is not None else 0)
        return gen, prompt


class RingSession:
    def __init__(self, transport: Transport, epoch: int):
        self.transport = transport
        self.geom = transport.geometry
        self.epoch = epoch
        n = self.geom.slot_count
        self.tracker = SlotTracker(n)
        self.prompts = TokenArena(self.geom.prompt_arena_tokens)
        self.outputs = TokenArena(self.geom.output_arena_tokens)
        self.logprob_arena = TokenArena(self.geom.logprob_arena_words)
        self.flights: dict[int, Flight] = {}
        self.received = np.zeros(n, np.int64)   # [slots] tokens read, per held slot
        self.seqs = np.zeros(n, np.uint64)      # [slots] seq we wrote, per held slot
        self.next_seq = 1
        self.doorbell = 0                       # the header's frontend_doorbell as we last wrote it
        self._output_base = self.geom.output_arena_offset   # byte offset of output token 0
        self.snapshot = SlotSnapshot(transport, self.geom)

    @classmethod
    def attach(cls, transport: Transport) -> "RingSession":
        """Take over the ring as a new frontend: bump the epoch, reset completed leftovers."""
        header = np.frombuffer(transport.read(0, HEADER.size), HEADER_DTYPE, 1)[0]
        epoch = int(header["frontend_epoch"]) + 1
        transport.write(HEADER.offset("frontend_epoch"), np.array([epoch], "<u8").tobytes())
        session = cls(transport, epoch)
        session.doorbell = int(header["frontend_doorbell"])
        snap = session.snapshot
        snap.refresh_full(session.tracker.held)
        done = np.flatnonzero(snap.slots["state"] == SlotState.DECODE_COMPLETED).tolist()
        session.write_resets(done)
        snap.mark_empty(done)
        session.tracker.refresh(snap.slots["state"])
        return session

    # -- reads ------------------------------------------------------------------
    def read_slot(self, slot: int) -> np.void:
        raw = self.transport.read(self.geom.slot_offset(slot), SLOT.size)
        return np.frombuffer(raw, SLOT_DTYPE, 1)[0]

    def read_logprobs(self, flight: Flight, start: int, stop: int) -> np.ndarray:
        """Logprob records of output tokens [start, stop) of `flight`: [stop - start, words] int32."""
        stride = logprob_record_words(flight.logprobs)
        raw = self.transport.read(self.geom.logprob_word_offset(flight.logprob_offset + start * stride),
                                  (stop - start) * stride * 4)
        return np.frombuffer(raw, "<i4").reshape(stop - start, stride)

    def read_prompt_logprobs(self, flight: Flight) -> np.ndarray:
        """The prompt tokens' records (tokens 1 ..): [prompt_len - 1, words] int32."""
        stride = logprob_record_words(flight.prompt_logprobs)
        gen_words, n_words = flight.logprob_words()
        raw = self.transport.read(self.geom.logprob_word_offset(flight.logprob_offset + gen_words), n_words * 4)
        return np.frombuffer(raw, "<i4").reshape(flight.prompt_len - 1, stride)

    def read_tokens(self, flight: Flight, start: int, stop: int) -> list[int]:
        """Output tokens [start, stop) of `flight` (the caller saw `generated` >= stop)."""
        raw = self.transport.read(self._output_base + (flight.output_offset + start) * 4, (stop - start) * 4)
        if _NATIVE_LE:
            return memoryview(raw).cast("i").tolist()   # no numpy array for a few tokens
        return np.frombuffer(raw, "<i4").tolist()

    # -- submissions ------------------------------------------------------------
    def reserve(self, prompt_len: int, max_tokens: int, params: SamplingParams | None = None) -> Flight | None:
        """A slot plus prompt (with the sampling data), output and logprob arena ranges, or None
        when any is short."""
        if self.tracker.n_free == 0:
            return None
        flight = Flight(-1, 0, 0, 0, max_tokens, prompt_len=prompt_len)
        extra = 0
        if params is not None:
            flight.logprobs, flight.prompt_logprobs = params.logprobs, params.prompt_logprobs
            extra = params.extra.words
        lp_words = sum(flight.logprob_words())
        try:
            flight.prompt_offset = self.prompts.alloc(prompt_len + extra)
        except ArenaFull:
            return None
        try:
            flight.output_offset = self.outputs.alloc(max_tokens)
        except ArenaFull:
            self.prompts.free(flight.prompt_offset)
            return None
        if lp_words:
            try:
                flight.logprob_offset = self.logprob_arena.alloc(lp_words)
            except ArenaFull:
                self.prompts.free(flight.prompt_offset)
                self.outputs.free(flight.output_offset)
                return None
        flight.slot = self.tracker.take()
        flight.seq, self.next_seq = self.next_seq, self.next_seq + 1
        return flight

    def submission(self, flight: Flight, prompt: np.ndarray, *, temperature: float, top_p: float, top_k: int,
                   seed: int | None, ignore_eos: bool, stop_ids: tuple[int, ...], t_submit_ns: int,
                   params: SamplingParams | None = None, group: tuple[int, int, int] = (0, 0, 0)
                   ) -> list[tuple[int, bytes]]:
        """The ordered writes that submit `flight` (state word last); registers the flight.
        group: (size, this choice's index, the leader's seq) of a group of choices."""
        more = dict(group_size=group[0], group_index=group[1], group_seq=group[2])
        if params is not None:
            gen_words, _ = flight.logprob_words()
            lp_off = flight.logprob_offset or 0
            more.update(presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                        repetition_penalty=params.repetition_penalty, min_p=params.min_p,
                        min_tokens=params.min_tokens,
                        logprobs=LOGPROBS_OFF if params.logprobs is None else params.logprobs,
                        prompt_logprobs=LOGPROBS_OFF if params.prompt_logprobs is None else params.prompt_logprobs,
                        logprobs_offset=lp_off, prompt_logprobs_offset=lp_off + gen_words,
                        extra_offset=flight.prompt_offset + int(prompt.size), extra=params.extra,
                        priority=params.priority, ttft_slo_ms=params.ttft_slo_ms, tbt_slo_ms=params.tbt_slo_ms)
        req = SlotRequest(seq=flight.seq, prompt_offset=flight.prompt_offset, prompt_len=int(prompt.size),
                          output_offset=flight.output_offset, max_tokens=flight.max_tokens,
                          temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, ignore_eos=ignore_eos,
                          stop_ids=stop_ids, epoch=self.epoch, t_submit_ns=t_submit_ns, **more)
        writes = submit_writes(self.geom, flight.slot, req, prompt)
        self.flights[flight.slot] = flight
        self.received[flight.slot] = 0
        self.seqs[flight.slot] = flight.seq
        return writes

    def unreserve(self, flight: Flight) -> None:
        """Undo `reserve` (and `submission`) for a flight whose writes never landed."""
        self.flights.pop(flight.slot, None)
        self._free_ranges(flight)
        self.tracker.untake(flight.slot)

    # -- endings ----------------------------------------------------------------
    def doorbell_write(self) -> tuple[int, bytes]:
        """The write that ends a batch of submissions or cancels: the next doorbell value. The
        device scheduler rescans the slots only when the bell moved (csrc/sched_loop.h)."""
        self.doorbell += 1
        return doorbell_write(self.doorbell)

    def write_cancels(self, slots: list[int]) -> None:
        if slots:
            self.transport.write_batch([(self.geom.slot_field_offset(s, "cancel"), _ONE) for s in slots]
                                       + [self.doorbell_write()])

    def write_resets(self, slots: list[int]) -> None:
        """DECODE_COMPLETED -> EMPTY for each slot (the caller saw them completed)."""
        if slots:
            self.transport.write_batch([(self.geom.slot_field_offset(s, "state"), _EMPTY) for s in slots])

    def retire(self, slot: int) -> None:
        """After the reset of `slot` landed: give back its arenas and the slot."""
        flight = self.flights.pop(slot, None)
        if flight is not None:
            self._free_ranges(flight)
        self.tracker.release(slot)

    def _free_ranges(self, flight: Flight) -> None:
        self.prompts.free(flight.prompt_offset)
        self.outputs.free(flight.output_offset)
        if flight.logprob_offset is not None:
            self.logprob_arena.free(flight.logprob_offset)

    def inflight(self) -> int:
        return sum(1 for f in self.flights.values() if f.handle is not None)

    def close(self) -> None:
        self.transport.close()
