"""The listening socket and its connections: aiohttp's server plus a header deadline,
on the event loop `--loop` picks.

    run(serve(...), loop="auto") -> asyncio.Runner on uvloop when it imports (auto,
        uvloop) or asyncio's own loop (asyncio, or auto without uvloop); the loop
        thread's sleeps made fine first (shared_layout.timers.fine_timer_slack)
    serve(app, config) -> web.AppRunner(app).setup()
        -> loop.create_server(each connection: HeaderDeadline -> aiohttp's RequestHandler)
        SIGINT / SIGTERM -> stop listening -> runner.cleanup() (in-flight requests get
            shutdown_timeout_s, then the app's cleanup: the ring client detaches)

Slow-header (slowloris) protection. aiohttp's parser waits for a request's headers
as long as bytes keep coming; only its keep-alive timer (keepalive_timeout, 75 s)
ends a connection stuck on partial headers. HeaderDeadline gives each request
`header_timeout_s` to get its headers to the app: counted from the connection's
start for its first request, from the first byte of each later one. The app's
outermost middleware (`header_deadline_middleware`) tells it when a request
arrived and when its handler finished. Past the deadline the connection is dropped
without a reply (there is no request to answer yet). Nothing here is timed while a
handler runs: the body has its own deadline (body_timeout_s: completions.read_json
-> 408) and a client that stops reading has the stall watch (limits.py). An idle
keep-alive connection that sends nothing is left to aiohttp's keepalive_timeout.

HeaderDeadline is a plain asyncio.Protocol in front of aiohttp's own per-connection
protocol: it forwards every transport event unchanged and adds one timer per request
(none per chunk), so aiohttp's parser and flow control are untouched.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
from typing import Any, Callable, Coroutine, TypeVar

from aiohttp import web

from shared_layout.timers import fine_timer_slack

log = logging.getLogger(__name__)
T = TypeVar("T")

LOOP_CHOICES = ("auto", "asyncio", "uvloop")
KEEPALIVE_TIMEOUT_S = 75.0   # aiohttp's run_app default: idle keep-alive connections
SHUTDOWN_TIMEOUT_S = 60.0    # on stop, in-flight handlers get this long (run_app's default)


def loop_factory(kind: str = "auto") -> tuple[str, Callable[[], asyncio.AbstractEventLoop]]:
    """(the loop that will run, a factory for it) for `--loop`: auto = uvloop when it imports,
    else asyncio's. ValueError for an unknown kind, or uvloop asked for and not installed."""
    if kind not in LOOP_CHOICES:
        raise ValueError(f"--loop must be one of {', '.join(LOOP_CHOICES)}, not {kind!r}")
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise ValueError("--loop uvloop: uvloop is not installed (pip install uvloop)") from None
        else:
            return "uvloop", uvloop.new_event_loop
    return "asyncio", asyncio.new_event_loop


def run(coro: Coroutine[Any, Any, T], loop: str = "auto") -> T:
    """asyncio.run(coro) on the loop `loop_factory(loop)` makes."""
    _, factory = loop_factory(loop)
    fine_timer_slack()
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


class HeaderDeadline(asyncio.Protocol):
    """One connection: aiohttp's protocol behind a deadline on each request's headers."""

    def __init__(self, inner: asyncio.Protocol, timeout_s: float, loop: asyncio.AbstractEventLoop):
        self.inner = inner
        self.timeout_s = timeout_s
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.timed_out = False
        self._timer: asyncio.TimerHandle | None = None
        self._active = 0   # requests whose handler is running on this connection

    # -- transport events, forwarded ---------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.inner.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._timer is None and not self._active:
            self._arm()   # the first bytes of the next request (or the tail of an unread body)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.transport = None
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # -- from the middleware -------------------------------------------------------
    def request_started(self) -> None:
        self._active += 1
        self._disarm()

    def request_ended(self) -> None:
        self._active -= 1

    # -- the timer -------------------------------------------------------------------
    def _arm(self) -> None:
        if self.timeout_s > 0 and self.transport is not None:
            self._timer = self.loop.call_later(self.timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self._active or self.transport is None:
            return
        self.timed_out = True
        log.debug("closing %s: no complete request headers within %g s",
                  self.transport.get_extra_info("peername"), self.timeout_s)
        self.transport.abort()


def header_deadline_factory(server: Callable[[], asyncio.Protocol], timeout_s: float
                            ) -> Callable[[], asyncio.Protocol]:
    """The protocol factory for loop.create_server: aiohttp's (`runner.server`), wrapped."""
    loop = asyncio.get_running_loop()
    if timeout_s <= 0:
        return server
    return lambda: HeaderDeadline(server(), timeout_s, loop)


@web.middleware
async def header_deadline_middleware(request: web.Request, handler):
    """Tells the connection's HeaderDeadline (if any) that a request's headers arrived and
    when its handler is done. Outermost, so every request the app sees counts."""
    transport = request.transport
    guard = transport.get_protocol() if transport is not None else None
    if not isinstance(guard, HeaderDeadline):
        return await handler(request)   # test clients, other servers: nothing to tell
    guard.request_started()
    try:
        return await handler(request)
    finally:
        guard.request_ended()


async def serve(app: web.Application, host: str, port: int, *, header_timeout_s: float,
                access_log: logging.Logger | None, on_ready: Callable[[], None] | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Serve `app` on host:port until SIGINT / SIGTERM (or `stop` is set); raises OSError
    when the address cannot be bound."""
    loop = asyncio.get_running_loop()
    runner = web.AppRunner(app, handler_cancellation=True, access_log=access_log,
                           keepalive_timeout=KEEPALIVE_TIMEOUT_S, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    stop = stop or asyncio.Event()
    listener = None
    signals = []
    try:
        listener = await loop.create_server(header_deadline_factory(runner.server, header_timeout_s),
                                            host, port, reuse_address=True, backlog=128)
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
                signals.append(sig)
            except (NotImplementedError, RuntimeError):   # not the main thread / no signals here
                pass
        # What start-up made (tokenizer, templates, pydantic models, the app) lives as long as the
        # server: frozen out of the cyclic collector's sight, requests' garbage no longer makes it
        # walk them (as the daemon's engine does, and vLLM's server).
        gc.collect()
        gc.freeze()
        if on_ready is not None:
            on_ready()
        await stop.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        if listener is not None:
            listener.close()   # stop accepting; runner.cleanup() ends the connections
        await runner.cleanup()
