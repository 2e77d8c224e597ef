"""The paged KV cache: block bookkeeping (BlockAllocator) and the pool tensors (KVPool).

    memory budget -> num_blocks (blocks_for_budget) -> BlockAllocator (which
    blocks are free; per-request block tables live on the engine's Sequence)
    -> KVPool tensors [num_layers, kv_heads, num_blocks, block_size, head_dim]
    that paged_attention.py writes and reads through the block tables.

The allocator separates checking from committing (`can_allocate` / `allocate`)
and is integer-only, so the engine and the policy agree on `free_count`. Blocks
are reference-counted: the choices of one prompt (n > 1) share its full prefill
blocks (`share`); a block returns to the free list when its last holder frees it.
`extra_refs` (references beyond the first, summed) lets the engine tell the
policy a free count that stays true whichever sharers it preempts.
"""
from __future__ import annotations

import dataclasses


def blocks_for_budget(budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int,
                      block_size: int, dtype_bytes: int) -> int:
    """How many KV blocks (K and V, every layer) fit in `budget_bytes`."""
    block_bytes = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes
    return budget_bytes // block_bytes


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


@dataclasses.dataclass(frozen=True)
class KVCacheConfig:
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int


class KVPool:
    """K and V storage of every layer, addressed by (kv head, block, offset in block).

    Head-major: gathering a batch's blocks yields [kv_heads, batch, context, D]
    slabs that the attention matmuls consume without a transposing copy.
    """

    def __init__(self, config: KVCacheConfig, dtype=None, device=None):
        import torch
        self.config = config
        shape = (config.num_layers, config.num_kv_heads, config.num_blocks, config.block_size, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype or torch.float32, device=device)  # [L, KV, blocks, bs, D]
        self.v = torch.zeros(shape, dtype=dtype or torch.float32, device=device)  # [L, KV, blocks, bs, D]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy K and V of block src into block dst, every layer, for each (src, dst): a fork's
        copy of the prompt's last, partial block (copy-on-write)."""
        for src, dst in pairs:
            self.k[:, :, dst] = self.k[:, :, src]
            self.v[:, :, dst] = self.v[:, :, src]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
