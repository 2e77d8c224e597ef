"""Helpers for the frontend tests: the real SmolLM2 tokenizer, and `blink serve` as a real process."""
from __future__ import annotations

import functools
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from dpu_frontend.tokenizer import ModelTokenizer, load_tokenizer
from shared_layout.layout import HEADER, HEADER_DTYPE

REPO = pathlib.Path(__file__).resolve().parents[2]


@functools.cache
def smollm2() -> ModelTokenizer:
    """The embedded default model's tokenizer (loaded once per test process)."""
    return load_tokenizer("default")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def blink() -> list[str]:
    script = pathlib.Path(sys.executable).parent / "blink"
    return [str(script)] if script.exists() else [sys.executable, "-m", "dpu_frontend.cli"]


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)
    except (urllib.error.URLError, ConnectionError):
        return 0, b"", {}   # nobody listening (yet)


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample in a Prometheus text page."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    key = f"{name}{{{want}}}" if want else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(key)


class Serve:
    """`blink serve ...` on a free port and a private ring; stop() sends SIGTERM and returns the exit code."""

    def __init__(self, ring_name: str, *args: str, ready_timeout_s: float = 60.0):
        self.port = free_port()
        self.ring = ring_name
        self.base = f"http://127.0.0.1:{self.port}"
        self.argv = [*blink(), "serve", "--port", str(self.port), "--ring", ring_name, *args]
        self.proc = subprocess.Popen(self.argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"blink serve exited early ({self.proc.wait()}):\n{''.join(self.lines)}")
            self.lines.append(line)
            if "blink serve: ready:" in line:
                break
        else:
            self.stop()
            raise RuntimeError(f"blink serve not ready after {ready_timeout_s} s:\n{''.join(self.lines)}")
        self._drain = __import__("threading").Thread(target=self._read_rest, daemon=True)
        self._drain.start()

    def _read_rest(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def backend_pid(self) -> int:
        with open(f"/dev/shm/{self.ring}", "rb") as f:
            import numpy as np
            header = np.frombuffer(f.read(HEADER.size), HEADER_DTYPE, 1)[0]
        return int(header["backend_pid"])

    def metrics(self) -> str:
        status, body, _ = http_get(self.base + "/metrics")
        assert status == 200
        return body.decode()

    def __enter__(self) -> "Serve":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()   # never leave a server behind a failed assertion

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        if hasattr(self, "_drain"):
            self._drain.join(5)
        return rc


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
