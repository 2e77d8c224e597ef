"""The restart-count file `blink serve` writes and the frontend's /metrics lines made from it."""
from __future__ import annotations

import time

from dpu_frontend import supervisor_state
from dpu_frontend.metrics import FrontendMetrics
from dpu_frontend.supervisor_state import ChildState
from frontend_procs import metric


def test_written_state_reads_back_and_renders_as_counters(tmp_path):
    path = tmp_path / "restarts.json"
    now = time.time()
    supervisor_state.write(path, {"gpu-daemon": ChildState(3, now - 5.0), "frontend": ChildState(0, now - 100.0)})
    state = supervisor_state.read(path)
    assert state == {"gpu-daemon": ChildState(3, now - 5.0), "frontend": ChildState(0, now - 100.0)}
    text = FrontendMetrics("m").render({}, None, state)
    assert metric(text, "blink_daemon_restarts_total") == 3 and metric(text, "blink_frontend_restarts_total") == 0
    assert 5.0 <= metric(text, "blink_seconds_since_last_restart", process="gpu-daemon") < 60.0
    assert metric(text, "blink_seconds_since_last_restart", process="frontend") >= 100.0
    assert "# TYPE blink_daemon_restarts_total counter" in text
    assert not list(tmp_path.glob("*.tmp"))


def test_without_a_supervisor_there_are_no_restart_lines(tmp_path):
    assert supervisor_state.read(None) is None
    assert supervisor_state.read(tmp_path / "missing.json") is None
    (tmp_path / "bad.json").write_text('{"frontend": {"restarts": "x"}')
    assert supervisor_state.read(tmp_path / "bad.json") is None
    assert "restart" not in FrontendMetrics("m").render({}, None, None)
