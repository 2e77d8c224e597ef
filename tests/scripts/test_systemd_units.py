"""The systemd units, their installer and uninstaller (in a throwaway root), and the start check.

`systemd-analyze verify` (Debian's systemd package) must be present under CI=true; elsewhere
its absence skips the verify tests with the reason.
"""
from __future__ import annotations

import http.server
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shared_layout import BackendPort, BackendStatus, Ring, RingGeometry
from shared_layout.shm import ShmRegion

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
VENV = Path(sys.prefix)                 # the environment running the tests has `blink` installed
UNITS = ("blink-gpu-daemon", "blink-dpu-frontend")
WAIT_READY = SCRIPTS / "systemd" / "blink-wait-ready"


def _analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("systemd-analyze missing on CI: apt-get install -y systemd")
        pytest.skip("systemd-analyze not installed (Debian: apt-get install systemd)")
    return path


def _install(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPTS / "install_services.sh"), "--root", str(root), "--venv", str(VENV), *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    if shutil.which("systemd-sysusers") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("systemd-sysusers missing on CI: apt-get install -y systemd")
        pytest.skip("systemd-sysusers not installed (Debian: apt-get install systemd)")
    root = tmp_path_factory.mktemp("root")
    out = _install(root, "--role", "both")
    assert out.returncode == 0, out.stderr
    return root


def _verify(*unit_files: Path) -> subprocess.CompletedProcess:
    return subprocess.run([_analyze(), "verify", *map(str, unit_files)], capture_output=True, text=True,
                          timeout=120)


def test_units_pass_systemd_analyze_verify_without_a_warning(installed):
    files = [installed / f"etc/systemd/system/{u}.service" for u in UNITS]
    out = _verify(*files)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == "" and out.stdout.strip() == "", out.stderr + out.stdout


def test_verify_would_catch_a_broken_unit(installed, tmp_path):
    text = (installed / "etc/systemd/system/blink-gpu-daemon.service").read_text()
    bad = tmp_path / "blink-gpu-daemon.service"
    bad.write_text(text.replace("LimitMEMLOCK=", "LimitMEMLOKC=").replace(str(VENV), "/nonexistent"))
    out = _verify(bad)
    assert "LimitMEMLOKC" in out.stderr and out.returncode != 0


def test_installed_files_modes_and_paths(installed):
    for u in UNITS:
        unit = installed / f"etc/systemd/system/{u}.service"
        text = unit.read_text()
        assert "@VENV@" not in text and "@LIBEXEC@" not in text
        assert f"ExecStart={VENV}/bin/blink " in text
        assert stat.S_IMODE(unit.stat().st_mode) == 0o644
        env = installed / f"etc/blink/{u.removeprefix('blink-')}.env"
        assert stat.S_IMODE(env.stat().st_mode) == 0o640
        assert f"EnvironmentFile=/etc/blink/{env.name}" in text
    wait = installed / "usr/local/lib/blink/blink-wait-ready"
    assert stat.S_IMODE(wait.stat().st_mode) == 0o755
    assert (installed / "usr/local/share/doc/blink/deployment.md").read_text() == \
        (REPO / "docs/deployment.md").read_text()
    passwd = (installed / "etc/passwd").read_text()
    assert re.search(r"^blink:x:\d+:\d+:[^:]*:/var/lib/blink:/usr/sbin/nologin$", passwd, re.M)


@pytest.mark.parametrize("unit", UNITS)
def test_every_variable_the_unit_uses_is_set_in_its_env_file(unit):
    text = (SCRIPTS / "systemd" / f"{unit}.service").read_text()
    env = (SCRIPTS / "systemd" / f"{unit.removeprefix('blink-')}.env").read_text()
    defined = {line.split("=", 1)[0] for line in env.splitlines() if line and not line.startswith("#")}
    used = set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", text))
    assert used and used <= defined, used - defined


@pytest.mark.parametrize("unit", UNITS)
def test_units_keep_the_devices_reachable_and_run_unprivileged(unit):
    text = (SCRIPTS / "systemd" / f"{unit}.service").read_text()
    assert "PrivateDevices=yes" not in text
    assert "DeviceAllow=char-infiniband_verbs rw" in text
    assert "User=blink" in text and "Restart=on-failure" in text and "LimitMEMLOCK=infinity" in text
    if unit == "blink-gpu-daemon":
        assert "DeviceAllow=char-nvidia-frontend rw" in text and "DeviceAllow=char-nvidia-uvm rw" in text


def _settings(unit: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in (SCRIPTS / "systemd" / f"{unit}.service").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


def test_the_frontend_unit_survives_a_daemon_restart_and_each_restarts_after_a_delay():
    """systemd stops or restarts a unit with another only through Requires/Requisite/BindsTo/PartOf;
    the frontend names the daemon in After= alone (ordering), so a daemon restart leaves it running."""
    front, daemon = _settings("blink-dpu-frontend"), _settings("blink-gpu-daemon")
    for key in ("Requires", "Requisite", "BindsTo", "PartOf"):
        assert not any("blink-gpu-daemon" in v for v in front.get(key, [])), key
    assert "blink-gpu-daemon.service" in front["After"][0].split()
    for unit in (front, daemon):
        assert unit["Restart"] == ["on-failure"]                     # kill -9, OOM kill, exit 1: restarted
        assert 0 < float(unit["RestartSec"][0]) <= 2                  # back within seconds, not in a loop
        assert int(unit["StartLimitBurst"][0]) >= 3 and int(unit["StartLimitIntervalSec"][0]) >= 60


def test_reinstall_keeps_the_administrators_settings(installed):
    env = installed / "etc/blink/dpu-frontend.env"
    env.write_text(env.read_text().replace("BLINK_PORT=8000", "BLINK_PORT=9999"))
    out = _install(installed, "--role", "dpu")
    assert out.returncode == 0, out.stderr
    assert "keeping existing /etc/blink/dpu-frontend.env" in out.stdout
    assert "BLINK_PORT=9999" in env.read_text()
    users = [line for line in (installed / "etc/passwd").read_text().splitlines() if line.startswith("blink:")]
    assert len(users) == 1   # the user is not duplicated


def test_one_role_installs_one_unit(tmp_path):
    if shutil.which("systemd-sysusers") is None:
        pytest.skip("systemd-sysusers not installed")
    assert _install(tmp_path, "--role", "dpu").returncode == 0
    assert (tmp_path / "etc/systemd/system/blink-dpu-frontend.service").exists()
    assert not (tmp_path / "etc/systemd/system/blink-gpu-daemon.service").exists()
    assert not (tmp_path / "etc/blink/gpu-daemon.env").exists()


@pytest.mark.parametrize("args, message", [
    ((), "--role gpu|dpu|both is required"),
    (("--role", "gpu", "--venv", "relative/venv"), "--venv must be an absolute path"),
    (("--role", "tpu"), "--role gpu|dpu|both is required"),
    (("--role", "gpu", "--frobnicate"), "unknown argument --frobnicate"),
])
def test_installer_rejects_bad_arguments(tmp_path, args, message):
    out = subprocess.run([str(SCRIPTS / "install_services.sh"), "--root", str(tmp_path), *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr
    assert not any(tmp_path.iterdir())   # nothing half-installed


def test_uninstall_then_purge(tmp_path):
    if shutil.which("systemd-sysusers") is None:
        pytest.skip("systemd-sysusers not installed")
    assert _install(tmp_path, "--role", "both").returncode == 0
    un = [str(SCRIPTS / "uninstall_services.sh"), "--root", str(tmp_path)]
    out = subprocess.run(un, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert not list((tmp_path / "etc/systemd/system").glob("blink-*"))
    assert not (tmp_path / "usr/local/lib/blink").exists()
    assert (tmp_path / "etc/blink/gpu-daemon.env").exists()          # settings kept
    out = subprocess.run(un + ["--purge"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "etc/blink").exists()
    assert "blink:" not in (tmp_path / "etc/passwd").read_text()


# -- the start check (ExecStartPost) --------------------------------------------------
def _wait_ready(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(WAIT_READY), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


class _Beats:
    """This test process as a running daemon: its pid in the header, a heartbeat every 50 ms."""

    def __init__(self, ring: Ring):
        self.ring, self.stop = ring, threading.Event()
        ring.set("backend_pid", os.getpid())
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        port = BackendPort(self.ring)
        while not self.stop.wait(0.05):
            port.beat()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def test_gpu_daemon_is_ready_when_the_ring_says_ready(ring_name):
    geom = RingGeometry(slot_count=4, prompt_arena_tokens=64, output_arena_tokens=64)
    region = ShmRegion.create(ring_name, geom.total_size)
    try:
        ring = Ring.create(region.buf, geom)
        ring.set("backend_status", BackendStatus.STARTING)
        env = {"BLINK_RING": ring_name, "MAINPID": str(os.getpid())}
        with _Beats(ring):
            out = _wait_ready("gpu-daemon", "--timeout-s", "0.6", "--interval-s", "0.1", env=env)
            assert out.returncode == 1 and "backend status STARTING" in out.stderr
            ring.set("backend_status", BackendStatus.READY)
            out = _wait_ready("gpu-daemon", "--timeout-s", "5", "--interval-s", "0.1", env=env)
        assert out.returncode == 0 and "ready" in out.stdout and "heartbeat advancing" in out.stdout, out.stderr
        del ring
    finally:
        region.close()


# A daemon's header writes, through the daemon's own functions: wait, begin (STARTING, pid,
# epoch + 1, first beat), heartbeat thread, wait, READY; then beat until killed.
_FAKE_DAEMON = """
import sys, threading, time
from shared_layout import Ring
from shared_layout.shm import ShmRegion
from gpu_backend import ring_host
from gpu_backend.heartbeat import Heartbeat
region = ShmRegion.open(sys.argv[1])
ring = Ring.attach(region.buf)
time.sleep(float(sys.argv[2]))
ring_host.begin(ring)
Heartbeat(ring, threading.Event(), 0.05).start()
time.sleep(float(sys.argv[3]))
ring_host.publish_model(ring, 100, 64)
print("ready", flush=True)
threading.Event().wait()
"""


def _fake_daemon(ring: str, before_begin_s: float, loading_s: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _FAKE_DAEMON, ring, str(before_begin_s), str(loading_s)],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)


def test_a_ring_left_ready_by_a_killed_daemon_does_not_pass_for_its_restart(ring_name):
    """kill -9 leaves READY, the dead pid and a still heartbeat in the header: the restarted
    unit's check must wait for the new daemon's own READY, not pass on the old one at once."""
    geom = RingGeometry(slot_count=4, prompt_arena_tokens=64, output_arena_tokens=64)
    region = ShmRegion.create(ring_name, geom.total_size)
    procs = []
    try:
        ring = Ring.create(region.buf, geom)
        old = _fake_daemon(ring_name, 0, 0)
        procs.append(old)
        assert old.stdout.readline().strip() == "ready"
        old.kill()
        old.wait()
        assert ring.get("backend_status") == BackendStatus.READY and ring.get("backend_pid") == old.pid
        assert ring.get("backend_epoch") == 1

        # systemd restarted the unit: its new main process is still importing, the header is the dead one's
        starting = subprocess.Popen(["sleep", "60"])
        procs.append(starting)
        out = _wait_ready("gpu-daemon", "--timeout-s", "1", "--interval-s", "0.1",
                          env={"BLINK_RING": ring_name, "MAINPID": str(starting.pid)})
        assert out.returncode == 1 and "stale READY" in out.stderr, (out.stdout, out.stderr)
        # run by hand (no MAINPID) the same: the dead daemon's READY is not a ready daemon
        out = _wait_ready("gpu-daemon", "--timeout-s", "0.6", "--interval-s", "0.1", env={"BLINK_RING": ring_name})
        assert out.returncode == 1 and "stale READY" in out.stderr, (out.stdout, out.stderr)

        # the restarted daemon: 2 s before it begins, READY 0.5 s later; the check started before either
        new = _fake_daemon(ring_name, 2.0, 0.5)
        procs.append(new)
        t0 = time.monotonic()
        out = _wait_ready("gpu-daemon", "--timeout-s", "60", "--interval-s", "0.1",
                          env={"BLINK_RING": ring_name, "MAINPID": str(new.pid)})
        took = time.monotonic() - t0
        assert out.returncode == 0, (out.stdout, out.stderr)
        assert f"epoch 2, pid {new.pid}" in out.stdout and took > 2.0, (out.stdout, took)
        assert new.stdout.readline().strip() == "ready"
    finally:
        for p in procs:
            p.kill()
            p.wait()
        region.close()


def test_a_stale_ready_whose_pid_lives_on_does_not_pass(ring_name):
    """READY with a pid that runs but is not this unit's daemon, or a heartbeat that does not move
    (the dead daemon's pid reused by another process), is not a ready daemon either."""
    geom = RingGeometry(slot_count=4, prompt_arena_tokens=64, output_arena_tokens=64)
    region = ShmRegion.create(ring_name, geom.total_size)
    other = subprocess.Popen(["sleep", "60"])
    try:
        ring = Ring.create(region.buf, geom)
        ring.set("backend_status", BackendStatus.READY)
        ring.set("backend_pid", os.getpid())                      # alive, but no heartbeat
        out = _wait_ready("gpu-daemon", "--timeout-s", "0.8", "--interval-s", "0.1", env={"BLINK_RING": ring_name})
        assert out.returncode == 1 and "heartbeat to advance" in out.stderr, (out.stdout, out.stderr)
        with _Beats(ring):                                        # a live daemon, but not the unit's
            out = _wait_ready("gpu-daemon", "--timeout-s", "0.8", "--interval-s", "0.1",
                              env={"BLINK_RING": ring_name, "MAINPID": str(other.pid)})
        assert out.returncode == 1 and f"not written by this unit's daemon (MAINPID {other.pid})" in out.stderr
        del ring
    finally:
        other.kill()
        other.wait()
        region.close()


def test_wait_ready_gives_up_at_once_when_the_service_died():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = _wait_ready("gpu-daemon", "--timeout-s", "30", env={"BLINK_RING": "blink-no-such-ring-x",
                                                              "MAINPID": str(dead.pid)})
    assert out.returncode == 1 and "exited before it was ready" in out.stderr


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_frontend_is_started_once_health_answers_even_503():
    srv = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        out = _wait_ready("dpu-frontend", "--timeout-s", "10",
                          env={"BLINK_HOST": "0.0.0.0", "BLINK_PORT": str(srv.server_port)})
        assert out.returncode == 0 and "-> 503" in out.stdout
    finally:
        srv.shutdown()
        srv.server_close()
    out = _wait_ready("dpu-frontend", "--timeout-s", "0.5", "--interval-s", "0.1",
                      env={"BLINK_HOST": "127.0.0.1", "BLINK_PORT": str(srv.server_port)})
    assert out.returncode == 1 and "not answering" in out.stderr

