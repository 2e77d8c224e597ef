"""The ctypes mirror (structs.py) matches what g++ makes of csrc/sched_types.h."""
from __future__ import annotations

import ctypes

from gpu_backend.cuda import structs


def test_every_offset_and_size_matches_the_header(twin_lib):
    for cls, cname in structs.C_NAMES.items():
        assert twin_lib.blink_struct_size(cname.encode()) == ctypes.sizeof(cls), cname
        for field, *_ in cls._fields_:
            assert twin_lib.blink_struct_offset(cname.encode(), field.encode()) == getattr(cls, field).offset, \
                f"{cname}.{field}"


def test_plan_scratch_holds_every_list_of_the_loop(twin_lib):
    assert twin_lib.blink_scratch_lists() == structs.SCRATCH_LISTS
    sizes = structs.buffer_sizes(64, 16, num_blocks=64, max_blocks=8, max_rows=16)
    assert sizes["plan_scratch"] == 4 * structs.SCRATCH_LISTS * 16


def test_control_counters_are_contiguous_u64():
    offs = [getattr(structs.SchedControl, n).offset for n in structs.COUNTERS]
    assert offs == list(range(offs[0], offs[0] + 8 * len(offs), 8))
