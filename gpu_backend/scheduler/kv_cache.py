"""KV block bookkeeping: which blocks of the paged pool are free, who holds the others, and
which hold a known prefix (automatic prefix caching).

    kv_pool.blocks_for_budget -> num_blocks -> BlockAllocator (free list, holders per
    block; per-request block tables live on the Sequence) -> the scheduler allocates at
    admission and block boundaries, frees at finish and preemption; the tensors the
    block ids index are kv_pool.KVPool's.

    prefix cache: a full block's key is block_hash(parent key, its tokens), a hash chain
    from the first block (as vLLM's automatic prefix caching). Once computed, a full block
    is committed under its key; a new request looks its chain up (`lookup`: the longest
    run of leading keys present) and takes those blocks (`take`) instead of computing them.
    A committed block whose last holder frees it stays cached, *evictable*: counted free,
    kept in LRU order, and evicted (its key dropped) only when `allocate` finds no
    never-cached block left. Partial blocks are never committed, so never shared.

The allocator separates checking from committing (`can_allocate` / `allocate`) and is
integer-only, so the engine and the policy agree on `free_count` (evictable blocks
included). Blocks are reference-counted: the choices of one prompt (n > 1) share its
full prefill blocks (`share`), requests with a common prefix share its cached blocks
(`take`); a block returns to the free list (or the evictable set) when its last holder
frees it. `extra_refs` (references beyond the first, summed) lets the engine tell the
policy a free count that stays true whichever sharers it preempts.

csrc/kv_alloc.h (blink_pkv_*) is the device's twin of this class, diff-tested on the
same traces (tests/gpu_backend/cuda/test_kv_prefix.py); block_hash is defined once for
both languages (splitmix64 steps over 64-bit words).
"""
from __future__ import annotations

import collections

MASK64 = (1 << 64) - 1
ROOT_HASH = 0x424C494E4B4B5643        # the parent key of a sequence's first block ("BLINKKVC")
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection on 64-bit words."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def block_hash(parent: int, tokens) -> int:
    """The key of a full block: its parent's key, then each token id, folded by splitmix64 steps
    (csrc/kv_alloc.h blink_block_hash computes the same)."""
    h = _mix64((parent + _GOLDEN) & MASK64)
    for t in tokens:
        h = _mix64(((h ^ (int(t) & 0xFFFFFFFF)) + _GOLDEN) & MASK64)
    return h


def hash_chain(tokens, block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Keys of every full block of `tokens` (a trailing partial block has none)."""
    out = []
    for j in range(len(tokens) // block_size):
        parent = block_hash(parent, tokens[j * block_size:(j + 1) * block_size])
        out.append(parent)
    return out


class BlockAllocator:
    """Free list over block ids 0..num_blocks-1 (LIFO, so recently freed blocks are reused first),
    plus the prefix cache: key -> block, and the evictable cached blocks in LRU order."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))   # never-cached free blocks; pop() hands out 0, 1, 2, ...
        self._refs = [0] * num_blocks                         # holders of each block; 0 = free or evictable
        self.extra_refs = 0                                   # sum over blocks of (holders - 1)
        self._key: list[int | None] = [None] * num_blocks     # the key a block is committed under
        self._cached: dict[int, int] = {}                     # key -> block
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()   # LRU first
        self.evictions = 0                                    # cached blocks reused for new content

    @property
    def free_count(self) -> int:
        """Blocks an allocation can have: never-cached free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def cached_count(self) -> int:
        """Blocks committed under a key (held or evictable)."""
        return len(self._cached)

    @property
    def evictable_count(self) -> int:
        return len(self._evictable)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.free_count

    def allocate(self, n: int) -> list[int]:
        """`n` block ids; MemoryError (nothing taken) when fewer are free. Never-cached blocks
        first; then the least recently used evictable ones, whose keys are dropped."""
        if not self.can_allocate(n):
            raise MemoryError(f"{n} KV blocks asked, {self.free_count} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._cached[self._key[b]]
                self._key[b] = None
                self.evictions += 1
            self._refs[b] = 1
            out.append(b)
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
        """One holder gives blocks back; a block that is not allocated raises ValueError (double free).
        Last first: a cached tail block becomes evictable before its prefix does."""
        for b in blocks:
            if not 0 <= b < self.num_blocks or not self._refs[b]:
                raise ValueError(f"KV block {b} freed but not allocated")
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b]:
                self.extra_refs -= 1
            elif self._key[b] is not None:
                self._evictable[b] = None          # most recently used end
            else:
                self._free.append(b)

    # -- the prefix cache -------------------------------------------------------------
    def lookup(self, keys: list[int]) -> list[int]:
        """The cached blocks of the longest run of leading `keys` present (changes nothing)."""
        out = []
        for k in keys:
            b = self._cached.get(k)
            if b is None:
                break
            out.append(b)
        return out

    def idle(self, b: int) -> bool:
        """Whether a cached block has no holder (taking it lowers free_count)."""
        return self._refs[b] == 0

    def take(self, blocks: list[int]) -> list[int]:
        """One more holder for each of `blocks` (cached ones, from lookup): an evictable block
        leaves the evictable set. Returns them for the new holder's table."""
        for b in blocks:
            if not 0 <= b < self.num_blocks or self._key[b] is None:
                raise ValueError(f"KV block {b} taken but not cached")
        for b in blocks:
            if self._refs[b]:
                self.extra_refs += 1
            else:
                del self._evictable[b]
            self._refs[b] += 1
        return list(blocks)

    def commit(self, block: int, key: int) -> bool:
        """Offer a held, full, computed block to the cache under `key`. False (nothing changes)
        when the block already has a key or another block holds this key (the same prefix
        computed twice at once: the first stays the cached one)."""
        if not 0 <= block < self.num_blocks or not self._refs[block]:
            raise ValueError(f"KV block {block} committed but not allocated")
        if self._key[block] is not None or key in self._cached:
            return False
        self._key[block] = key
        self._cached[key] = block
        return True
