"""Errors of reaching a ring, raised by either side's link code.

    frontend transports (dpu_frontend/transport: shm, verbs)  --raise-->  TransportError / RingNotFound
    RDMA verbs layer (shared_layout/rdma), daemon's RDMA server --raise--> TransportError

They live here, not with the frontend's transports, because the daemon's RDMA
server raises and catches the same errors and must not import the frontend.
"""
from __future__ import annotations


class TransportError(ConnectionError):
    """The ring cannot be reached: missing, unmapped, or the link is down."""


class RingNotFound(TransportError):
    """No ring exists under that name yet (the daemon has not created it)."""
