"""`blink gpu-daemon --model null` as a real process over a real shared-memory ring."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from shared_layout import (BackendStatus, ErrorCode, FinishReason, Ring, SlotRequest, SlotState)
from shared_layout.shm import ShmRegion

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from frontend_player import FrontendPlayer  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
BLINK = [str(REPO / ".venv" / "bin" / "blink")] if (REPO / ".venv" / "bin" / "blink").exists() else \
    [sys.executable, "-m", "dpu_frontend.cli"]
GEOM_FLAGS = ["--slots", "64", "--prompt-arena-tokens", "65536", "--output-arena-tokens", "65536"]


def start_daemon(ring_name: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(BLINK + ["gpu-daemon", "--model", "null", "--ring", ring_name, *GEOM_FLAGS, *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_ready(ring_name: str, proc: subprocess.Popen, epoch: int = 1, timeout_s: float = 30) -> Ring:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"daemon exited early: {proc.communicate()}"
        if ShmRegion.exists(ring_name):
            try:
                ring = Ring.attach(ShmRegion.open(ring_name).buf)
            except Exception:
                ring = None
            if ring is not None and ring.get("backend_epoch") == epoch \
                    and ring.get("backend_status") == BackendStatus.READY:
                return ring
        time.sleep(0.02)
    raise AssertionError("daemon never became READY")


def stop(proc: subprocess.Popen, sig=signal.SIGTERM, timeout_s: float = 20) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode


@pytest.fixture
def daemon(ring_name):
    procs = []

    def spawn(*extra):
        p = start_daemon(ring_name, *extra)
        procs.append(p)
        return p
    yield spawn
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def echo(prompt, n):
    return [prompt[i % len(prompt)] for i in range(n)]


def test_ready_heartbeat_serve_and_sigterm(ring_name, daemon):
    proc = daemon()
    ring = wait_ready(ring_name, proc)
    assert oct(os.stat(f"/dev/shm/{ring_name}").st_mode & 0o777) == "0o600"
    assert ring.get("model_vocab_size") == 49152 and ring.get("model_max_len") == 8192
    assert ring.get("backend_pid") == proc.pid
    hb, hb_ns = ring.get("backend_heartbeat"), ring.get("backend_heartbeat_ns")
    time.sleep(0.35)
    assert ring.get("backend_heartbeat") >= hb + 2 and ring.get("backend_heartbeat_ns") > hb_ns
    fe = FrontendPlayer(ring)
    prompts = [[1, 2, 3], [7], list(range(100, 140))]
    slots = [fe.submit(p, 10 + i) for i, p in enumerate(prompts)]
    for i, (slot, p) in enumerate(zip(slots, prompts)):
        res = fe.wait(slot)
        assert res.finish == FinishReason.LENGTH and res.tokens == echo(p, 10 + i)
        assert res.t_picked_ns > 0 and res.t_first_ns >= res.t_picked_ns
    # stop ids: the stop token is published and counted, finish STOP
    res = fe.wait(fe.submit([4, 5, 6, 9], 50, stop_ids=(6,)))
    assert res.finish == FinishReason.STOP and res.tokens == [4, 5, 6]
    assert stop(proc) == 0
    assert ring.get("backend_status") == BackendStatus.DOWN
    assert "Traceback" not in proc.stderr.read()


def test_sigterm_with_requests_in_flight(ring_name, daemon):
    proc = daemon("--shutdown-grace-s", "0")
    ring = wait_ready(ring_name, proc)
    fe = FrontendPlayer(ring)
    slots = [fe.submit([i + 1, i + 2], 8000) for i in range(8)]
    time.sleep(0.05)
    assert stop(proc) == 0
    assert ring.get("backend_status") == BackendStatus.DOWN
    for slot in slots:
        assert fe.done(slot)
        res = fe.collect(slot)
        assert (res.finish, res.error) in {(FinishReason.ABORT, ErrorCode.BACKEND_SHUTDOWN),
                                           (FinishReason.LENGTH, ErrorCode.NONE)}
        assert res.tokens == echo([slot + 1, slot + 2], len(res.tokens))
    assert ring.counts_by_state()[SlotState.EMPTY] == 64


def test_restart_on_same_ring_bumps_epoch_and_serves(ring_name, daemon):
    proc = daemon()
    ring = wait_ready(ring_name, proc, epoch=1)
    fe = FrontendPlayer(ring)
    assert fe.wait(fe.submit([3, 4], 5)).tokens == [3, 4, 3, 4, 3]
    assert stop(proc) == 0
    proc2 = daemon()
    wait_ready(ring_name, proc2, epoch=2)      # same file: our mapping sees the new daemon
    assert ring.get("backend_pid") == proc2.pid
    assert fe.wait(fe.submit([8, 9], 4)).tokens == [8, 9, 8, 9]
    assert stop(proc2, signal.SIGINT) == 0


def test_killed_daemon_leftovers_are_aborted_and_pending_served(ring_name, daemon):
    proc = daemon()
    ring = wait_ready(ring_name, proc)
    fe = FrontendPlayer(ring)
    slot = fe.submit([1, 2], 8000)
    deadline = time.monotonic() + 10
    while int(ring.state[slot]) not in (SlotState.DECODE_PROCESSING, SlotState.DECODE_COMPLETED):
        assert time.monotonic() < deadline
    proc.kill()
    proc.wait()
    if fe.done(slot):
        pytest.skip("the daemon finished 8000 tokens before it was killed")
    pending = fe.submit([5, 6], 3)     # waits in PREFILL_PENDING for the next daemon
    proc2 = daemon()
    wait_ready(ring_name, proc2, epoch=2)
    res = fe.wait(slot)
    assert (res.finish, res.error) == (FinishReason.ABORT, ErrorCode.BACKEND_SHUTDOWN)
    assert fe.wait(pending).tokens == [5, 6, 5]
    assert stop(proc2) == 0


def test_shutdown_word_stops_the_daemon(ring_name, daemon):
    proc = daemon()
    ring = wait_ready(ring_name, proc)
    ring.set("shutdown", 1)
    assert proc.wait(20) == 0
    assert ring.get("backend_status") == BackendStatus.DOWN


def test_corrupted_slots_end_with_error_and_daemon_keeps_serving(ring_name, daemon):
    proc = daemon("--max-model-len", "64")
    ring = wait_ready(ring_name, proc)
    fe = FrontendPlayer(ring)
    geom = ring.geom
    ok = fe.submit([1, 2, 3], 4)
    bad = {
        "offset beyond arena": (dict(prompt_offset=geom.prompt_arena_tokens - 1, prompt_len=5), ErrorCode.INVALID_REQUEST),
        "zero length": (dict(prompt_len=0), ErrorCode.INVALID_REQUEST),
        "huge length": (dict(prompt_len=2**32 - 1), ErrorCode.INVALID_REQUEST),
        "output beyond arena": (dict(output_offset=geom.output_arena_tokens - 2), ErrorCode.INVALID_REQUEST),
        "nan temperature": (dict(temperature=float("nan")), ErrorCode.INVALID_REQUEST),
        "bad top_p": (dict(top_p=0.0), ErrorCode.INVALID_REQUEST),
        "too many stop ids": (dict(n_stop_ids=99), ErrorCode.INVALID_REQUEST),
        "token id >= vocab": (dict(token=49152), ErrorCode.INVALID_TOKEN),
        "negative token id": (dict(token=-5), ErrorCode.INVALID_TOKEN),
        "prompt too long": (dict(prompt_len=64), ErrorCode.PROMPT_TOO_LONG),
    }
    slots = {}
    for i, (name, (fields, _)) in enumerate(bad.items()):
        slot = 10 + i
        base = 30000 + 100 * i     # away from what FrontendPlayer allocates
        rec = SlotRequest(seq=1000 + i, prompt_offset=base, prompt_len=4, output_offset=base, max_tokens=4).record()[0]
        ring.prompt_arena[base:base + 100] = 7
        if "token" in fields:
            ring.prompt_arena[base + 2] = fields.pop("token")
        raw = ring.slots[slot]
        for k in rec.dtype.names:
            if k != "state":
                raw[k] = rec[k]
        for k, v in fields.items():
            raw[k] = v
        ring.state[slot] = SlotState.PREFILL_PENDING
        slots[name] = slot
    for name, slot in slots.items():
        deadline = time.monotonic() + 10
        while ring.state[slot] != SlotState.DECODE_COMPLETED:
            assert time.monotonic() < deadline, name
            time.sleep(0.001)
        r = ring.slots[slot]
        assert (FinishReason(int(r["finish_reason"])), ErrorCode(int(r["error_code"]))) == \
            (FinishReason.ERROR, bad[name][1]), name
        assert int(r["generated"]) == 0
    assert fe.wait(ok).tokens == [1, 2, 3, 1]
    assert fe.wait(fe.submit([9] * 60, 10)).tokens == [9] * 4      # context 64: LENGTH at the limit
    assert proc.poll() is None
    assert stop(proc) == 0


def test_stale_epoch_and_cancel(ring_name, daemon):
    proc = daemon()
    ring = wait_ready(ring_name, proc)
    fe = FrontendPlayer(ring)
    ring.set("frontend_epoch", 5)
    stale = fe.submit([1], 3)
    ring.slots[stale]["epoch"] = 4          # written by a frontend before it restarted
    long = fe.submit([2, 3], 8000)
    while not fe.tokens_so_far(long):
        time.sleep(0.0005)
    fe.cancel(long)
    res = fe.wait(stale)
    assert (res.finish, res.error) == (FinishReason.ABORT, ErrorCode.STALE_EPOCH)
    res = fe.wait(long)
    assert res.finish in (FinishReason.ABORT, FinishReason.LENGTH)
    assert res.tokens == echo([2, 3], len(res.tokens))
    assert stop(proc) == 0


def test_unavailable_executor_is_one_line_and_exit_2(ring_name):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run(BLINK + ["gpu-daemon", "--executor", "cuda", "--ring", ring_name], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("blink gpu-daemon: --executor cuda needs an NVIDIA GPU")
    assert not ShmRegion.exists(ring_name)


def test_ring_with_other_geometry_is_not_replaced_while_mapped(ring_name):
    """This process maps the ring (as a frontend would): the daemon refuses, naming the pid."""
    from shared_layout import RingGeometry
    geom = RingGeometry(8, 256, 256)
    region = ShmRegion.create(ring_name, geom.total_size)
    Ring.create(region.buf, geom)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run(BLINK + ["gpu-daemon", "--model", "null", "--ring", ring_name, "--slots", "16"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "another layout" in p.stderr and "Traceback" not in p.stderr
    assert f"pids {os.getpid()}" in p.stderr
    assert Ring.attach(region.buf).geom == geom


def test_a_ring_of_another_layout_that_nobody_maps_is_replaced(ring_name, daemon):
    """Left by an earlier build (another layout version) and mapped by nobody: the daemon replaces
    it with one warning line instead of refusing to start (what an upgrade would otherwise hit)."""
    from shared_layout import RingGeometry
    geom = RingGeometry(8, 256, 256)
    region = ShmRegion.create(ring_name, geom.total_size)
    ring = Ring.create(region.buf, geom)
    ring.set("layout_version", ring.get("layout_version") - 1)
    del ring
    region.close()
    p = daemon()
    assert wait_ready(ring_name, p).geom.slot_count == 64
    assert stop(p) == 0
    err = p.stderr.read()
    assert "had another layout (ring layout version" in err and "no process maps it: replaced" in err, err


def test_unloadable_model_is_one_line(ring_name):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run(BLINK + ["gpu-daemon", "--model", "/nonexistent/model.gguf", "--ring", ring_name,
                                *GEOM_FLAGS], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot load model" in lines[0] and "not found" in lines[0]
    ring = Ring.attach(ShmRegion.open(ring_name).buf)
    assert ring.get("backend_status") == BackendStatus.DOWN


def test_policy_trace_records_replayable_decisions(ring_name, daemon, tmp_path):
    import json

    from gpu_backend.scheduler.policy import Scenario
    trace = tmp_path / "trace.json"
    proc = daemon("--policy-trace", str(trace), "--max-batch-size", "3", "--max-prefill-tokens", "8")
    ring = wait_ready(ring_name, proc)
    fe = FrontendPlayer(ring)
    slots = [fe.submit(list(range(1, 2 + 3 * i)), 6) for i in range(5)]
    for s in slots:
        fe.wait(s)
    assert stop(proc) == 0
    sc = Scenario.from_json(json.loads(trace.read_text()))
    assert sc.config.max_batch_size == 3 and sc.config.max_prefill_tokens == 8
    assert any(p.prefill for _, p in sc.steps) and not sc.mismatches()


def test_verbs_transport_without_rdma_device_is_one_line(ring_name):
    import glob
    if glob.glob("/sys/class/infiniband/*"):
        pytest.skip("this machine has an RDMA device")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run(BLINK + ["gpu-daemon", "--model", "null", "--ring", ring_name, "--transport", "verbs",
                                *GEOM_FLAGS], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("blink gpu-daemon: ") and "RDMA" in lines[0]
    assert not ShmRegion.exists(ring_name)
