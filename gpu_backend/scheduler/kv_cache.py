"""KV block bookkeeping: which blocks of the paged pool are free and who holds the others.

    kv_pool.blocks_for_budget -> num_blocks -> BlockAllocator (free list, holders
    per block; per-request block tables live on the Sequence) -> the scheduler
    allocates at admission and block boundaries, frees at finish and preemption;
    the tensors the block ids index are kv_pool.KVPool's.

The allocator separates checking from committing (`can_allocate` / `allocate`)
and is integer-only, so the engine and the policy agree on `free_count`. Blocks
are reference-counted: the choices of one prompt (n > 1) share its full prefill
blocks (`share`); a block returns to the free list when its last holder frees it.
`extra_refs` (references beyond the first, summed) lets the engine tell the
policy a free count that stays true whichever sharers it preempts.
"""
from __future__ import annotations


class BlockAllocator:
    """Free list over block ids 0..num_blocks-1; LIFO so recently freed blocks are reused first."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))   # pop() hands out 0, 1, 2, ...
        self._refs = [0] * num_blocks                         # holders of each block; 0 = free
        self.extra_refs = 0                                   # sum over blocks of (holders - 1)

    @property
    def free_count(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """`n` block ids; MemoryError (nothing taken) when fewer are free."""
        if not self.can_allocate(n):
            raise MemoryError(f"{n} KV blocks asked, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, blocks: list[int]) -> list[int]:
        """One more holder for each of `blocks` (allocated ones); returns them for the new holder's table."""
        for b in blocks:
            if not 0 <= b < self.num_blocks or not self._refs[b]:
                raise ValueError(f"KV block {b} shared but not allocated")
        for b in blocks:
            self._refs[b] += 1
        self.extra_refs += len(blocks)
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        """One holder gives blocks back; a block that is not allocated raises ValueError (double free)."""
        for b in blocks:
            if not 0 <= b < self.num_blocks or not self._refs[b]:
                raise ValueError(f"KV block {b} freed but not allocated")
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b]:
                self.extra_refs -= 1
            else:
                self._free.append(b)
