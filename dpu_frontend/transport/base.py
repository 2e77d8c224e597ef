"""The frontend's only way to the ring: read and write bytes at ring offsets.

    RingClient -> TokenReader / RingSession -> Transport.read / write / write_batch -> ring

A transport reaches a ring that may live in another address space (host memory
on one box, GPU memory behind a NIC on a DPU), so it hands out copies, never
views: nothing outside a transport implementation holds a pointer into the ring.
That keeps the shared-memory path (shm.py) and a verbs path (one-sided RDMA READ
and WRITE on one RC queue pair) interchangeable.

Ordering contract every implementation keeps:
- `read` sees every earlier `write`/`write_batch` of this process and is
  ordered after every earlier `read` (so "read the count, then read the tokens
  below it" is safe).
- `write_batch` applies its writes in list order and no later write becomes
  visible before an earlier one (a slot's state word goes last and is never
  seen before the payload it publishes).
"""
from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

from shared_layout import RingGeometry
from shared_layout.errors import RingNotFound, TransportError

__all__ = ["RingNotFound", "Transport", "TransportError", "TransportFactory"]


@runtime_checkable
class Transport(Protocol):
    """Byte access to one ring instance. Raises TransportError when the ring is gone."""

    geometry: RingGeometry
    # True when the peer stamps the header with the same monotonic clock this
    # process reads (one machine); lets health checks use backend_heartbeat_ns.
    shares_clock: bool

    def read(self, offset: int, nbytes: int) -> bytes | memoryview:
        """Copy of ring bytes [offset, offset + nbytes)."""

    # Optional: `read_into(offset, out: memoryview)` fills `out` with the same bytes
    # `read` would return, sparing a copy on bulk reads; callers fall back to `read`.

    def write(self, offset: int, data: bytes) -> None:
        """Write `data` at `offset`, ordered after this process's earlier ring accesses."""

    def write_batch(self, writes: list[tuple[int, bytes]]) -> None:
        """Apply (offset, data) writes in order, posted together (one RDMA chain)."""

    def stale(self) -> bool:
        """True when the ring behind this transport has been replaced or removed."""

    def close(self) -> None:
        """Release the mapping or connection. Idempotent."""


TransportFactory = Callable[[], Transport]
