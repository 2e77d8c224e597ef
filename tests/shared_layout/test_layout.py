import numpy as np
import pytest

from shared_layout import HEADER, LAYOUT_VERSION, SLOT, LayoutMismatch, Ring, RingGeometry
from shared_layout.layout import HEADER_FIELDS, SLOT_FIELDS, SECTION_ALIGN


def test_records_are_8_byte_aligned_and_fields_natural():
    assert SLOT.size % 8 == 0 and HEADER.size % 8 == 0
    for rec in (HEADER, SLOT):
        prev_end = 0
        for f in rec.fields:
            assert f.offset % min(8, f.size // f.count) == 0, f
            assert f.offset >= prev_end
            prev_end = f.offset + f.size
        assert prev_end <= rec.size
        assert rec.dtype.itemsize == rec.size


def test_field_lists_cover_the_contract():
    names = {f[0] for f in HEADER_FIELDS}
    for want in ("magic", "layout_version", "slot_count", "prompt_arena_tokens", "output_arena_tokens",
                 "backend_heartbeat", "backend_epoch", "frontend_epoch", "shutdown"):
        assert want in names
    names = {f[0] for f in SLOT_FIELDS}
    for want in ("state", "seq", "prompt_offset", "prompt_len", "max_tokens", "temperature", "top_p",
                 "top_k", "seed", "flags", "stop_ids", "generated", "finish_reason", "error_code", "cancel",
                 "t_picked_ns", "t_first_ns", "t_last_ns"):
        assert want in names


@pytest.mark.parametrize("geom", [RingGeometry(), RingGeometry(64, 1000, 777), RingGeometry(1, 1, 1)])
def test_sections_are_aligned_and_disjoint(geom):
    assert geom.slots_offset == HEADER.size
    assert geom.prompt_arena_offset % SECTION_ALIGN == 0
    assert geom.output_arena_offset % SECTION_ALIGN == 0
    assert geom.prompt_arena_offset >= geom.slots_offset + geom.slot_count * SLOT.size
    assert geom.output_arena_offset >= geom.prompt_arena_offset + 4 * geom.prompt_arena_tokens
    assert geom.total_size >= geom.output_arena_offset + 4 * geom.output_arena_tokens


@pytest.mark.parametrize("buf_kind", ["bytearray", "numpy", "mmap"])
def test_create_then_attach_any_buffer(buf_kind, tmp_path):
    geom = RingGeometry(16, 256, 256)
    if buf_kind == "bytearray":
        buf = bytearray(geom.total_size)
    elif buf_kind == "numpy":
        buf = np.zeros(geom.total_size, np.uint8)
    else:
        import mmap
        buf = mmap.mmap(-1, geom.total_size)
    Ring.create(buf, geom)
    ring = Ring.attach(buf, expected=geom)
    assert ring.geom == geom
    assert ring.get("slot_count") == 16
    assert (ring.state == 0).all()


def test_attach_rejects_mismatches_with_one_clear_message():
    geom = RingGeometry(16, 256, 256)
    buf = bytearray(geom.total_size)
    with pytest.raises(LayoutMismatch, match="magic"):
        Ring.attach(buf)
    ring = Ring.create(buf, geom)
    with pytest.raises(LayoutMismatch, match="slot_count is 16, expected 32"):
        Ring.attach(buf, expected=RingGeometry(32, 256, 256))
    ring.set("layout_version", 99)
    with pytest.raises(LayoutMismatch, match="layout version 99"):
        Ring.attach(buf)
    ring.set("layout_version", LAYOUT_VERSION)
    ring.set("slot_size", 7)
    with pytest.raises(LayoutMismatch, match="slot_size is 7 bytes"):
        Ring.attach(buf)
    ring.set("slot_size", SLOT.size)
    ring.set("output_arena_offset", 12)
    with pytest.raises(LayoutMismatch, match="output_arena_offset is 12"):
        Ring.attach(buf)
    with pytest.raises(LayoutMismatch, match="cannot hold"):
        Ring(bytearray(100), geom)


def test_bad_geometry_is_a_value_error():
    with pytest.raises(ValueError, match="slot_count"):
        RingGeometry(0, 1, 1)
