"""Transports from the frontend to the ring (DESIGN §4): base.py (the interface),
shm.py (POSIX shared memory on one machine). A verbs (RDMA) transport implements
the same interface."""
from __future__ import annotations

import functools

from .base import RingNotFound, Transport, TransportError, TransportFactory
from .shm import ShmTransport


def shm_factory(ring_name: str) -> TransportFactory:
    """A factory RingClient calls to (re)open the shared-memory ring `ring_name`."""
    return functools.partial(ShmTransport.open, ring_name)


__all__ = ["RingNotFound", "ShmTransport", "Transport", "TransportError", "TransportFactory", "shm_factory"]
