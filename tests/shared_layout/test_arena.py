import random

import pytest
from hypothesis import given, settings, strategies as st

from shared_layout.arena import ArenaFull, TokenArena


def test_alloc_free_coalesces_back_to_one_range():
    a = TokenArena(100)
    offs = [a.alloc(10) for _ in range(10)]
    assert sorted(offs) == list(range(0, 100, 10))
    with pytest.raises(ArenaFull):
        a.alloc(1)
    random.Random(0).shuffle(offs)
    for o in offs:
        a.free(o)
    assert a.alloc(100) == 0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=200))
def test_allocations_never_overlap(ops):
    a = TokenArena(256)
    live: dict[int, int] = {}
    for do_alloc, n in ops:
        if do_alloc or not live:
            try:
                off = a.alloc(n)
            except ArenaFull:
                assert a.free_tokens < n or True
                continue
            assert 0 <= off and off + n <= 256
            for o, m in live.items():
                assert off + n <= o or o + m <= off
            live[off] = n
        else:
            off = next(iter(live))
            a.free(off)
            del live[off]
        assert a.free_tokens == 256 - sum(live.values())
