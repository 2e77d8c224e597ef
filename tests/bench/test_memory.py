"""`blink bench`'s peak-memory measurement (bench/memory.py) on a real process tree started
as bench starts a server (its own session), and the report's Memory section."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from bench.interference import stop_group
from bench.memory import RssSampler, label
from bench.report import memory_lines

ALLOC_MIB = 60

# The child touches every page of its allocation (b"x" * n writes them), says so, frees it
# when told, says so, and waits.
CHILD = textwrap.dedent(f"""
    import sys, time
    buf = b"x" * ({ALLOC_MIB} << 20)
    print("allocated", flush=True)
    sys.stdin.readline()
    del buf
    print("freed", flush=True)
    time.sleep(60)
""")

# The server stand-in: one child in its session (inherits stdin/stdout), one that leaves it
# (setsid, as a daemonizing worker would) and is still its descendant.
PARENT = textwrap.dedent(f"""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", {CHILD!r}])
    away = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True, stdout=subprocess.DEVNULL)
    print("pids", child.pid, away.pid, flush=True)
    child.wait()
""")


@pytest.fixture
def tree():
    proc = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    away = None
    try:
        words = proc.stdout.readline().split()
        assert words[0] == "pids", words
        child, away = int(words[1]), int(words[2])
        assert proc.stdout.readline().strip() == "allocated"
        yield proc, child, away
    finally:
        stop_group(proc, grace_s=5.0)
        if away is not None:
            try:
                os.kill(away, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for f in (proc.stdin, proc.stdout):
            f.close()


def test_the_peak_sums_every_process_of_the_tree_and_outlives_a_free(tree):
    proc, child, away = tree
    sampler = RssSampler(proc.pid, period_s=0.2).start()
    time.sleep(0.7)                                   # the thread samples on its own
    proc.stdin.write("free\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "freed"
    t = time.monotonic()
    mem = sampler.stop()
    assert time.monotonic() - t < 2.0                 # stops promptly (a loaded box: generous)
    assert not sampler._thread.is_alive()
    assert mem["samples"] >= 3 and not mem["errors"]

    at_peak = {p["pid"]: p for p in mem["processes_at_peak"]}
    assert set(at_peak) == {proc.pid, child, away}    # session members and the setsid descendant
    assert os.getpid() not in at_peak                 # not the test's own process
    assert at_peak[child]["rss_mib"] >= ALLOC_MIB
    assert mem["peak_rss_mib"] >= ALLOC_MIB + at_peak[proc.pid]["rss_mib"]
    assert mem["peak_rss_mib"] == pytest.approx(sum(p["rss_mib"] for p in at_peak.values()), abs=0.5)
    assert at_peak[child]["name"] == f"{os.path.basename(sys.executable)} -c"
    # the peak stays after the memory is freed; the end mark shows the drop
    assert mem["marks"]["end"]["rss_mib"] < mem["peak_rss_mib"] - ALLOC_MIB / 2
    # VmHWM: each process's own peak, so the sum bounds the peak from above
    assert mem["hwm_sum_mib"] >= mem["peak_rss_mib"] - 0.5
    assert {p["pid"] for p in mem["processes_hwm"]} == {proc.pid, child, away}


def test_a_tree_that_exits_leaves_its_peak_and_high_water_marks(tree):
    proc, child, away = tree
    sampler = RssSampler(proc.pid, period_s=0.2).start()
    sampler.mark("ready")
    stop_group(proc, grace_s=5.0)
    os.kill(away, signal.SIGKILL)
    time.sleep(0.3)
    mem = sampler.stop()
    assert mem["marks"]["ready"]["rss_mib"] >= ALLOC_MIB
    assert mem["marks"]["end"]["rss_mib"] == 0
    assert mem["peak_rss_mib"] >= ALLOC_MIB
    assert mem["hwm_sum_mib"] >= ALLOC_MIB and not any(p["alive"] for p in mem["processes_hwm"])


def test_a_missing_root_gives_an_empty_measurement():
    dead = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    dead.wait()
    mem = RssSampler(dead.pid).start().stop()
    assert mem["peak_rss_mib"] == 0 and mem["processes_at_peak"] == [] and mem["hwm_sum_mib"] is None


def test_labels_name_what_a_process_runs():
    assert label("blink", ["/v/bin/python3", "/v/bin/blink", "gpu-daemon", "--ring", "r"]) == "blink gpu-daemon"
    assert label("python3", ["/v/bin/python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"]) \
        == "python3 -m vllm.entrypoints.openai.api_server"
    assert label("python3", ["/v/bin/python3", "-c", "from multiprocessing.spawn import spawn_main"]) \
        == "python3 (multiprocessing child)"
    assert label("VLLM::EngineCor", ["VLLM::EngineCore" + " " * 40]) == "VLLM::EngineCore"
    assert label("llama-server", ["/p/bin/llama-server", "-m", "x.gguf"]) == "llama-server"
    assert label("sleep", []) == "sleep"


def _mem(peak, hwm, procs):
    return {"peak_rss_mib": peak, "peak_at_s": 12.5, "hwm_sum_mib": hwm, "period_s": 0.5,
            "processes_at_peak": [{"pid": i, "name": n, "rss_mib": r} for i, (n, r) in enumerate(procs)],
            "marks": {"ready": {"t_s": 3.0, "rss_mib": peak - 10}}}


def _run(system, **extra):
    return {"system": system, "condition": "isolated", "colocated": False, "levels": [], **extra}


def test_the_memory_section_compares_blink_with_each_peer():
    blink = _mem(400.0, 420.0, [("blink gpu-daemon", 300.0), ("blink frontend", 70.0), ("blink serve", 30.0)])
    vllm = _mem(1000.0, 1100.0, [("VLLM::EngineCore", 700.0), ("python3 -m vllm.entrypoints.openai.api_server", 300.0)])
    results = {"meta": {}, "runs": [
        _run("blink", memory=blink), {**_run("blink", memory=blink), "condition": "colocated:x", "colocated": True},
        _run("vllm", memory=vllm), _run("llamaserver", memory=_mem(200.0, 210.0, [("llama-server", 200.0)]))]}
    text = "\n".join(memory_lines(results))
    print(text)
    assert text.startswith("## Memory")
    assert "| blink | 400.0 | 12.5 | blink gpu-daemon 300.0, blink frontend 70.0, blink serve 30.0 | 390.0 | 420.0 |" \
        in text
    assert text.count("| blink |") == 1                       # one row a system, not one a run
    assert "- blink peak RSS / vLLM's: 0.40 (sum of VmHWM: 0.38)" in text
    assert "- blink peak RSS / llama-server's: 2.00" in text


def test_the_memory_section_copes_with_missing_data():
    old = {"meta": {}, "runs": [_run("blink"), _run("vllm")]}          # results from before the measurement
    assert memory_lines(old) == []
    assert memory_lines({"meta": {}, "runs": []}) == []
    url = {"meta": {}, "runs": [_run("url", memory=None)]}
    text = "\n".join(memory_lines(url))
    assert "- url: not measured" in text and "|" not in text and "peak RSS /" not in text
    mixed = {"meta": {}, "runs": [_run("blink", memory=_mem(400.0, None, [("blink serve", 400.0)])), _run("vllm")]}
    text = "\n".join(memory_lines(mixed))
    assert "| blink | 400.0 |" in text and "| n/a |" in text            # no VmHWM: n/a, not a crash
    assert "- vllm: not recorded" in text and "peak RSS /" not in text


# A stand-in server for the sweep's hook: /v1/models lists "m"; it holds ALLOC_MIB MiB resident.
STUB = textwrap.dedent(f"""
    import http.server, json, sys
    buf = b"x" * ({ALLOC_MIB} << 20)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({{"data": [{{"id": "m"}}]}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_the_sweep_stores_each_servers_measurement_in_its_runs(tmp_path, monkeypatch):
    """Runner._run_system around a real (stand-in) server process: sampled from its start to its
    stop, the dict in every run of the system; a --url endpoint gets None. The load itself
    (_run_condition) is replaced: this is about the hook, not the sweep."""
    from bench.load import LoadConfig
    from bench.metrics import Slo
    from bench.servers import ServerSpec, free_port
    from bench.sweep import BenchPlan, Condition, Runner

    plan = BenchPlan(systems=("stub",), conditions=(Condition(),), load=LoadConfig(), workload=None, slo=Slo(),
                     workdir=tmp_path, ready_timeout_s=60.0, repeats=2)
    runner = Runner(plan, tokenizer=None, log=lambda s: None)
    alive_during = []

    def fake_condition(spec, server, cond):
        alive_during.append(server is None or server.alive())
        return {"system": spec.system, "condition": cond.label, "colocated": False, "levels": []}

    monkeypatch.setattr(runner, "_run_condition", fake_condition)
    port = free_port()
    spec = ServerSpec("stub", (sys.executable, "-c", STUB, str(port)), (), f"http://127.0.0.1:{port}", "m",
                      "stub", health_path=None)
    skipped = []
    runs = runner._run_system(spec, [Condition()], skipped)
    assert not skipped and len(runs) == 2 and all(alive_during)
    mem = runs[0]["memory"]
    assert mem is runs[1]["memory"]                     # the server's whole life, once
    assert mem["peak_rss_mib"] >= ALLOC_MIB and len(mem["processes_at_peak"]) == 1
    assert mem["marks"]["ready"]["rss_mib"] >= ALLOC_MIB and mem["hwm_sum_mib"] >= ALLOC_MIB
    assert mem["marks"]["end"]["t_s"] >= mem["marks"]["ready"]["t_s"]

    url = ServerSpec("url", (), (), f"http://127.0.0.1:{port}", "m", "external endpoint")
    assert [r["memory"] for r in runner._run_system(url, [Condition()], [])] == [None, None]
