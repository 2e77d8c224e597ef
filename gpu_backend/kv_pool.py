"""The paged KV pool: the K/V tensors every layer writes and reads, and their sizing.

    memory budget -> num_blocks (blocks_for_budget) -> KVPool tensors
    [num_layers, kv_heads, num_blocks, block_size, head_dim] -> paged_attention.py
    writes and reads them through the block tables the scheduler hands out
    (scheduler/kv_cache.py decides which block ids are free; this module only stores).
"""
from __future__ import annotations

import dataclasses


def blocks_for_budget(budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int,
                      block_size: int, dtype_bytes: int) -> int:
    """How many KV blocks (K and V, every layer) fit in `budget_bytes`."""
    block_bytes = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes
    return budget_bytes // block_bytes


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
