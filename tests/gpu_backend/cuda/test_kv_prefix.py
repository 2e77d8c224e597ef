"""The device's prefix-caching KV allocator (csrc/kv_alloc.h blink_pkv_*, compiled with g++
into the host twin) against gpu_backend/scheduler/kv_cache.BlockAllocator on the same traces:
the same block ids handed out, the same lookups, evictions, free / evictable / cached counts
and extra references after every operation; and blink_block_hash against block_hash."""
from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest

from gpu_backend.scheduler.kv_cache import ROOT_HASH, BlockAllocator, block_hash, hash_chain

NIL = 0xFFFFFFFF
u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)


class PKV(ctypes.Structure):
    """blink_pkv_t (kv_alloc.h), field for field."""
    _fields_ = [("free_stack", u32p), ("refs", u32p), ("key", u64p), ("has_key", u32p), ("lru_prev", u32p),
                ("lru_next", u32p), ("table_key", u64p), ("table_block", u32p)] + \
               [(n, ctypes.c_uint32) for n in ("num_blocks", "table_cap", "never_cached", "evictable", "lru_head",
                                               "lru_tail", "extra_refs", "cached", "evictions", "reserved")]


class DeviceAllocator:
    """kv_alloc.h's blink_pkv_* over numpy arrays, with BlockAllocator's interface."""

    def __init__(self, lib, num_blocks: int):
        self.lib = lib
        cap = 1
        while cap < 2 * num_blocks:
            cap *= 2
        self.arrays = {n: np.zeros(num_blocks, np.uint32) for n in ("free_stack", "refs", "has_key", "lru_prev",
                                                                   "lru_next")}
        self.arrays["key"] = np.zeros(num_blocks, np.uint64)
        self.arrays["table_key"] = np.zeros(cap, np.uint64)
        self.arrays["table_block"] = np.zeros(cap, np.uint32)
        ptrs = {n: a.ctypes.data_as(u64p if a.dtype == np.uint64 else u32p) for n, a in self.arrays.items()}
        self.p = PKV(num_blocks=num_blocks, table_cap=cap, **ptrs)
        lib.blink_pkv_init_c(ctypes.byref(self.p))

    @staticmethod
    def _u32(blocks):
        return np.ascontiguousarray(blocks, np.uint32)

    @property
    def free_count(self) -> int:
        return self.p.never_cached + self.p.evictable

    def allocate(self, n: int):
        out = np.zeros(max(1, n), np.uint32)
        rc = self.lib.blink_pkv_alloc_c(ctypes.byref(self.p), n, out.ctypes.data_as(u32p))
        return None if rc else out[:n].tolist()

    def _call(self, fn, blocks) -> int:
        b = self._u32(blocks)
        return fn(ctypes.byref(self.p), b.ctypes.data_as(u32p), len(b))

    def share(self, blocks):
        return self._call(self.lib.blink_pkv_share_c, blocks)

    def free(self, blocks):
        return self._call(self.lib.blink_pkv_free_c, blocks)

    def take(self, blocks):
        return self._call(self.lib.blink_pkv_take_c, blocks)

    def lookup(self, keys):
        k = np.ascontiguousarray(keys, np.uint64)
        out = np.zeros(max(1, len(k)), np.uint32)
        n = self.lib.blink_pkv_lookup_c(ctypes.byref(self.p), k.ctypes.data_as(u64p), len(k), out.ctypes.data_as(u32p))
        return out[:n].tolist()

    def commit(self, b: int, key: int) -> int:
        return self.lib.blink_pkv_commit_c(ctypes.byref(self.p), b, ctypes.c_uint64(key))

    def clone(self) -> "DeviceAllocator":
        other = DeviceAllocator.__new__(DeviceAllocator)
        other.lib, other.arrays = self.lib, {n: a.copy() for n, a in self.arrays.items()}
        ptrs = {n: a.ctypes.data_as(u64p if a.dtype == np.uint64 else u32p) for n, a in other.arrays.items()}
        other.p = PKV(**{n: getattr(self.p, n) for n, _ in PKV._fields_ if n not in ptrs}, **ptrs)
        return other

    def table(self) -> dict[int, int]:
        blocks = self.arrays["table_block"]
        return {int(k): int(b) for k, b in zip(self.arrays["table_key"], blocks) if b != NIL}

    def lru(self) -> list[int]:
        out, b = [], self.p.lru_head
        while b != NIL:
            out.append(b)
            b = int(self.arrays["lru_next"][b])
        return out


@pytest.fixture(scope="module")
def pkv_lib(twin_lib):
    from gpu_backend.cuda.twin import lib
    so = lib()
    so.blink_pkv_lookup_c.restype = ctypes.c_uint32
    so.blink_pkv_table_del_c.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    so.blink_block_hash_c.restype = ctypes.c_uint64
    so.blink_block_hash_c.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint32]
    return so


def same(dev: DeviceAllocator, ref: BlockAllocator) -> None:
    assert dev.free_count == ref.free_count
    assert dev.p.evictable == ref.evictable_count and dev.p.cached == ref.cached_count
    assert dev.p.extra_refs == ref.extra_refs and dev.p.evictions == ref.evictions
    assert dev.arrays["refs"].tolist() == ref._refs
    assert dev.lru() == list(ref._evictable)


def replay(lib, rng: random.Random, num_blocks: int, ops: int) -> None:
    dev, ref = DeviceAllocator(lib, num_blocks), BlockAllocator(num_blocks)
    held: list[list[int]] = []
    keyspace = [rng.getrandbits(64) for _ in range(2 * num_blocks + 3)]
    for _ in range(ops):
        op = rng.random()
        if op < 0.3:
            n = rng.randint(0, 5)
            got = dev.allocate(n)
            if ref.can_allocate(n):
                want = ref.allocate(n)
                assert got == want
                held.append(want)
            else:
                assert got is None
        elif op < 0.45 and held:
            for b in rng.choice(held):
                k = rng.choice(keyspace)
                want = ref.commit(b, k)
                assert dev.commit(b, k) == int(want)
        elif op < 0.6:
            keys = [rng.choice(keyspace) for _ in range(rng.randint(0, 4))]
            hit = ref.lookup(keys)
            assert dev.lookup(keys) == hit
            if rng.random() < 0.7:
                assert dev.take(hit) == 0
                held.append(ref.take(hit))
        elif op < 0.7 and held:
            h = rng.choice(held)
            assert dev.share(h) == 0
            held.append(ref.share(h))
        elif held:
            h = held.pop(rng.randrange(len(held)))
            assert dev.free(h) == 0
            ref.free(h)
        same(dev, ref)
    for h in held:
        assert dev.free(h) == 0
        ref.free(h)
    same(dev, ref)
    assert dev.free_count == num_blocks


def test_random_traces_match_block_allocator(pkv_lib):
    rng = random.Random(20261125)
    for _ in range(80):
        replay(pkv_lib, rng, rng.randint(1, 40), rng.randint(1, 300))


def test_chat_trace_with_a_shared_prefix_and_eviction(pkv_lib):
    """The serving pattern: requests sharing a system prompt take its blocks, commit their own,
    and a small pool evicts the least recently used cached blocks."""
    bs, rng = 4, random.Random(3)
    dev, ref = DeviceAllocator(pkv_lib, 24), BlockAllocator(24)
    system = [rng.randrange(49152) for _ in range(32)]
    for i in range(12):
        tokens = system + [rng.randrange(49152) for _ in range(rng.randint(1, 40))]
        keys = hash_chain(tokens, bs)
        limit = (len(tokens) - 1) // bs
        hit = ref.lookup(keys[:limit])
        assert dev.lookup(keys[:limit]) == hit
        ref.take(hit)
        assert dev.take(hit) == 0
        need = -(-len(tokens) // bs) - len(hit)
        new = ref.allocate(need)
        assert dev.allocate(need) == new
        table = hit + new
        for b, k in zip(table[len(hit):], keys[len(hit):]):
            assert dev.commit(b, k) == int(ref.commit(b, k))
        same(dev, ref)
        ref.free(table)
        assert dev.free(table) == 0
        same(dev, ref)
    assert ref.evictions > 0 and ref.lookup(hash_chain(system, bs)) == dev.lookup(hash_chain(system, bs))
    assert len(ref.lookup(hash_chain(system, bs))) == 8    # the shared prefix, used by everyone, survives


def test_popping_the_lru_then_deleting_the_keys_is_blink_pkv_allocs_evictions(pkv_lib):
    """The parallel evictions' pieces (sched_loop.h: blink_pkv_lru_pop on thread 0, the keys removed
    from the table by every thread): popped blocks, LRU, counts and table are those of
    blink_pkv_alloc's evictions, down to an emptied LRU (head and tail gone, then refilled); the
    table check passes on every consistent state, fails on a broken one, and a rebuild from the
    blocks' own keys restores the cache."""
    rng = random.Random(7)
    for trial in range(40):
        dev, ref = DeviceAllocator(pkv_lib, 32), BlockAllocator(32)
        keyspace = iter(rng.getrandbits(64) for _ in range(10_000))
        for _ in range(rng.randint(1, 6)):                  # cached blocks on the LRU, some on the stack
            n = rng.randint(1, min(8, dev.free_count))
            got = dev.allocate(n)
            assert got == ref.allocate(n)
            for b in got[:rng.randint(0, n)]:
                k = next(keyspace)
                assert dev.commit(b, k) == int(ref.commit(b, k))
            assert dev.free(got) == 0
            ref.free(got)
        assert pkv_lib.blink_pkv_table_check_c(ctypes.byref(dev.p)) == 0
        if dev.p.evictable == 0:
            continue
        k = dev.p.evictable if trial % 4 == 0 else rng.randint(1, dev.p.evictable)   # now and then all of it
        serial, on_stack = dev.clone(), dev.p.never_cached
        want = serial.allocate(on_stack + k)[on_stack:]       # the stack first, then k evictions
        assert dev.allocate(on_stack) is not None
        out = np.zeros(k, np.uint32)
        keys = [int(dev.arrays["key"][b]) for b in dev.lru()[:k]]
        pkv_lib.blink_pkv_lru_pop_c(ctypes.byref(dev.p), k, out.ctypes.data_as(u32p))
        assert out.tolist() == want
        for key in keys:
            pkv_lib.blink_pkv_table_del_c(ctypes.byref(dev.p), key)
        dev.arrays["refs"][out] = 1
        assert dev.lru() == serial.lru() and (dev.p.lru_head, dev.p.lru_tail) == (serial.p.lru_head, serial.p.lru_tail)
        for n in ("evictable", "cached", "evictions", "never_cached"):
            assert getattr(dev.p, n) == getattr(serial.p, n), n
        assert dev.table() == serial.table() and dev.arrays["has_key"].tolist() == serial.arrays["has_key"].tolist()
        assert pkv_lib.blink_pkv_table_check_c(ctypes.byref(dev.p)) == 0
        assert dev.free(out.tolist()) == 0 and serial.free(want) == 0      # back on the stack (no keys), LRU intact
        assert dev.lru() == serial.lru() and dev.free_count == serial.free_count
    # a broken table (an entry lost, one left behind) fails the check; the rebuild restores the cache
    dev = DeviceAllocator(pkv_lib, 16)
    got = dev.allocate(6)
    for i, b in enumerate(got):
        dev.commit(b, 1000 + i)
    want = dev.table()
    slot = int(np.flatnonzero(dev.arrays["table_block"] == got[2])[0])
    dev.arrays["table_block"][slot] = 0xFFFFFFFE                       # a mark left behind
    assert pkv_lib.blink_pkv_table_check_c(ctypes.byref(dev.p)) == 1
    pkv_lib.blink_pkv_table_rebuild_c(ctypes.byref(dev.p))
    assert pkv_lib.blink_pkv_table_check_c(ctypes.byref(dev.p)) == 0 and dev.table() == want and dev.p.cached == 6
    dev.arrays["table_block"][int(np.flatnonzero(dev.arrays["table_block"] == got[4])[0])] = NIL   # an entry lost
    assert pkv_lib.blink_pkv_table_check_c(ctypes.byref(dev.p)) != 0


def test_errors_change_nothing(pkv_lib):
    dev, ref = DeviceAllocator(pkv_lib, 4), BlockAllocator(4)
    assert dev.allocate(5) is None and dev.free_count == 4
    a = dev.allocate(2)
    ref.allocate(2)
    assert dev.free([3]) != 0 and dev.share([3]) != 0 and dev.take([a[0]]) != 0   # not held / not cached
    assert dev.commit(3, 1) == -1
    same(dev, ref)


def test_block_hash_is_the_same_in_both_languages(pkv_lib):
    rng = random.Random(9)
    for n in (0, 1, 16, 64):
        toks = np.array([rng.randrange(2**31) for _ in range(n)], np.int32)
        parent = rng.getrandbits(64)
        assert pkv_lib.blink_block_hash_c(parent, toks.ctypes.data, n) == block_hash(parent, toks.tolist())
    toks = np.arange(16, dtype=np.int32)
    assert pkv_lib.blink_block_hash_c(ROOT_HASH, toks.ctypes.data, 16) == hash_chain(list(range(16)), 16)[0]
