"""The CPU executor's defaults: seats sized from the KV pool (64 streams of the embedded model all
run in the default 1 GiB), never more than the cap, at least one."""
from __future__ import annotations

from gpu_backend.executors.cpu import MAX_BATCH_SIZE_CAP, SEAT_TOKENS, default_max_batch_size
from gpu_backend.kv_cache import blocks_for_budget


def test_seats_come_from_the_kv_pool():
    # SmolLM2-135M (30 layers, 3 KV heads of 64) in float32, the default 1 GiB, 16-token blocks
    blocks = blocks_for_budget(1024 * 2**20, 30, 3, 64, 16, 4)
    seats = default_max_batch_size(blocks, 16)
    assert seats >= 64                                            # 64 streams run at once
    assert seats * SEAT_TOKENS <= blocks * 16                     # each seat's typical request fits
    assert default_max_batch_size(10**7, 16) == MAX_BATCH_SIZE_CAP
    assert default_max_batch_size(3, 16) == 1
