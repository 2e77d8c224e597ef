"""The server `blink run-batch` starts when it is given no --url: `blink serve` itself, as a child.

    ServeChild(serve_args) -> start(): `blink serve --port <free> --ring blink-batch-<pid>
        --log-level error ...` in its own session (dying with us), stdout to /dev/null
        -> wait until GET /health is 200 (serve's own probe) -> url
    ... the batch runs against url ...
    stop(): SIGTERM -> blink serve stops the frontend, then the daemon, and removes the
        ring (serve.py) -> SIGKILL to the session after STOP_GRACE_S

Everything a server needs (model preparation, supervision and restarts, clean stops) is
serve.py's; this module only picks the port and the ring and waits.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time

from ..config import API_KEY_ENV
from ..serve import _die_with_parent, _healthy, blink_command

STOP_GRACE_S = 30.0


class ServeError(RuntimeError):
    """blink serve exited or did not become healthy."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeChild:
    def __init__(self, serve_args: list[str], ready_timeout_s: float = 600.0, api_key: str | None = None):
        self.port = free_port()
        self.ring = f"blink-batch-{os.getpid()}"
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [*blink_command(), "serve", "--host", "127.0.0.1", "--port", str(self.port),
                     "--ring", self.ring, "--log-level", "error", *serve_args]
        self.ready_timeout_s = ready_timeout_s
        self.env = {**os.environ, API_KEY_ENV: api_key} if api_key else None
        self.proc: subprocess.Popen | None = None

    def start(self) -> str:
        """Start blink serve and wait until it is healthy; its URL."""
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=_die_with_parent, env=self.env)
        deadline = time.monotonic() + self.ready_timeout_s
        while not _healthy("127.0.0.1", self.port):
            rc = self.proc.poll()
            if rc is not None:
                raise ServeError(f"blink serve exited with code {rc} before it was ready")
            if time.monotonic() > deadline:
                raise ServeError(f"blink serve not healthy after {self.ready_timeout_s:g} s")
            time.sleep(0.25)
        return self.url

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def __enter__(self) -> "ServeChild":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
