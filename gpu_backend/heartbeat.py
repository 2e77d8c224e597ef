"""Heartbeat: a thread that beats the ring header while the daemon lives and
watches for the stop requests that do not come as signals.

    every interval_s: backend_heartbeat += 1, backend_heartbeat_ns = now
                      header `shutdown` set -> stop event set
                      stop event set while READY -> backend_status = STOPPING

A thread rather than beats from the engine loop, so a long step (a 2048-token
prefill on the CPU) never makes the frontend's /health report the backend dead.
"""
from __future__ import annotations

import threading

from shared_layout import BackendPort, BackendStatus, Ring


class Heartbeat:
    def __init__(self, ring: Ring, stop: threading.Event, interval_s: float = 0.05):
        self.ring, self.stop, self.interval_s = ring, stop, interval_s
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="blink-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def halt(self) -> None:
        self._halt.set()
        self._thread.join()

    def _run(self) -> None:
        port = BackendPort(self.ring)
        while not self._halt.wait(self.interval_s):
            port.beat()
            if self.ring.get("shutdown"):
                self.stop.set()
            if self.stop.is_set() and self.ring.get("backend_status") == BackendStatus.READY:
                self.ring.set("backend_status", BackendStatus.STOPPING)
