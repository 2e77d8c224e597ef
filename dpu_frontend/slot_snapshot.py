"""The frontend's local copy of the ring's header and slot records.

    Transport.read (bulk) -> bytearray cache -> numpy views (header, slots) -> reader, tracker

`refresh_full` copies the header and every slot record in one read (at attach
and periodically, so the slot tracker sees every slot). `refresh_watched`
copies the header plus only the arc of slots that can change under us: the
smallest circular range covering every watched slot (ours in flight, and
foreign ones not yet EMPTY), as one read or two when the arc wraps. Slots
outside it are EMPTY and nobody but this frontend writes them, so their cached
words stay true. The views are of this process's cache, never of the ring.

The arc is recomputed only when the watched set changed (the tracker's `version`,
the foreign list). `progress(slot)` reads the words the token reader acts on out
of the cache with one struct unpack: cheaper than numpy record access for the
few slots a poll looks at one by one.
"""
from __future__ import annotations

import struct

import numpy as np

from shared_layout import SLOT, SLOT_DTYPE, RingGeometry, SlotState
from shared_layout.layout import HEADER, HEADER_DTYPE

from .transport.base import Transport


def covering_arcs(watched: np.ndarray) -> list[tuple[int, int]]:
    """Smallest circular range covering the True entries of `watched` ([slots] bool),
    as [start, stop) index ranges: none, one, or two when it wraps past the end."""
    idx = np.flatnonzero(watched)
    if idx.size == 0:
        return []
    n = watched.size
    first, last = int(idx[0]), int(idx[-1])
    if idx.size == 1:
        return [(first, first + 1)]
    gaps = np.diff(idx)                   # [k-1] distance to the next watched slot
    k = int(gaps.argmax())
    wrap_gap = first + n - last
    if wrap_gap >= int(gaps[k]):
        return [(first, last + 1)]        # the largest hole is around the end: no wrap
    start, stop = int(idx[k + 1]), int(idx[k])
    return [(start, n), (0, stop + 1)]


# The words of a slot record the token reader acts on, in this order (ascending offsets).
PROGRESS_FIELDS = ("state", "seq", "epoch", "generated", "t_picked_ns", "t_first_ns", "t_last_ns")


def _fields_struct(names: tuple[str, ...]) -> struct.Struct:
    """A struct that unpacks the named fields of one slot record (little-endian, padding skipped)."""
    fmt, at = "<", 0
    for name in names:
        dt, off = SLOT_DTYPE.fields[name][:2]
        assert off >= at, "fields must be in record order"
        fmt += f"{off - at}x" if off > at else ""
        fmt += {("u", 4): "I", ("u", 8): "Q", ("i", 4): "i", ("i", 8): "q"}[(dt.kind, dt.itemsize)]
        at = off + dt.itemsize
    return struct.Struct(fmt)


_PROGRESS = _fields_struct(PROGRESS_FIELDS)


class SlotSnapshot:
    def __init__(self, transport: Transport, geom: RingGeometry):
        self.transport = transport
        self.geom = geom
        self.nbytes = geom.slots_offset + geom.slot_count * SLOT.size
        self._cache = bytearray(self.nbytes)
        self._view = memoryview(self._cache)
        self._read_into = getattr(transport, "read_into", None)
        self.header = np.frombuffer(self._cache, HEADER_DTYPE, 1, 0)                    # [1]
        self.slots = np.frombuffer(self._cache, SLOT_DTYPE, geom.slot_count, geom.slots_offset)  # [slots]
        self.states = self.slots["state"]                # [slots] view of the state words
        self.foreign = np.zeros(geom.slot_count, bool)   # [slots] not ours and not EMPTY at the last full read
        self.foreign_slots: list[int] = []               # the same, as ascending slot indices
        self.bytes_read = 0
        self._arcs: list[tuple[int, int]] = []
        self._arcs_key: tuple | None = None              # (held version, foreign version) of `_arcs`
        self._foreign_version = 0                        # bumped whenever foreign_slots changes
        self._slot0 = geom.slots_offset
        self._slot_size = SLOT.size
        self._unpack_progress = _PROGRESS.unpack_from

    def progress(self, slot: int) -> tuple[int, ...]:
        """The cached PROGRESS_FIELDS words of one slot, as ints."""
        return self._unpack_progress(self._cache, self._slot0 + slot * self._slot_size)

    def header_bytes(self) -> bytes:
        """The cached header, as bytes (equal bytes: nothing in the header moved)."""
        return bytes(self._view[:HEADER.size])

    def refresh_full(self, held: np.ndarray) -> None:
        """One read of the header and every slot record."""
        self._read(0, self.nbytes)
        np.logical_and(self.states != SlotState.EMPTY, ~held, out=self.foreign)
        foreign = np.flatnonzero(self.foreign).tolist()
        if foreign != self.foreign_slots:
            self.foreign_slots = foreign
            self._foreign_version += 1

    def refresh_watched(self, held: np.ndarray, held_version: int | None = None) -> None:
        """The header, then the records of the arc covering held and foreign slots.

        held_version: the tracker's version of `held`; the arc is reused while it and the
        foreign list are unchanged (None: always recomputed)."""
        key = None if held_version is None else (held_version, self._foreign_version)
        if key is None or key != self._arcs_key:
            self._arcs = covering_arcs(held | self.foreign)
            self._arcs_key = key
        arcs = self._arcs
        span = sum(b - a for a, b in arcs)
        if span * 2 > self.geom.slot_count:
            self.refresh_full(held)
            return
        self._read(0, HEADER.size)
        for a, b in arcs:
            self._read(self.geom.slot_offset(a), (b - a) * SLOT.size)

    def _read(self, off: int, n: int) -> None:
        if self._read_into is not None:
            self._read_into(off, self._view[off:off + n])
        else:
            self._view[off:off + n] = self.transport.read(off, n)
        self.bytes_read += n

    def mark_empty(self, slots: list[int]) -> None:
        """We reset these slots: the cache says so without a read."""
        self.states[slots] = SlotState.EMPTY
        self.foreign[slots] = False
        if self.foreign_slots and not set(self.foreign_slots).isdisjoint(slots):
            gone = set(slots)
            self.foreign_slots = [i for i in self.foreign_slots if i not in gone]
            self._foreign_version += 1
