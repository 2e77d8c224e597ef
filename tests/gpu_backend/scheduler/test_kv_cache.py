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


# -- the prefix cache -------------------------------------------------------------------

from gpu_backend.scheduler.kv_cache import ROOT_HASH, block_hash, hash_chain  # noqa: E402


def test_hash_chain_keys_full_blocks_by_their_whole_prefix():
    a = hash_chain(list(range(10)), 4)
    assert len(a) == 2                                    # the partial third block has no key
    assert a[0] == block_hash(ROOT_HASH, [0, 1, 2, 3]) and a[1] == block_hash(a[0], [4, 5, 6, 7])
    b = hash_chain([9, 1, 2, 3, 4, 5, 6, 7], 4)
    assert b[0] != a[0] and b[1] != a[1]                  # same block tokens, other prefix: other key
    assert hash_chain(list(range(8)) + [42], 4) == a      # what follows does not change a block's key
    assert block_hash(ROOT_HASH, [1, 2]) != block_hash(ROOT_HASH, [2, 1])
    assert all(0 <= k < 2**64 for k in a)


def test_lookup_take_and_commit_share_blocks_read_only():
    a = BlockAllocator(8)
    keys = hash_chain(list(range(12)), 4)
    mine = a.allocate(3)
    assert a.lookup(keys) == []
    for b, k in zip(mine, keys):
        assert a.commit(b, k)
    assert not a.commit(mine[0], keys[0])                 # already committed
    assert a.lookup(keys) == mine
    assert a.lookup(hash_chain([99] + list(range(1, 12)), 4)) == []   # first block differs: no later block hits
    theirs = a.take(a.lookup(keys[:2]))
    assert theirs == mine[:2] and a.extra_refs == 2 and a.free_count == 5
    a.free(mine)
    assert a.free_count == 6 and a.evictable_count == 1   # the tail one: nobody holds it, still cached
    a.free(theirs)
    assert a.free_count == 8 and a.evictable_count == 3 and a.cached_count == 3
    again = a.take(a.lookup(keys))                        # evictable blocks come back with their contents
    assert again == mine and a.free_count == 5 and a.evictable_count == 0 and a.extra_refs == 0


def test_duplicate_prefix_keeps_the_first_block_cached():
    a = BlockAllocator(4)
    k = hash_chain([1, 2], 2)[0]
    x, y = a.allocate(2)
    assert a.commit(x, k) and not a.commit(y, k)
    a.free([y])
    assert a.evictable_count == 0 and a.lookup([k]) == [x]   # y was never cached: plain free


def test_eviction_is_lru_and_only_under_pressure():
    a = BlockAllocator(6)
    keys = hash_chain(list(range(24)), 4)                 # 6 distinct full blocks
    first = a.allocate(3)
    second = a.allocate(3)
    for b, k in zip(first + second, keys):
        a.commit(b, k)
    a.free(second)        # freed last first: second[2], second[1], second[0] (tail evicted before prefix)
    a.free(first)
    assert a.free_count == 6 and a.evictable_count == 6
    assert a.lookup(keys) == first + second               # nothing evicted while nothing is needed
    got = a.allocate(2)
    assert got == [second[2], second[1]] and a.evictions == 2
    assert a.lookup(keys[3:]) == [second[0]] and a.cached_count == 4
    a.take([second[0]])                                   # a hit moves it out of the LRU list
    assert a.allocate(1) == [first[2]]
    with pytest.raises(MemoryError):
        a.allocate(3)                                     # 2 left: nothing taken, nothing evicted
    assert a.free_count == 2 and a.cached_count == 3


def test_never_cached_blocks_go_before_any_cached_one():
    a = BlockAllocator(4)
    b = a.allocate(2)
    a.commit(b[0], 7)
    a.free(b)
    assert a.allocate(3) == [b[1], 2, 3]                  # the uncached free ones (LIFO), not b[0]
    assert a.lookup([7]) == [b[0]]


def test_random_traces_keep_refcounts_and_counts_consistent():
    """Random take / allocate / commit / share / free sequences: every block is either held
    (refs = holders), evictable (cached, no holder) or plain free, and the counts agree."""
    import random
    rng = random.Random(5)
    for _ in range(40):
        n = rng.randint(1, 24)
        a = BlockAllocator(n)
        holders: list[list[int]] = []
        for _ in range(200):
            op = rng.random()
            if op < 0.35 and a.can_allocate(k := rng.randint(0, 4)):
                holders.append(a.allocate(k))
            elif op < 0.5 and holders:
                h = rng.choice(holders)
                for b in h:
                    a.commit(b, rng.randrange(3 * n))
            elif op < 0.65:
                hit = a.lookup([rng.randrange(3 * n) for _ in range(2)])
                holders.append(a.take(hit))
            elif op < 0.75 and holders:
                holders.append(a.share(rng.choice(holders)))
            elif holders:
                a.free(holders.pop(rng.randrange(len(holders))))
            refs = [0] * n
            for h in holders:
                for b in h:
                    refs[b] += 1
            assert refs == a._refs
            assert a.extra_refs == sum(max(0, r - 1) for r in refs)
            held = sum(1 for r in refs if r)
            assert a.free_count == n - held
            assert all(refs[b] == 0 and a._key[b] is not None for b in a._evictable)
        for h in holders:
            a.free(h)
        assert a.free_count == n and a.extra_refs == 0
