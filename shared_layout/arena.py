"""Token-range allocator for the ring's arenas (frontend side).

The frontend owns both arenas' free space: before a submit it takes a range of
the prompt arena for the prompt and a range of the output arena for up to
max_tokens tokens, and gives both back when it resets the slot. First fit from
a rotating hint, with coalescing on free; ranges are (offset, length) in tokens.
"""
from __future__ import annotations

import bisect


class ArenaFull(Exception):
    """No free range is large enough right now."""


class TokenArena:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._starts: list[int] = [0]     # free ranges, sorted by start
        self._lens: list[int] = [capacity]
        self._used: dict[int, int] = {}   # offset -> length of live allocations
        self._hint = 0

    @property
    def free_tokens(self) -> int:
        return sum(self._lens)

    def alloc(self, n: int) -> int:
        """Offset of a fresh range of `n` tokens; ArenaFull if none fits."""
        if n <= 0 or n > self.capacity:
            raise ValueError(f"cannot allocate {n} tokens from an arena of {self.capacity}")
        k = len(self._starts)
        for j in range(k):
            i = (self._hint + j) % k
            if self._lens[i] >= n:
                off = self._starts[i]
                if self._lens[i] == n:
                    del self._starts[i], self._lens[i]
                else:
                    self._starts[i] += n
                    self._lens[i] -= n
                self._hint = i if i < len(self._starts) else 0
                self._used[off] = n
                return off
        raise ArenaFull(f"no free range of {n} tokens ({self.free_tokens} free in pieces)")

    def free(self, off: int) -> None:
        n = self._used.pop(off)
        i = bisect.bisect_left(self._starts, off)
        self._starts.insert(i, off)
        self._lens.insert(i, n)
        if i + 1 < len(self._starts) and off + n == self._starts[i + 1]:   # merge right
            self._lens[i] += self._lens.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] == off:         # merge left
            self._lens[i - 1] += self._lens.pop(i)
            self._starts.pop(i)
        self._hint = min(self._hint, len(self._starts) - 1)
