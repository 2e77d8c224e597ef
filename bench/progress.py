"""A one-line progress bar on stderr: redrawn in place on a terminal, a line every few seconds otherwise."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total: int | None, stream=None, width: int = 24, every_s: float = 5.0):
        self.label, self.total, self.width, self.every_s = label, total, width, every_s
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = self.failed = 0
        self.t0 = time.monotonic()
        self._last_draw = 0.0

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        self.draw()

    def line(self) -> str:
        elapsed = time.monotonic() - self.t0
        if self.total:
            frac = min(1.0, self.done / self.total)
            fill = int(frac * self.width)
            bar = "#" * fill + "." * (self.width - fill)
            count = f"{self.done}/{self.total}"
        else:
            bar, count = "", str(self.done)
        return f"{self.label} [{bar}] {count} req, {self.failed} failed, {elapsed:5.1f} s"

    def draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            if force or now - self._last_draw > 0.1:
                self.stream.write("\r\x1b[K" + self.line())
                self.stream.flush()
                self._last_draw = now
        elif force or now - self._last_draw >= self.every_s:
            self.stream.write(self.line() + "\n")
            self.stream.flush()
            self._last_draw = now

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + self.line() + "\n")
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()
