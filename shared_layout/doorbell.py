"""The doorbell: a host daemon tells a frontend on the same machine "new words are in the ring".

    daemon (Engine.serve): a step published tokens or ended slots (BackendPort.writes moved)
        -> Doorbell.ring(): one non-blocking 1-byte datagram to the ring's abstract unix address
    frontend (RingClient, shm transport): BellListener bound to that address, watched by the
        event loop -> readable -> drain() -> poll the ring now (TokenReader.heard_bell)

The ring stays the only channel for data: the bell carries no content, and a frontend that
never hears one (a daemon on another host over verbs, the CUDA executor's device loop, a
frontend in another network namespace, a second frontend whose bind found the name taken)
polls as it always did. With a bell the frontend sleeps until the daemon rings instead of
waking around each predicted step: SmolLM2 at one stream on a 2-core EPYC, ~6 wake-ups and
~0.5 ms of frontend CPU a token (taken from the daemon's two threads) became one wake-up.

A bell is never lost while someone listens: a datagram waits in the socket until drained, and
when the socket's queue is full the frontend already has one to wake for. Without a listener
the send fails at once (ECONNREFUSED) and the daemon tries again only after RETRY_S, so a
daemon nobody listens to pays one failed syscall a quarter second.

Linux's abstract socket namespace: nothing in the file system to clean up; the name goes with
the listener's socket. It has no permissions either: any process in the network namespace may
ring (a spurious bell costs one poll) or bind the name first (the frontend then polls as above).
Only a wake-up hint crosses it; requests, tokens and states stay in the 0600 ring file.
"""
from __future__ import annotations

import socket
import sys
import time

RETRY_S = 0.25   # after a failed send (no listener), the daemon's next try


def address(ring_name: str) -> bytes:
    """The abstract unix address of ring `ring_name`'s bell."""
    return b"\0blink-bell/" + ring_name.encode()


def supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(socket, "AF_UNIX")


class Doorbell:
    """The daemon's side: ring() after a step that wrote what a frontend waits for."""

    def __init__(self, ring_name: str):
        self.addr = address(ring_name)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        self._retry_s = 0.0
        self.rung = 0

    @classmethod
    def create(cls, ring_name: str) -> "Doorbell | None":
        return cls(ring_name) if supported() else None

    def ring(self) -> bool:
        """Send one bell; False when nobody listens (or the queue is full: a bell is pending anyway)."""
        if self._retry_s and time.monotonic() < self._retry_s:
            return False
        try:
            self.sock.sendto(b"\1", self.addr)
        except BlockingIOError:
            return False          # the listener's queue is full: it has bells to wake for
        except OSError:
            self._retry_s = time.monotonic() + RETRY_S   # no listener (ECONNREFUSED): try later
            return False
        self._retry_s = 0.0
        self.rung += 1
        return True

    def close(self) -> None:
        self.sock.close()


class BellListener:
    """The frontend's side: a bound, non-blocking datagram socket for the event loop to watch."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    @classmethod
    def create(cls, ring_name: str) -> "BellListener | None":
        """Bind the ring's bell address; None where that cannot be (not Linux, the name is taken
        by another frontend on this ring): that frontend polls without a bell."""
        if not supported():
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            sock.bind(address(ring_name))
        except OSError:
            sock.close()
            return None
        return cls(sock)

    def fileno(self) -> int:
        return self.sock.fileno()

    def drain(self) -> int:
        """Take every pending bell off the socket; how many there were."""
        n = 0
        while True:
            try:
                self.sock.recv(64)
            except OSError:   # BlockingIOError: drained
                return n
            n += 1

    def close(self) -> None:
        self.sock.close()
