"""`blink serve` as a supervisor: clean stops on SIGTERM / Ctrl-C; a child that dies after the first
ready is restarted (backoff) while the other keeps running, counted on /metrics; one line and exit 1
when a child dies before it or too often."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from dpu_frontend.serve import RestartPolicy, _Children
from frontend_procs import REPO, Serve, blink, free_port, http_get, metric, pid_alive

pytestmark = pytest.mark.timeout(120)


def children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_stop_signal_stops_both_children_cleanly(ring_name, sig):
    with Serve(ring_name, "--model", "null") as s:
        kids = children(s.proc.pid)
        names = sorted(cmdline(k).split("/blink ", 1)[-1].split()[0] for k in kids)
        assert names == ["frontend", "gpu-daemon"]   # each child under its own name
        assert all("/blink " in cmdline(k) for k in kids)
        assert s.stop(sig) == 0, s.output
    assert not any(pid_alive(k) for k in kids)
    assert not os.path.exists(f"/dev/shm/{ring_name}")
    assert "Traceback" not in s.output


def test_a_burst_of_stop_signals_still_stops_cleanly(ring_name):
    """Two SIGTERMs and a Ctrl-C back to back (a script's pkill, then its kill; an impatient user) to the
    supervisor and the daemon: both stop, nothing hangs. (A signal landing inside the first handler's
    Event.set once hung both; that window is microseconds wide, so tests/shared_layout/test_stop_signals.py
    holds the Event's lock to hit it every time.)"""
    with Serve(ring_name, "--model", "null") as s:
        kids = children(s.proc.pid)
        daemon = next(k for k in kids if "gpu-daemon" in cmdline(k))
        for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT):
            os.kill(daemon, sig)               # the daemon's own handlers too (the supervisor restarts it)
            s.proc.send_signal(sig)
        assert s.stop(signal.SIGTERM, timeout_s=20) == 0, s.output
    assert not any(pid_alive(k) for k in kids)
    assert "Traceback" not in s.output


def wait_for(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def complete(s: Serve) -> int:
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}).encode()
    req = urllib.request.Request(s.base + "/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())["usage"]["completion_tokens"]
    except OSError as e:
        raise AssertionError(f"{e!r}; metrics:\n{s.metrics()}\nlog:\n{s.output}") from None


def serve_lines(s: Serve) -> list[str]:
    return [line for line in s.output.splitlines() if line.startswith("blink serve:") and "ready" not in line]


def test_daemon_killed_is_restarted_and_the_frontend_keeps_running(ring_name):
    with Serve(ring_name, "--model", "null", "--restart-backoff-s", "2", "--heartbeat-timeout-s", "0.5") as s:
        daemon = s.backend_pid()
        frontend = [k for k in children(s.proc.pid) if k != daemon][0]
        os.kill(daemon, signal.SIGKILL)
        status, body, headers = wait_for(lambda: (r := http_get(s.base + "/health"))[0] == 503 and r, 10, "503")
        assert b"blink serve is restarting the gpu-daemon (restart 1)" in body and "Retry-After" in headers
        wait_for(lambda: s.backend_pid() not in (0, daemon) and http_get(s.base + "/health")[0] == 200, 30,
                 "a restarted daemon")
        assert complete(s) == 3
        assert frontend in children(s.proc.pid) and s.proc.poll() is None   # the same frontend process
        text = s.metrics()
        assert metric(text, "blink_daemon_restarts_total") == 1 and metric(text, "blink_frontend_restarts_total") == 0
        assert metric(text, "blink_backend_epoch") == 2
        assert metric(text, "blink_seconds_since_last_restart", process="gpu-daemon") < \
            metric(text, "blink_seconds_since_last_restart", process="frontend")
        assert s.stop() == 0, s.output
    lines = serve_lines(s)
    assert lines[0] == "blink serve: gpu-daemon was killed by SIGKILL; restarting it in 2 s, the frontend keeps running"
    assert lines[1].startswith("blink serve: gpu-daemon restarted (pid ") and lines[1].endswith(", restart 1)")


def test_frontend_killed_is_restarted_on_the_same_port_and_the_daemon_keeps_running(ring_name):
    with Serve(ring_name, "--model", "null") as s:
        daemon = s.backend_pid()
        frontend = [k for k in children(s.proc.pid) if k != daemon][0]
        os.kill(frontend, signal.SIGKILL)
        wait_for(lambda: http_get(s.base + "/health")[0] == 200 and frontend not in children(s.proc.pid), 30,
                 "a restarted frontend")
        assert complete(s) == 3
        assert s.backend_pid() == daemon and pid_alive(daemon)
        text = s.metrics()
        assert metric(text, "blink_frontend_restarts_total") == 1 and metric(text, "blink_daemon_restarts_total") == 0
        assert metric(text, "blink_backend_epoch") == 1
        assert s.stop() == 0, s.output
    assert "blink serve: frontend was killed by SIGKILL; restarting it in 0.5 s, the gpu-daemon keeps running" \
        in serve_lines(s)


def test_too_many_deaths_give_up_with_one_line(ring_name):
    with Serve(ring_name, "--model", "null", "--max-restarts", "1", "--restart-backoff-s", "0.1") as s:
        first = s.backend_pid()
        os.kill(first, signal.SIGKILL)
        second = wait_for(lambda: s.backend_pid() not in (0, first) and s.backend_pid(), 30, "a restarted daemon")
        os.kill(second, signal.SIGKILL)
        rc = s.proc.wait(30)
        s._drain.join(5)
    assert rc == 1
    assert serve_lines(s)[-1] == ("blink serve: gpu-daemon was killed by SIGKILL; it died 2 times within 600 s "
                                  "(--max-restarts 1), giving up; stopped the frontend")
    assert not os.path.exists(f"/dev/shm/{ring_name}")


def _quick_exit() -> list[str]:
    return [sys.executable, "-c", "pass"]


def test_backoff_doubles_to_its_ceiling_and_resets_after_a_healthy_minute():
    kids = _Children(RestartPolicy(backoff_initial_s=0.5, backoff_max_s=2.0, max_restarts=100))
    kids.start("x", _quick_exit())
    child = kids.procs[0]
    delays, now = [], time.monotonic()
    for _ in range(5):
        child.proc.wait()
        _, rc, give_up = kids.reap(now)
        assert rc == 0 and not give_up
        delays.append(child.due_s - now)
        assert kids.restart_due(now + delays[-1] - 0.01) == []          # not before its backoff
        assert kids.restart_due(now + delays[-1]) == [child]
        now += delays[-1]
    assert delays == [0.5, 1.0, 2.0, 2.0, 2.0] and child.restarts == 5
    child.proc.wait()
    child.started_s = now - 61.0                                         # it lived over a minute
    kids.reap(now)
    assert child.due_s - now == 0.5


def test_restart_limit_counts_only_deaths_within_the_window():
    kids = _Children(RestartPolicy(backoff_initial_s=0.0, max_restarts=2, window_s=10.0))
    kids.start("x", _quick_exit())
    child = kids.procs[0]
    for t in (0.0, 1.0, 12.0, 13.0):   # the first two fall out of the window by t = 12
        child.proc.wait()
        assert kids.reap(t)[2] is False
        kids.restart_due(t)
    child.proc.wait()
    assert kids.reap(14.0)[2] is True
    kids.stop()


def test_port_in_use_is_reported(ring_name):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = subprocess.run([*blink(), "serve", "--model", "null", "--ring", ring_name, "--port", str(port)],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert "blink serve: frontend exited with code 1; stopped the gpu-daemon" in p.stderr
    assert "cannot listen on 127.0.0.1:" in p.stderr and "Traceback" not in p.stderr + p.stdout


def test_bad_arguments_fail_fast(ring_name):
    p = subprocess.run([*blink(), "serve", "--model", "null", "--ring", "bad/name", "--port", str(free_port())],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "invalid ring name" in p.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_first_start_prepares_the_default_model(ring_name, tmp_path, monkeypatch):
    """The README's command on a machine where the cache is empty: convert once, then serve."""
    monkeypatch.setenv("BLINK_CACHE_DIR", str(tmp_path))
    with Serve(ring_name, ready_timeout_s=540) as s:
        assert f"preparing the default model in {tmp_path}" in s.output
        folder = tmp_path / "models" / "SmolLM2-135M-Instruct"
        assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
        assert "model SmolLM2-135M-Instruct, executor cpu" in s.output
        assert s.stop() == 0, s.output
