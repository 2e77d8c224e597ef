"""One attachment of the frontend to one ring instance, and what it holds there.

    transport -> attach (bump frontend_epoch, reset leftovers) -> reserve (slot + arena
    ranges) -> submission writes ... completion -> reset writes -> free

A session owns the frontend-side state that is only meaningful for this ring
file: the epoch, the request sequence numbers, the slot tracker and both token
arenas, and one `Flight` per slot this frontend wrote and has not reset. When
the ring is replaced (daemon recreated the file) the whole session is dropped
and a new one attaches; nothing carries over.
"""
from __future__ import annotations

import dataclasses
import struct
import sys

import numpy as np

from shared_layout import SLOT, SLOT_DTYPE, SlotRequest, SlotState, submit_writes
from shared_layout.layout import HEADER, HEADER_DTYPE
from shared_layout.arena import ArenaFull, TokenArena

from .request_handle import RequestHandle
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


class RingSession:
    def __init__(self, transport: Transport, epoch: int):
        self.transport = transport
        self.geom = transport.geometry
        self.epoch = epoch
        n = self.geom.slot_count
        self.tracker = SlotTracker(n)
        self.prompts = TokenArena(self.geom.prompt_arena_tokens)
        self.outputs = TokenArena(self.geom.output_arena_tokens)
        self.flights: dict[int, Flight] = {}
        self.received = np.zeros(n, np.int64)   # [slots] tokens read, per held slot
        self.seqs = np.zeros(n, np.uint64)      # [slots] seq we wrote, per held slot
        self.next_seq = 1
        self._output_base = self.geom.output_arena_offset   # byte offset of output token 0
        self.snapshot = SlotSnapshot(transport, self.geom)

    @classmethod
    def attach(cls, transport: Transport) -> "RingSession":
        """Take over the ring as a new frontend: bump the epoch, reset completed leftovers."""
        header = np.frombuffer(transport.read(0, HEADER.size), HEADER_DTYPE, 1)[0]
        epoch = int(header["frontend_epoch"]) + 1
        transport.write(HEADER.offset("frontend_epoch"), np.array([epoch], "<u8").tobytes())
        session = cls(transport, epoch)
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

    def read_tokens(self, flight: Flight, start: int, stop: int) -> list[int]:
        """Output tokens [start, stop) of `flight` (the caller saw `generated` >= stop)."""
        raw = self.transport.read(self._output_base + (flight.output_offset + start) * 4, (stop - start) * 4)
        if _NATIVE_LE:
            return memoryview(raw).cast("i").tolist()   # no numpy array for a few tokens
        return np.frombuffer(raw, "<i4").tolist()

    # -- submissions ------------------------------------------------------------
    def reserve(self, prompt_len: int, max_tokens: int) -> Flight | None:
        """A slot plus prompt and output arena ranges, or None when any is short."""
        if self.tracker.n_free == 0:
            return None
        try:
            poff = self.prompts.alloc(prompt_len)
        except ArenaFull:
            return None
        try:
            ooff = self.outputs.alloc(max_tokens)
        except ArenaFull:
            self.prompts.free(poff)
            return None
        slot = self.tracker.take()
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        return Flight(slot, seq, poff, ooff, max_tokens)

    def submission(self, flight: Flight, prompt: np.ndarray, *, temperature: float, top_p: float, top_k: int,
                   seed: int | None, ignore_eos: bool, stop_ids: tuple[int, ...], t_submit_ns: int
                   ) -> list[tuple[int, bytes]]:
        """The ordered writes that submit `flight` (state word last); registers the flight."""
        req = SlotRequest(seq=flight.seq, prompt_offset=flight.prompt_offset, prompt_len=int(prompt.size),
                          output_offset=flight.output_offset, max_tokens=flight.max_tokens,
                          temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, ignore_eos=ignore_eos,
                          stop_ids=stop_ids, epoch=self.epoch, t_submit_ns=t_submit_ns)
        writes = submit_writes(self.geom, flight.slot, req, prompt)
        self.flights[flight.slot] = flight
        self.received[flight.slot] = 0
        self.seqs[flight.slot] = flight.seq
        return writes

    def unreserve(self, flight: Flight) -> None:
        """Undo `reserve` (and `submission`) for a flight whose writes never landed."""
        self.flights.pop(flight.slot, None)
        self.prompts.free(flight.prompt_offset)
        self.outputs.free(flight.output_offset)
        self.tracker.untake(flight.slot)

    # -- endings ----------------------------------------------------------------
    def write_cancels(self, slots: list[int]) -> None:
        if slots:
            self.transport.write_batch([(self.geom.slot_field_offset(s, "cancel"), _ONE) for s in slots])

    def write_resets(self, slots: list[int]) -> None:
        """DECODE_COMPLETED -> EMPTY for each slot (the caller saw them completed)."""
        if slots:
            self.transport.write_batch([(self.geom.slot_field_offset(s, "state"), _EMPTY) for s in slots])

    def retire(self, slot: int) -> None:
        """After the reset of `slot` landed: give back its arenas and the slot."""
        flight = self.flights.pop(slot, None)
        if flight is not None:
            self.prompts.free(flight.prompt_offset)
            self.outputs.free(flight.output_offset)
        self.tracker.release(slot)

    def inflight(self) -> int:
        return sum(1 for f in self.flights.values() if f.handle is not None)

    def close(self) -> None:
        self.transport.close()
