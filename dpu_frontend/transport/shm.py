"""Shared-memory transport: the ring is a file under /dev/shm mapped with mmap.

    ShmTransport.open(name) -> read (fence, copy out) / write (fence, copy in)

The only frontend module that touches the mapping itself. Reads return bytes
copies (so no view outlives `close`); every access starts with a fence, which
gives the ordering the Transport contract promises. The inode is remembered at
open so `stale()` notices a daemon that replaced an unusable ring file.
"""
from __future__ import annotations

import os

from shared_layout import HEADER, LayoutMismatch, RingGeometry, fence
from shared_layout.shm import ShmRegion, shm_path

from .base import RingNotFound, TransportError


class ShmTransport:
    shares_clock = True  # same machine, same CLOCK_MONOTONIC as the daemon

    def __init__(self, region: ShmRegion, geometry: RingGeometry, inode: tuple[int, int]):
        self.region = region
        self.geometry = geometry
        self.name = region.name
        self._inode = inode
        self._mv: memoryview | None = memoryview(region.buf)
        self._size = geometry.total_size

    @classmethod
    def open(cls, ring_name: str) -> "ShmTransport":
        """Map the ring `ring_name`; RingNotFound if absent, LayoutMismatch if not a usable ring."""
        path = shm_path(ring_name)  # ValueError for a bad name
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise RingNotFound(f"ring {ring_name!r} does not exist ({path}); is the daemon running?") from None
        except PermissionError as e:
            raise TransportError(f"cannot open ring {ring_name!r}: {e}") from None
        st = os.fstat(fd)
        if st.st_size < HEADER.size:
            os.close(fd)
            raise RingNotFound(f"ring {ring_name!r} is not formatted yet ({st.st_size} bytes)")
        region = ShmRegion(ring_name, st.st_size, fd)  # maps and closes fd
        try:
            geom = RingGeometry.from_header(bytes(region.buf[:HEADER.size]))
            if geom.total_size > st.st_size:
                raise LayoutMismatch(f"ring file is {st.st_size} bytes, its header says {geom.total_size}")
        except LayoutMismatch:
            region.close()
            raise
        return cls(region, geom, (st.st_dev, st.st_ino))

    def _check(self, offset: int, nbytes: int) -> memoryview:
        mv = self._mv
        if mv is None:
            raise TransportError(f"ring {self.name!r}: transport closed")
        if offset < 0 or nbytes < 0 or offset + nbytes > self._size:
            raise ValueError(f"ring access [{offset}, {offset + nbytes}) outside the {self._size}-byte ring")
        return mv

    def read(self, offset: int, nbytes: int) -> bytes:
        mv = self._check(offset, nbytes)
        fence()  # this read after every earlier access: a count is read before the tokens it covers
        return bytes(mv[offset:offset + nbytes])

    def read_into(self, offset: int, out: memoryview) -> None:
        """Copy ring bytes [offset, offset + len(out)) into `out` (one copy, for bulk reads)."""
        mv = self._check(offset, out.nbytes)
        fence()  # as in read
        out[:] = mv[offset:offset + out.nbytes]

    def write(self, offset: int, data: bytes) -> None:
        mv = self._check(offset, len(data))
        fence()  # this write after every earlier access: e.g. a reset after our reads of the slot
        mv[offset:offset + len(data)] = data

    def write_batch(self, writes: list[tuple[int, bytes]]) -> None:
        for off, data in writes:
            self._check(off, len(data))
        mv = self._mv
        for off, data in writes:
            fence()  # each write after the previous ones: a state word never precedes its payload
            mv[off:off + len(data)] = data

    def stale(self) -> bool:
        try:
            st = os.stat(self.region.path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self._inode

    def close(self) -> None:
        if self._mv is not None:
            self._mv.release()
            self._mv = None
            self.region.close()

    def __repr__(self) -> str:
        return f"ShmTransport({self.name!r}, slots={self.geometry.slot_count})"
