"""Interferers: real processes, pinned where asked, stopped cleanly; missing tools said plainly."""
import os
import pathlib
import shutil
import time

import pytest

from bench.interference import (ALL_CPUS, InterferenceError, InterfererSpec, format_cpus, group_members,
                                missing_reason, parse_cpus, start_interferer)


def _group_pids(pgid: int) -> list[int]:
    return group_members(pgid)


def _cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_parse_and_format_cpu_lists():
    assert parse_cpus(None) is None and parse_cpus("all") is None
    assert parse_cpus(str(ALL_CPUS[0])) == (ALL_CPUS[0],)
    assert format_cpus((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    assert format_cpus(None) == "all"
    for bad in ("x", "3-1", "0,,a", "9999"):
        with pytest.raises(InterferenceError):
            parse_cpus(bad)


def test_unknown_kind_and_bad_threads_are_refused():
    with pytest.raises(InterferenceError):
        InterfererSpec("ffmpeg")
    with pytest.raises(InterferenceError):
        InterfererSpec("pyhog", threads=0)


def test_missing_tool_is_said_plainly(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    why = missing_reason("pbzip2")
    assert why and "pbzip2" in why and "not installed" in why
    assert missing_reason("pyhog") is None
    with pytest.raises(InterferenceError, match="not installed"):
        start_interferer(InterfererSpec("stress-ng"), pathlib.Path("/tmp"))


@pytest.mark.parametrize("kind", ["pyhog", "pbzip2", "stress-ng", "compile"])
def test_interferer_burns_cpu_on_its_core_and_stops(kind, tmp_path):
    if (why := missing_reason(kind)) is not None:
        pytest.skip(why)
    cpu = ALL_CPUS[-1]
    it = start_interferer(InterfererSpec(kind, threads=1, cpus=(cpu,)), tmp_path)
    try:
        time.sleep(1.5)
        pids = _group_pids(it.proc.pid)
        assert pids, "the interferer's process group is empty"
        for pid in pids:
            try:
                assert os.sched_getaffinity(pid) == {cpu}
            except ProcessLookupError:
                pass  # a short-lived compiler job ended between listing and checking
        busy = 0.0
        for pid in _group_pids(it.proc.pid):
            try:
                busy += _cpu_seconds(pid)
            except (FileNotFoundError, ProcessLookupError):
                pass
        assert busy > 0.1 or kind == "compile", f"{kind} used only {busy:.2f} CPU s"
        assert it.alive() and it.describe()["cpus"] == str(cpu)
    finally:
        it.stop()
    assert not it.alive()
    assert _group_pids(it.proc.pid) == []
