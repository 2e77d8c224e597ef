"""Stop a process on SIGTERM / SIGINT without taking a lock inside a signal handler.

    stop_on_signals(stop) -> restore: each handler only writes a byte to a self-pipe (os.write, no
    Python lock); a daemon thread reads the pipe and sets the threading.Event `stop` from ordinary
    thread context; restore() puts the previous handlers back and ends the thread.

Why: `signal.signal(sig, lambda *_: stop.set())` hangs when a second signal arrives while the first
handler is inside Event.set(): Python runs handlers on the main thread between bytecodes, Event.set
holds its Condition's non-reentrant lock, and the nested handler's set() waits for that lock forever.
Two quick SIGTERMs (a script's pkill, then its kill of the same pid; Ctrl-C twice) left `blink serve`
and `blink gpu-daemon` blocked in Condition.__enter__ with both children still serving (py-spy dump,
2026-11-26). Used by both (dpu_frontend/serve.py, gpu_backend/daemon.py); the frontend's asyncio loop
takes its signals with loop.add_signal_handler, which runs the callback in the loop instead.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Callable, Iterable

_WAKE, _END = b"\0", b"\1"


def stop_on_signals(stop: threading.Event,
                    signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGINT)) -> Callable[[], None]:
    """Install the handlers (main thread only, as signal.signal requires); returns restore()."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    live = [True]                                # False once restore() closes the pipe

    def handler(signum, frame) -> None:          # async-signal context: one write, nothing else
        if live[0]:
            with contextlib.suppress(OSError):   # a full pipe already holds a wake-up
                os.write(w, _WAKE)

    def watch() -> None:
        while True:
            data = os.read(r, 64)
            if _END in data or not data:
                return
            stop.set()

    previous = {s: signal.signal(s, handler) for s in signals}
    watcher = threading.Thread(target=watch, name="stop-signals", daemon=True)
    watcher.start()

    def restore() -> None:
        for s, old in previous.items():
            signal.signal(s, old)
        os.set_blocking(w, True)
        os.write(w, _END)
        watcher.join(5)
        live[0] = False
        os.close(w)
        os.close(r)

    return restore
