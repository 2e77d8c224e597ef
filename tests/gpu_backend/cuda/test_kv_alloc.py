"""The device's KV block allocator (csrc/kv_alloc.h, compiled with g++) against
gpu_backend/scheduler/kv_cache.BlockAllocator: the same random sequences of allocations
and frees give the same block ids, free counts and errors; and inside the
scheduler's CPU twin no block is ever held twice and every block comes back."""
from __future__ import annotations

import pathlib
import random
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_backend.cuda import structs
from gpu_backend.scheduler.kv_cache import BlockAllocator
from gpu_backend.scheduler.policy import blocks_needed

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from frontend_player import FrontendPlayer  # noqa: E402
from test_cuda_twin_loop import GEOM, drain, echo, stop, twin  # noqa: E402


def _replay(ops, num_blocks: int, rows: int, max_blocks: int):
    """Apply (op, row, n) to both allocators, comparing after every op."""
    from gpu_backend.cuda.twin import KVAllocator
    dev = KVAllocator(num_blocks, rows, max_blocks)
    ref = BlockAllocator(num_blocks)
    tables: dict[int, list[int]] = {r: [] for r in range(rows)}
    for op, row, n in ops:
        if op == "alloc":
            rc = dev.allocate(row, n)
            if ref.can_allocate(n) and len(tables[row]) + n > max_blocks:
                assert rc == structs.KV_TABLE_FULL      # nothing taken
            elif not ref.can_allocate(n):
                assert rc == structs.KV_NO_BLOCKS
                with pytest.raises(MemoryError):
                    ref.allocate(n)
            else:
                assert rc == structs.KV_OK
                tables[row].extend(ref.allocate(n))
        else:
            assert dev.free(row) == structs.KV_OK
            ref.free(tables[row])
            tables[row] = []
        assert dev.blocks(row) == tables[row]
        assert dev.free_count == ref.free_count
    assert dev.check() == 0
    for r in range(rows):
        assert dev.blocks(r) == tables[r]
    return dev, ref, tables


def test_random_sequences_match_block_allocator(twin_lib):
    rng = random.Random(20261122)
    for _ in range(60):
        num_blocks, rows = rng.randint(1, 64), rng.randint(1, 8)
        max_blocks = rng.randint(1, 40)
        ops = []
        for _ in range(rng.randint(1, 300)):
            row = rng.randrange(rows)
            ops.append(("free", row, 0) if rng.random() < 0.3 else ("alloc", row, rng.choice([0, 1, 1, 2, 5, 17])))
        _replay(ops, num_blocks, rows, max_blocks)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 40), max_blocks=st.integers(1, 20),
       ops=st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "free"]), st.integers(0, 3), st.integers(0, 9)),
                    max_size=120))
def test_hypothesis_sequences_match_block_allocator(twin_lib, num_blocks, max_blocks, ops):
    _replay(ops, num_blocks, 4, max_blocks)


def test_lifo_reuse_order(twin_lib):
    """Freed blocks come back first-block-first, as BlockAllocator.free does."""
    dev, _, _ = _replay([("alloc", 0, 3), ("alloc", 1, 2), ("free", 0, 0), ("alloc", 2, 4)], 10, 3, 8)
    assert dev.blocks(2) == [0, 1, 2, 5]
    assert dev.blocks(1) == [3, 4]


def test_errors_change_nothing(twin_lib):
    from gpu_backend.cuda.twin import KVAllocator
    dev = KVAllocator(4, 2, 3)
    assert dev.allocate(0, 5) == structs.KV_NO_BLOCKS and dev.free_count == 4
    assert dev.allocate(0, 2) == structs.KV_OK
    assert dev.allocate(0, 2) == structs.KV_TABLE_FULL and dev.blocks(0) == [0, 1]
    assert dev.allocate(7, 1) == structs.KV_BAD_ROW
    # a table entry the row does not own (a double free): nothing is freed
    dev.tables[1, 0] = 0
    dev.held[1] = 1
    assert dev.free(1) == structs.KV_NOT_OWNED and dev.free_count == 2 and dev.check() == 0
    dev.held[1] = 0
    assert dev.free(0) == structs.KV_OK and dev.free_count == 4 and dev.check() == 0
    # the owner array catches a corrupted stack
    dev.owner[3] = 1
    assert dev.check() != 0


class TableProbe:
    """A launch callback (the echo step plus checks): at every step, every chunk's block
    table covers its context, each block's reference count is the number of tables holding
    it (prefix caching shares blocks), and the allocator is consistent."""

    def __init__(self, ring):
        self.ring, self.tw, self.steps = ring, None, 0

    def __call__(self, ctx, which) -> int:
        tw, st = self.tw, self.tw.state
        reqs = (structs.Req * self.ring.geom.slot_count).from_address(tw.buffer("reqs").ctypes.data)
        tables = tw.buffer("kv_tables").reshape(-1)[:self.ring.geom.slot_count * tw.config.kv_max_blocks]
        tables = tables.reshape(self.ring.geom.slot_count, tw.config.kv_max_blocks)
        slots, starts, lens = tw.buffer("chunk_slot"), tw.buffer("chunk_start"), tw.buffer("chunk_len")
        sample, out = tw.buffer("chunk_sample"), tw.buffer("step_tokens", np.int32)
        refs = tw.buffer("pkv_refs")[:tw.config.kv_blocks]
        holders = {}
        for slot in range(self.ring.geom.slot_count):
            for b in tables[slot, :reqs[slot].num_blocks].tolist() if reqs[slot].status == structs.REQ_RUNNING else []:
                holders[b] = holders.get(b, 0) + 1
        assert all(refs[b] == n for b, n in holders.items()), holders
        assert len(holders) + st.free_blocks == tw.config.kv_blocks
        assert (refs > 0).sum() == len(holders)
        for c in range(st.n_chunks):
            r = reqs[int(slots[c])]
            assert r.num_blocks == blocks_needed(int(starts[c]) + int(lens[c]), tw.config.block_size)
            if sample[c]:
                out[c] = self.ring.prompt_arena[r.prompt_offset + r.generated % r.prompt_len]
        self.steps += 1
        tw.buffer("done")[0] = st.step_no
        return 0


def test_scheduler_tables_stay_consistent_under_preemption(twin_lib, shm_ring):
    ring = shm_ring(GEOM)
    probe = TableProbe(ring)
    tw = twin(ring, max_batch_size=8, block_size=4, max_model_len=128, num_blocks=blocks_needed(128, 4) + 6,
              window_limit=7, launch_cb=probe)
    probe.tw = tw
    tw.start()
    fp, rng, want = FrontendPlayer(ring), np.random.default_rng(17), {}
    for i in range(40):
        prompt = rng.integers(0, 1000, int(rng.integers(5, 40))).tolist()
        n = int(rng.integers(10, 80))
        slot = fp.submit(prompt, n)
        want[fp.next_seq - 1] = echo(prompt, n)
        if i % 9 == 4:
            fp.cancel(slot)
    for r in drain(fp).values():
        assert r.tokens == want[r.seq][:len(r.tokens)]
    assert stop(tw) == structs.EXIT_SHUTDOWN
    assert tw.stats.preempted > 0 and probe.steps > 50
    # everything came back: every block free (never cached, or cached and evictable), nobody holds one
    pkv = structs.PKV.from_address(tw.buffer("pkv").ctypes.data)
    assert tw.state.free_blocks == tw.config.kv_blocks == pkv.never_cached + pkv.evictable
    assert pkv.extra_refs == 0 and not tw.buffer("pkv_refs")[:tw.config.kv_blocks].any()
