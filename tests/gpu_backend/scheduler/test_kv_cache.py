"""scheduler/kv_cache: block allocator bookkeeping."""
import pytest

from gpu_backend.scheduler.kv_cache import BlockAllocator


def test_allocate_and_free():
    a = BlockAllocator(8)
    assert a.free_count == 8 and a.can_allocate(8) and not a.can_allocate(9)
    x = a.allocate(3)
    assert x == [0, 1, 2] and a.free_count == 5
    y = a.allocate(5)
    assert sorted(x + y) == list(range(8)) and a.free_count == 0
    with pytest.raises(MemoryError):
        a.allocate(1)
    assert a.free_count == 0
    a.free(x)
    assert a.free_count == 3
    assert a.allocate(3) == x                      # LIFO: the freed blocks come back first
    a.free(x)
    a.free(y)
    assert a.free_count == 8


def test_double_free_and_foreign_blocks_are_rejected():
    a = BlockAllocator(4)
    x = a.allocate(2)
    a.free(x)
    with pytest.raises(ValueError):
        a.free(x)
    with pytest.raises(ValueError):
        a.free([99])
    assert a.free_count == 4


def test_failed_allocation_takes_nothing():
    a = BlockAllocator(4)
    a.allocate(3)
    with pytest.raises(MemoryError):
        a.allocate(2)
    assert a.free_count == 1


def test_shared_blocks_return_when_their_last_holder_frees_them():
    a = BlockAllocator(4)
    mine = a.allocate(2)
    theirs = a.share(mine[:1])
    assert a.free_count == 2 and a.extra_refs == 1
    a.free(mine)
    assert a.free_count == 3 and a.extra_refs == 0      # the shared one stays with its other holder
    a.free(theirs)
    assert a.free_count == 4
    with pytest.raises(ValueError):
        a.free(theirs)
    with pytest.raises(ValueError):
        a.share([1])
