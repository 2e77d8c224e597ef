"""ShmTransport over a real /dev/shm ring: bounds, ordering of batches, staleness."""
import os

import numpy as np
import pytest

from dpu_frontend.transport import RingNotFound, ShmTransport, Transport, TransportError, shm_factory
from shared_layout import SLOT, LayoutMismatch, Ring, RingGeometry, SlotState
from shared_layout.shm import ShmRegion

GEOM = RingGeometry(8, 256, 256)


@pytest.fixture
def ring(ring_name):
    region = ShmRegion.create(ring_name, GEOM.total_size)
    yield Ring.create(region.buf, GEOM)


def test_missing_ring_is_a_clear_error(ring_name):
    with pytest.raises(RingNotFound, match="does not exist"):
        ShmTransport.open(ring_name)
    with pytest.raises(ValueError, match="invalid ring name"):
        ShmTransport.open("../etc/passwd")


def test_unformatted_or_foreign_file_is_rejected(ring_name):
    region = ShmRegion.create(ring_name, 4096)
    with pytest.raises(LayoutMismatch, match="bad ring magic"):
        ShmTransport.open(ring_name)
    region.close()
    os.truncate(region.path, 0)
    with pytest.raises(RingNotFound, match="not formatted"):
        ShmTransport.open(ring_name)


def test_reads_are_copies_and_writes_land(ring, ring_name):
    t = shm_factory(ring_name)()
    assert isinstance(t, Transport) and t.geometry == GEOM and t.shares_clock
    off = GEOM.slot_field_offset(3, "seq")
    t.write(off, np.array([77], "<u8").tobytes())
    assert int(ring.seq[3]) == 77
    got = t.read(off, 8)
    ring.seq[3] = 78
    assert np.frombuffer(got, "<u8")[0] == 77          # a copy, not a view
    assert np.frombuffer(t.read(off, 8), "<u8")[0] == 78


def test_write_batch_applies_in_order(ring, ring_name):
    t = ShmTransport.open(ring_name)
    off = GEOM.slot_field_offset(0, "state")
    t.write_batch([(off, np.array([1], "<u4").tobytes()), (off, np.array([5], "<u4").tobytes())])
    assert ring.state[0] == SlotState.DECODE_COMPLETED


def test_out_of_bounds_and_closed(ring, ring_name):
    t = ShmTransport.open(ring_name)
    with pytest.raises(ValueError, match="outside"):
        t.read(GEOM.total_size - 4, 8)
    with pytest.raises(ValueError, match="outside"):
        t.write_batch([(0, b"x"), (-1, b"y")])
    assert ring.get("magic") != 0          # the bad batch wrote nothing
    t.close()
    t.close()
    with pytest.raises(TransportError, match="closed"):
        t.read(0, 8)


def test_stale_when_the_file_is_replaced_or_removed(ring, ring_name):
    t = ShmTransport.open(ring_name)
    assert not t.stale()
    region = ShmRegion.create(ring_name, GEOM.total_size)   # unlinks and recreates: new inode
    Ring.create(region.buf, GEOM)
    assert t.stale()
    t2 = ShmTransport.open(ring_name)
    assert not t2.stale()
    region.unlink()
    assert t2.stale()


def test_snapshot_read_covers_header_and_slots(ring, ring_name):
    t = ShmTransport.open(ring_name)
    raw = t.read(0, GEOM.slots_offset + GEOM.slot_count * SLOT.size)
    assert len(raw) == GEOM.slots_offset + 8 * SLOT.size
