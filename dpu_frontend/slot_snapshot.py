"""The frontend's local copy of the ring's header and slot records.

    Transport.read (bulk) -> bytearray cache -> numpy views (header, slots) -> reader, tracker

`refresh_full` copies the header and every slot record in one read (at attach
and periodically, so the slot tracker sees every slot). `refresh_watched`
copies the header plus only the arc of slots that can change under us: the
smallest circular range covering every watched slot (ours in flight, and
foreign ones not yet EMPTY), as one read or two when the arc wraps. Slots
outside it are EMPTY and nobody but this frontend writes them, so their cached
words stay true. The views are of this process's cache, never of the ring.
"""
from __future__ import annotations

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
        self.foreign = np.zeros(geom.slot_count, bool)   # [slots] not ours and not EMPTY at the last full read
        self.bytes_read = 0

    def refresh_full(self, held: np.ndarray) -> None:
        """One read of the header and every slot record."""
        self._read(0, self.nbytes)
        np.logical_and(self.slots["state"] != SlotState.EMPTY, ~held, out=self.foreign)

    def refresh_watched(self, held: np.ndarray) -> None:
        """The header, then the records of the arc covering held and foreign slots."""
        arcs = covering_arcs(held | self.foreign)
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
        self.slots["state"][slots] = SlotState.EMPTY
        self.foreign[slots] = False
