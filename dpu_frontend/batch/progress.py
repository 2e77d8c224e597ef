"""The batch's progress on stderr: tqdm's bar when tqdm is installed (it is not a frontend
dependency), else one line redrawn in place on a terminal, or printed every few seconds otherwise.

    runner -> progress(total) -> .update(ok) per finished request -> .close()
"""
from __future__ import annotations

import sys
import time


class _Line:
    def __init__(self, total: int, stream=None, every_s: float = 5.0):
        self.total, self.every_s = total, every_s
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = self.failed = 0
        self.t0 = time.monotonic()
        self._last = 0.0

    def _text(self) -> str:
        elapsed = time.monotonic() - self.t0
        return f"Running batch: {self.done}/{self.total} requests, {self.failed} failed, {elapsed:.0f} s"

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = time.monotonic()
        if self.tty and now - self._last > 0.1:
            self.stream.write("\r\x1b[K" + self._text())
        elif not self.tty and now - self._last >= self.every_s:
            self.stream.write(self._text() + "\n")
        else:
            return
        self.stream.flush()
        self._last = now

    def close(self) -> None:
        self.stream.write(("\r\x1b[K" if self.tty else "") + self._text() + "\n")
        self.stream.flush()


class _Tqdm:
    def __init__(self, total: int):
        import tqdm
        self.failed = 0
        self.bar = tqdm.tqdm(total=total, unit="req", desc="Running batch", file=sys.stderr, mininterval=1.0)

    def update(self, ok: bool) -> None:
        if not ok:
            self.failed += 1
            self.bar.set_postfix(failed=self.failed, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def progress(total: int, enabled: bool = True):
    """A progress display for `total` requests (enabled=False: the plain line, to a null stream)."""
    if not enabled:
        import io
        return _Line(total, stream=io.StringIO())
    try:
        return _Tqdm(total)
    except ImportError:
        return _Line(total)
