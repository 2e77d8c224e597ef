"""Which ring slots this frontend may submit into (paper §4.4, slot tracker).

    bulk read of slot states (token reader, once per poll) -> refresh()
    submit -> take() (hint-based circular scan)  ...  reset to EMPTY -> release()

A local availability cache instead of reading the ring before each submit: a
slot is free when the latest snapshot showed it EMPTY and this frontend does not
hold it. `held` covers every slot this frontend wrote a request into and has not
yet reset (in flight, or abandoned and waiting for the daemon to complete it).
Pure bookkeeping on numpy arrays; no I/O.
"""
from __future__ import annotations

import numpy as np

from shared_layout import SlotState


class SlotTracker:
    def __init__(self, slot_count: int):
        self.slot_count = slot_count
        self.free = np.zeros(slot_count, bool)   # [slots] snapshot EMPTY and not held
        self.held = np.zeros(slot_count, bool)   # [slots] ours until we reset it
        self.n_free = 0
        self.version = 0   # bumped whenever `held` changes (the snapshot caches its watched arcs by it)
        self._hint = 0

    def refresh(self, states: np.ndarray) -> None:
        """Rebuild the cache from one bulk read of the slots' state words ([slots] u32)."""
        np.logical_and(states == SlotState.EMPTY, ~self.held, out=self.free)
        self.n_free = int(np.count_nonzero(self.free))

    def take(self) -> int | None:
        """A free slot, scanning circularly from the slot after the last one taken; None if none."""
        if self.n_free == 0:
            return None
        i = self._hint
        j = int(self.free[i:].argmax())
        if not self.free[i + j]:
            j = int(self.free[:i].argmax())   # wrap around; n_free > 0 so one exists
            slot = j
        else:
            slot = i + j
        self.free[slot] = False
        self.held[slot] = True
        self.version += 1
        self.n_free -= 1
        self._hint = (slot + 1) % self.slot_count
        return slot

    def untake(self, slot: int) -> None:
        """Give back a slot taken but never written (its submission failed)."""
        self.held[slot] = False
        self.version += 1
        self.free[slot] = True
        self.n_free += 1

    def release(self, slot: int) -> None:
        """We reset `slot` to EMPTY: free for the next request."""
        if self.held[slot]:
            self.held[slot] = False
            self.version += 1
        if not self.free[slot]:
            self.free[slot] = True
            self.n_free += 1
