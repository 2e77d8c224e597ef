"""What bounds one request: sizes, deadlines, and a watch on clients that stop reading.

    FrontendConfig -> RequestLimits (frozen; one per app)
    body bytes -> has_lone_surrogate (JSON "\\ud800" escapes the tokenizer cannot encode)
    arrival -> deadline_s (request_timeout_s) -> queue wait capped by it -> handle aborted at it
    arrival -> body_deadline_s (body_timeout_s, or the request's deadline if sooner) -> 408
        (the headers' own deadline, header_timeout_s, is per connection: http_server.py)
    each SSE stream -> limit_send_buffer: the kernel holds at most ~2 x 64 KiB for it (not the
        megabytes TCP autotuning allows), asyncio's transport 64 KiB more, the handle a bounded
        number of tokens (RingClientConfig.max_buffered_tokens)
    each SSE write -> StallWatch: a write blocked longer than stall_timeout_s (the client's
        socket and our bounded buffer are full) -> the request is cancelled and the
        connection dropped, so a reader that stopped never holds a slot or memory

Every limit is a setting with a sane default (config.py); 0 or None turns a
deadline or a cap off.
"""
from __future__ import annotations

import asyncio
import dataclasses
import re
import socket
from typing import Any, Callable

from .config import FrontendConfig


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    queue_timeout_s: float = 30.0          # longest wait for a slot (429 after)
    request_timeout_s: float = 600.0       # arrival to last byte (0: none)
    stall_timeout_s: float = 30.0          # longest blocked write to a client (0: none)
    max_prompt_tokens: int | None = None   # None: the model's context
    max_tokens_limit: int | None = None    # None: the rest of the context
    body_timeout_s: float = 30.0           # headers in -> whole body read (0: only the request deadline)

    @classmethod
    def from_config(cls, c: FrontendConfig) -> "RequestLimits":
        return cls(c.queue_timeout_s, c.request_timeout_s, c.stall_timeout_s, c.max_prompt_tokens,
                   c.max_tokens_limit, c.body_timeout_s)

    def deadline_s(self, loop: asyncio.AbstractEventLoop) -> float | None:
        """The request's deadline on the loop's clock, from now (its arrival)."""
        return loop.time() + self.request_timeout_s if self.request_timeout_s > 0 else None

    def body_deadline_s(self, loop: asyncio.AbstractEventLoop, deadline_s: float | None) -> float | None:
        """When the body must have arrived, from now (headers in): body_timeout_s or the request's
        deadline, whichever comes first; None: no limit."""
        if self.body_timeout_s <= 0:
            return deadline_s
        body = loop.time() + self.body_timeout_s
        return body if deadline_s is None else min(body, deadline_s)

    def queue_wait_s(self, loop: asyncio.AbstractEventLoop, deadline_s: float | None) -> float:
        """How long the request may wait for a slot: the queue timeout, or less near its deadline."""
        if deadline_s is None:
            return self.queue_timeout_s
        return max(0.0, min(self.queue_timeout_s, deadline_s - loop.time()))


# Kernel send buffer of a streaming connection (Linux doubles it). Token streams need little;
# a client that stops reading fills it quickly, so the stall watch sees the stall.
STREAM_SEND_BUFFER_BYTES = 64 << 10


def limit_send_buffer(transport: asyncio.BaseTransport | None) -> None:
    """Cap the kernel's send buffer for this connection (no-op where there is no socket)."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SEND_BUFFER_BYTES)
        except OSError:
            pass


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def has_lone_surrogate(raw: bytes, obj: Any) -> bool:
    """True when a string in the parsed body holds an unpaired UTF-16 surrogate ("\\ud800").

    JSON allows them, UTF-8 cannot carry them: the tokenizer and our replies would fail on
    them. Only bodies with such an escape are walked, iteratively (any nesting depth).
    """
    if not _SURROGATE_ESCAPE.search(raw):
        return False
    stack = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


class StallWatch:
    """Notices a write to the client that has not completed for `timeout_s`.

    The stream marks each write (`begin` / `end`, two attribute stores on the hot
    path); a timer every timeout_s / 2 checks the one in progress, so a stall is
    caught between 1 and 1.5 timeouts after it began.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float, on_stall: Callable[[], None]):
        self.loop, self.timeout_s, self.on_stall = loop, timeout_s, on_stall
        self.write_started_s: float | None = None
        self.stalled = False
        self._timer = loop.call_later(timeout_s / 2, self._check)

    def begin(self) -> None:
        self.write_started_s = self.loop.time()

    def end(self) -> None:
        self.write_started_s = None

    def _check(self) -> None:
        started = self.write_started_s
        if started is not None and self.loop.time() - started >= self.timeout_s:
            self.stalled = True
            self.on_stall()
            return
        self._timer = self.loop.call_later(self.timeout_s / 2, self._check)

    def close(self) -> None:
        self._timer.cancel()
