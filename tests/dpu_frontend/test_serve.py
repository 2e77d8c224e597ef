"""`blink serve` as a supervisor: clean stops on SIGTERM / Ctrl-C, one line and exit 1 when a child dies."""
from __future__ import annotations

import os
import signal
import socket
import subprocess

import pytest

from frontend_procs import REPO, Serve, blink, free_port, pid_alive

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


def test_daemon_death_stops_frontend_and_says_so(ring_name):
    with Serve(ring_name, "--model", "null") as s:
        daemon = s.backend_pid()
        frontend = [k for k in children(s.proc.pid) if k != daemon][0]
        os.kill(daemon, signal.SIGKILL)
        rc = s.proc.wait(30)
    assert rc == 1
    lines = [line for line in s.output.splitlines() if line.startswith("blink serve:") and "ready" not in line]
    assert lines == ["blink serve: gpu-daemon was killed by SIGKILL; stopped the frontend"]
    assert not pid_alive(frontend)


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
