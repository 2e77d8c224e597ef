"""The ring client's wake-up between polls: a timerfd the event loop watches, not a loop timer.

    RingClient._sleep(interval) -> WakeupTimer.arm(interval) -> the loop waits in epoll as usual
    (HTTP traffic still wakes it) -> the timerfd turns readable at the due time -> on_ready
    callback (the loop's reader) -> WakeupTimer.consume() -> the sleeping poll task resumes

Why: asyncio's and uvloop's timers wake in whole milliseconds (epoll_wait's timeout is in ms),
so the token reader had to wake 1.5 ms before a predicted step and poll finely, one wake-up
every ~40 us, until the tokens came: ~90 polls and ~2.4 ms of CPU per token at one stream,
taken from the daemon when both share a core. A timerfd expires to the microsecond (with the
thread's 1 us timer slack, shared_layout.timers), so the reader can wake just before the step.

Linux only (timerfd_create through libc); `WakeupTimer.create()` returns None elsewhere and the
client keeps the loop's own timers.
"""
from __future__ import annotations

import ctypes
import os
import sys

_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = 0o2000000


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec),
                                         ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):
        return None


class WakeupTimer:
    """One one-shot monotonic timerfd; arming it again replaces the pending expiry."""

    def __init__(self, libc, fd: int):
        self._libc, self.fd = libc, fd
        self._spec = _Itimerspec()

    @classmethod
    def create(cls) -> "WakeupTimer | None":
        libc = _libc()
        if libc is None:
            return None
        fd = libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            return None
        return cls(libc, fd)

    def arm(self, seconds: float) -> None:
        """Expire once, `seconds` from now (a past or zero time expires at once). Re-arming
        also drops an expiry not yet consumed, so a stale one never ends a later wait."""
        ns = max(1000, int(seconds * 1e9))   # it_value 0 would disarm instead
        self._spec.it_value.tv_sec, self._spec.it_value.tv_nsec = divmod(ns, 1_000_000_000)
        if self._libc.timerfd_settime(self.fd, 0, ctypes.byref(self._spec), None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_settime: {os.strerror(err)}")

    def consume(self) -> bool:
        """Take the expiry off the fd; False when there was none (re-armed since it became ready)."""
        try:
            os.read(self.fd, 8)
            return True
        except BlockingIOError:
            return False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
