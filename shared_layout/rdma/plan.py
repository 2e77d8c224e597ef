"""Turning ring writes and reads into RDMA work requests (pure: no pyverbs).

    [(ring offset, bytes), ...]  --coalesce-->  pieces  --plan_write_chains-->  chains of WriteOp
    (offset, nbytes)             --plan_reads-->         rounds of ReadOp
    [(offset, nbytes), ...]      --plan_read_batch-->    rounds of ReadOp (many ranges, one chain)

One RC queue pair executes RDMA WRITEs in the order they are posted, and the
NIC places consecutive messages into host memory in that order (PCIe posted
writes; the ring's memory region is registered without relaxed ordering). The
bytes *inside* one message land in no defined order. So:

- a publish word (a slot's state word, or a header word the daemon acts on)
  is always a work request of its own: never merged with the payload before
  it, so a reader that sees the word sees that payload;
- any other writes that touch consecutive bytes merge into one work request
  (prompt pieces, a slot body), cutting the number of WRs in a burst;
- a burst of submissions becomes one chain: one post_send (one doorbell),
  only the chain's last WR signaled, bounded by the send queue depth and the
  staging buffer the payload bytes are copied into.

`StagingRing` is the allocator for that buffer: chains complete in post order
on one QP, so spans are released oldest first.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from typing import Callable, Iterable

from shared_layout import HEADER, SLOT, RingGeometry

_STATE_SIZE = SLOT.field("state").size
_PUBLISH_HEADER_FIELDS = ("frontend_epoch", "frontend_doorbell", "shutdown")


@dataclasses.dataclass(frozen=True)
class WriteOp:
    """One RDMA WRITE: `length` bytes staged at `staging_offset` go to ring `remote_offset`."""
    remote_offset: int
    length: int
    staging_offset: int   # relative to the chain's staging span
    inline: bool          # small enough to travel inside the WQE (IBV_SEND_INLINE)
    piece: int            # index of the coalesced piece the bytes come from
    piece_start: int      # and where in that piece they start


@dataclasses.dataclass(frozen=True)
class WriteChain:
    """WRs posted with one post_send; the last one is signaled."""
    ops: tuple[WriteOp, ...]
    staging_start: int    # span of the staging buffer the chain holds until it completes
    staging_bytes: int


@dataclasses.dataclass(frozen=True)
class ReadOp:
    """One RDMA READ: ring [remote_offset, +length) into the read buffer at local_offset."""
    remote_offset: int
    length: int
    local_offset: int


@dataclasses.dataclass(frozen=True)
class ChainLimits:
    max_wrs: int            # WRs per chain (<= the send queue depth)
    staging_bytes: int      # capacity of the staging buffer
    max_msg_bytes: int      # largest single RDMA message the port allows
    inline_bytes: int = 0   # largest payload sent inline (the QP's max_inline_data)
    align: int = 8          # staging spans start on this boundary

    def __post_init__(self):
        if self.max_wrs < 1 or self.staging_bytes < self.align or self.max_msg_bytes < 1:
            raise ValueError(f"unusable chain limits {self}")


def publish_words(geom: RingGeometry) -> Callable[[int, int], bool]:
    """Predicate: does a write at (offset, nbytes) touch a word a reader acts on by itself?"""
    slots_lo = geom.slots_offset
    slots_hi = slots_lo + geom.slot_count * SLOT.size
    state_off = SLOT.offset("state")
    header_words = [(HEADER.offset(n), HEADER.field(n).size) for n in _PUBLISH_HEADER_FIELDS]

    def is_publish(offset: int, nbytes: int) -> bool:
        end = offset + nbytes
        for lo, size in header_words:
            if offset < lo + size and lo < end:
                return True
        if end <= slots_lo or offset >= slots_hi:
            return False
        # the first slot whose state word ends after `offset`: if any state word
        # overlaps the write, this one does
        k = max(0, (offset - slots_lo - state_off - _STATE_SIZE + SLOT.size) // SLOT.size)
        s = slots_lo + k * SLOT.size + state_off
        return k < geom.slot_count and s < end and offset < s + _STATE_SIZE

    return is_publish


def coalesce(writes: Iterable[tuple[int, bytes]], is_publish: Callable[[int, int], bool]
             ) -> list[tuple[int, bytes]]:
    """Merge runs of writes to consecutive bytes; a publish word stays alone, in place."""
    out: list[tuple[int, bytes]] = []
    mergeable = False            # may the next write extend out[-1]?
    for off, data in writes:
        data = bytes(data)
        if not data:
            continue
        pub = is_publish(off, len(data))
        if mergeable and not pub and out[-1][0] + len(out[-1][1]) == off:
            out[-1] = (out[-1][0], out[-1][1] + data)
        else:
            out.append((off, data))
        mergeable = not pub
    return out


def plan_write_chains(pieces: list[tuple[int, bytes]], limits: ChainLimits) -> list[WriteChain]:
    """Split pieces into messages and chains that fit the QP and the staging buffer.

    Staging offsets are relative to the chain's own span (the caller reserves
    the span and adds its start). Order is preserved across and within chains.
    """
    chunk = min(limits.max_msg_bytes, limits.staging_bytes)
    chains: list[WriteChain] = []
    ops: list[WriteOp] = []
    used = 0
    for i, (off, data) in enumerate(pieces):
        for start in range(0, len(data), chunk):
            n = min(chunk, len(data) - start)
            span = _align(n, limits.align)
            if ops and (len(ops) == limits.max_wrs or used + span > limits.staging_bytes):
                chains.append(WriteChain(tuple(ops), 0, used))
                ops, used = [], 0
            ops.append(WriteOp(off + start, n, used, n <= limits.inline_bytes, i, start))
            used += span
    if ops:
        chains.append(WriteChain(tuple(ops), 0, used))
    return chains


def chain_payload(pieces: list[tuple[int, bytes]], chain: WriteChain) -> list[tuple[int, bytes]]:
    """(staging offset within the chain's span, bytes) to copy before posting `chain`."""
    return [(op.staging_offset, pieces[op.piece][1][op.piece_start:op.piece_start + op.length])
            for op in chain.ops]


def plan_reads(offset: int, nbytes: int, buffer_bytes: int, max_msg_bytes: int, max_wrs: int
               ) -> list[list[ReadOp]]:
    """Rounds of READs (each round fills the read buffer at most once, one chain per round)."""
    if nbytes < 0 or offset < 0:
        raise ValueError(f"bad read [{offset}, +{nbytes})")
    rounds: list[list[ReadOp]] = []
    pos = 0
    while pos < nbytes:
        ops: list[ReadOp] = []
        local = 0
        while pos < nbytes and local < buffer_bytes and len(ops) < max_wrs:
            n = min(max_msg_bytes, buffer_bytes - local, nbytes - pos)
            ops.append(ReadOp(offset + pos, n, local))
            local += n
            pos += n
        rounds.append(ops)
    return rounds


def plan_read_batch(reads: list[tuple[int, int]], buffer_bytes: int, max_msg_bytes: int, max_wrs: int
                    ) -> list[list[tuple[ReadOp, int, int]]]:
    """Rounds of READs for many ranges at once: (op, index of the range, position in it).

    Each round is one chain filling the read buffer at most once, so a poll that
    needs the new tokens of many requests pays one round trip, not one per request.
    """
    chunk = min(max_msg_bytes, buffer_bytes)
    rounds: list[list[tuple[ReadOp, int, int]]] = []
    cur: list[tuple[ReadOp, int, int]] = []
    local = 0
    for i, (offset, nbytes) in enumerate(reads):
        if nbytes < 0 or offset < 0:
            raise ValueError(f"bad read [{offset}, +{nbytes})")
        for pos in range(0, nbytes, chunk):
            n = min(chunk, nbytes - pos)
            if cur and (len(cur) == max_wrs or local + n > buffer_bytes):
                rounds.append(cur)
                cur, local = [], 0
            cur.append((ReadOp(offset + pos, n, local), i, pos))
            local += n
    if cur:
        rounds.append(cur)
    return rounds


class StagingRing:
    """First-in first-out allocator of contiguous spans in a circular buffer."""

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError("staging capacity must be positive")
        self.capacity = capacity
        self.head = 0                 # next free byte
        self.used = 0                 # bytes held, including skipped tails
        self.spans: deque[tuple[int, int]] = deque()  # (start, bytes held incl. any skipped tail)

    def reserve(self, nbytes: int) -> int | None:
        """Start of a free contiguous span of `nbytes`, or None until older spans are released."""
        if nbytes <= 0 or nbytes > self.capacity:
            raise ValueError(f"span of {nbytes} bytes does not fit a {self.capacity}-byte staging buffer")
        skip = 0
        if self.head + nbytes > self.capacity:          # would wrap: waste the tail
            skip = self.capacity - self.head
        if self.used + skip + nbytes > self.capacity:
            return None
        start = 0 if skip else self.head
        self.spans.append((start, nbytes + skip))
        self.used += nbytes + skip
        self.head = (start + nbytes) % self.capacity
        return start

    def release_oldest(self) -> None:
        _, held = self.spans.popleft()
        self.used -= held
        if not self.spans:
            self.head, self.used = 0, 0

    def __len__(self) -> int:
        return len(self.spans)


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a
