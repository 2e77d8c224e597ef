"""Real processes for the reliability tests: `blink gpu-daemon` and `blink frontend` started
separately (so each can be killed on its own), `blink serve` supervising both, plain HTTP
helpers, and waiting."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from bench.reliability import free_port, http_get, parse_metrics

REPO = pathlib.Path(__file__).resolve().parents[2]
SMALL_RING = ["--slots", "32", "--prompt-arena-tokens", "65536", "--output-arena-tokens", "262144"]


def blink() -> list[str]:
    script = pathlib.Path(sys.executable).parent / "blink"
    return [str(script)] if script.exists() else [sys.executable, "-m", "dpu_frontend.cli"]


def wait_for(pred, timeout_s: float, what: str, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def post(base: str, path: str, body, headers: dict | None = None, timeout_s: float = 30.0
         ) -> tuple[int, dict | str, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw, status, hdrs = r.read(), r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        raw, status, hdrs = e.read(), e.code, dict(e.headers)
    try:
        return status, json.loads(raw), hdrs
    except ValueError:
        return status, raw.decode(errors="replace"), hdrs


class Proc:
    """A child process whose output goes to a file (read it with .log())."""

    def __init__(self, argv: list[str], log_path: pathlib.Path, env: dict | None = None):
        self.log_path = log_path
        self._f = open(log_path, "w")
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self._f, stderr=subprocess.STDOUT, env=env)
        self.pid = self.proc.pid

    def log(self) -> str:
        self._f.flush()
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill9(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._f.close()
        return rc


def start_daemon(ring: str, tmp: pathlib.Path, *extra: str, name: str = "daemon") -> Proc:
    return Proc([*blink(), "gpu-daemon", "--ring", ring, "--model", "null", *SMALL_RING, *extra],
                tmp / f"{name}.log")


class Endpoint(Proc):
    """A process serving the OpenAI API at `self.base`."""
    base: str

    def healthy(self) -> bool:
        return http_get(self.base + "/health", 2)[0] == 200

    def metrics(self) -> dict[str, float]:
        status, body = http_get(self.base + "/metrics")
        assert status == 200, status
        return parse_metrics(body.decode())

    def settled(self) -> bool:
        """Nothing held, queued or in flight; every slot EMPTY; both arenas free."""
        m = self.metrics()
        slots = {k: v for k, v in m.items() if k.startswith("blink_slots{")}
        return (sum(slots.values()) == slots.get('blink_slots{state="EMPTY"}', -1)
                and m.get("blink_held_slots") == 0 and m.get("blink_requests_inflight") == 0
                and m.get("blink_queue_depth") == 0
                and m.get("blink_prompt_arena_free_tokens") == 65536
                and m.get("blink_output_arena_free_tokens") == 262144)


class Frontend(Endpoint):
    def __init__(self, ring: str, tmp: pathlib.Path, *extra: str, name: str = "frontend", env: dict | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        super().__init__([*blink(), "frontend", "--ring", ring, "--model", "null", "--port", str(self.port),
                          "--startup-timeout-s", "0", *extra], tmp / f"{name}.log", env)
        wait_for(lambda: http_get(self.base + "/v1/models", 2)[0] in (200, 401) or not self.alive(), 60,
                 "the frontend to listen")
        assert self.alive(), self.log()


class Serve(Endpoint):
    """`blink serve --model null` on a small ring; its children found through /proc."""

    def __init__(self, ring: str, tmp: pathlib.Path, *extra: str, name: str = "serve"):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        super().__init__([*blink(), "serve", "--ring", ring, "--model", "null", "--port", str(self.port),
                          *SMALL_RING, *extra], tmp / f"{name}.log")
        wait_for(lambda: "blink serve: ready:" in self.log() or not self.alive(), 60, "blink serve to be ready")
        assert self.alive(), self.log()

    def child(self, name: str) -> int:
        """The pid of the live child `name` (gpu-daemon | frontend), 0 while there is none."""
        kids = []
        for tid in os.listdir(f"/proc/{self.pid}/task"):
            with open(f"/proc/{self.pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
        for pid in kids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                continue
            if name.encode() in argv[:4] and state != "Z":
                return pid
        return 0


def sse_events(text: str) -> list[str]:
    return [e[6:] for e in text.split("\n\n") if e.startswith("data: ")]
