"""SlotSnapshot: the covering arc of watched slots and the reads it issues, over a real shm ring."""
import numpy as np
import pytest

from dpu_frontend.slot_snapshot import PROGRESS_FIELDS, SlotSnapshot, covering_arcs
from dpu_frontend.transport import ShmTransport
from shared_layout import SLOT, Ring, RingGeometry, SlotState
from shared_layout.layout import HEADER
from shared_layout.shm import ShmRegion

GEOM = RingGeometry(16, 64, 64)


def mask(n, *idx):
    m = np.zeros(n, bool)
    m[list(idx)] = True
    return m


@pytest.mark.parametrize("idx,arcs", [
    ((), []),
    ((5,), [(5, 6)]),
    ((2, 3, 9), [(2, 10)]),
    ((0, 1, 14, 15), [(14, 16), (0, 2)]),        # wraps: the hole in the middle is the largest
    ((0, 15), [(15, 16), (0, 1)]),
    ((0, 7, 8), [(0, 9)]),
])
def test_covering_arcs(idx, arcs):
    assert covering_arcs(mask(16, *idx)) == arcs


def test_covering_arcs_cover_every_watched_slot_minimally():
    rng = np.random.default_rng(1)
    for _ in range(500):
        n = int(rng.integers(1, 40))
        m = rng.random(n) < rng.random()
        arcs = covering_arcs(m)
        covered = np.zeros(n, bool)
        for a, b in arcs:
            assert 0 <= a < b <= n
            covered[a:b] = True
        assert not (m & ~covered).any()
        if m.any():
            # minimal: n minus the largest circular run of unwatched slots
            idx = np.flatnonzero(m)
            gaps = np.diff(np.append(idx, idx[0] + n)) - 1
            assert covered.sum() == n - gaps.max()


class ReadOnlyBytes:
    """ShmTransport without read_into: the snapshot must fall back to read()."""

    def __init__(self, t):
        self.t, self.geometry = t, t.geometry

    def read(self, off, n):
        return self.t.read(off, n)


@pytest.mark.parametrize("fallback", [False, True])
def test_watched_reads_refresh_only_the_arc(ring_name, fallback):
    region = ShmRegion.create(ring_name, GEOM.total_size)
    ring = Ring.create(region.buf, GEOM)
    t = ShmTransport.open(ring_name)
    snap = SlotSnapshot(ReadOnlyBytes(t) if fallback else t, GEOM)
    held = mask(16, 3, 4)
    ring.state[[3, 9]] = SlotState.DECODE_PROCESSING     # 9: left by an earlier frontend
    snap.refresh_full(held)
    assert snap.foreign.tolist() == mask(16, 9).tolist()
    assert snap.bytes_read == GEOM.slots_offset + 16 * SLOT.size
    ring.generated[[4, 9, 12]] = 7
    ring.set("backend_heartbeat", 5)
    snap.bytes_read = 0
    snap.refresh_watched(held)                           # arc 3..9
    assert snap.bytes_read == HEADER.size + 7 * SLOT.size
    assert snap.header[0]["backend_heartbeat"] == 5
    assert snap.slots["generated"][[4, 9, 12]].tolist() == [7, 7, 0]   # 12 is outside: not read
    snap.mark_empty([9])
    assert not snap.foreign.any() and snap.slots["state"][9] == SlotState.EMPTY
    snap.bytes_read = 0
    snap.refresh_watched(mask(16))                       # nothing watched: the header only
    assert snap.bytes_read == HEADER.size
    snap.refresh_watched(mask(16, *range(10)))           # more than half the ring: one full read
    assert snap.slots["generated"][12] == 7


def test_progress_words_match_the_records(ring_name):
    region = ShmRegion.create(ring_name, GEOM.total_size)
    ring = Ring.create(region.buf, GEOM)
    snap = SlotSnapshot(ShmTransport.open(ring_name), GEOM)
    words = dict(state=SlotState.DECODE_PROCESSING, seq=2**40 + 3, epoch=2**33 + 1, generated=77,
                 t_picked_ns=2**62 + 5, t_first_ns=2**61 + 6, t_last_ns=2**63 + 7)
    for name, v in words.items():
        ring.slots[5][name] = v
    ring.slots[5]["stop_ids"] = [9] * 8     # neighbours of the unpacked words stay out
    ring.slots[5]["finish_reason"] = 3
    snap.refresh_full(mask(16))
    assert snap.progress(5) == tuple(int(words[name]) for name in PROGRESS_FIELDS)
    assert snap.progress(6) == (0,) * len(PROGRESS_FIELDS)


def test_foreign_slots_follow_full_reads_and_resets(ring_name):
    region = ShmRegion.create(ring_name, GEOM.total_size)
    ring = Ring.create(region.buf, GEOM)
    snap = SlotSnapshot(ShmTransport.open(ring_name), GEOM)
    ring.state[[2, 7, 11]] = SlotState.DECODE_COMPLETED
    snap.refresh_full(mask(16, 7))
    assert snap.foreign_slots == [2, 11]
    snap.mark_empty([2])
    assert snap.foreign_slots == [11] and snap.foreign.tolist() == mask(16, 11).tolist()


def test_the_watched_arc_is_cached_by_version(ring_name):
    region = ShmRegion.create(ring_name, GEOM.total_size)
    Ring.create(region.buf, GEOM)
    snap = SlotSnapshot(ShmTransport.open(ring_name), GEOM)
    snap.refresh_full(mask(16))
    held = mask(16, 3, 4)
    snap.bytes_read = 0
    snap.refresh_watched(held, held_version=1)
    assert snap.bytes_read == HEADER.size + 2 * SLOT.size
    held[6] = True                                   # changed without a new version: the old arc
    snap.bytes_read = 0
    snap.refresh_watched(held, held_version=1)
    assert snap.bytes_read == HEADER.size + 2 * SLOT.size
    snap.bytes_read = 0
    snap.refresh_watched(held, held_version=2)       # a new version: the arc is recomputed
    assert snap.bytes_read == HEADER.size + 4 * SLOT.size
