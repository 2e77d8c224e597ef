"""CI smoke run: `blink bench` against the real `blink serve --model null`, all outputs written.

A few seconds of load (two concurrency levels, then Poisson under a pure-Python
interferer), through the real CLI in a subprocess, as a user would run it.
"""
import csv
import gzip
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def _blink(*args, timeout_s=240):
    return subprocess.run([sys.executable, "-m", "dpu_frontend.cli", "bench", *args], capture_output=True,
                          text=True, timeout=timeout_s)


def test_smoke_run_against_blink_serve_null(tmp_path):
    out = tmp_path / "out"
    p = _blink("--preset", "smoke", "--model", "null", "--mode", "constant", "--levels", "2,8,16",
               "--duration-s", "1.5", "--interferer", "pyhog:1", "--slo", "ttft:1000,tpot:100",
               "--out", str(out), "--name", "smoke")
    assert p.returncode == 0, p.stderr[-3000:]
    names = {f.name for f in out.iterdir()}
    assert {"smoke.json.gz", "smoke.csv", "smoke.md", "smoke-latency.png", "smoke-throughput.png"} <= names
    res = json.loads(gzip.decompress((out / "smoke.json.gz").read_bytes()))
    runs = {r["condition"]: r for r in res["runs"]}
    assert set(runs) == {"isolated", "colocated:pyhogx1@cpuall"}
    iso = runs["isolated"]
    assert iso["server"]["system"] == "blink" and "--model null" in iso["server"]["command"]
    assert [lv["offered"] for lv in iso["levels"]] == [2, 8, 16]
    for run in runs.values():
        assert run["error"] is None and run["warmup"]["failed"] == 0
        for lv in run["levels"]:
            s = lv["summary"]
            assert s["requests"] == max(4, round(lv["offered"] * 1.5)) and s["failed"] == 0
            assert s["completed"] == len(lv["requests"]) and s["goodput"] is not None
            for r in lv["requests"]:
                # Exact lengths: the server saw the prompt length we built, and gave max_tokens.
                assert r["server_prompt_tokens"] == r["prompt_tokens"] == 16
                assert r["output_tokens"] == r["max_tokens"] == 8 and r["ttft_ms"] > 0
            assert lv["stages"]["tokenize"]["count"] >= s["requests"]
    assert runs["colocated:pyhogx1@cpuall"]["interferers"][0]["kind"] == "pyhog"
    # Each prompt once per system: level windows follow each other across both sweeps, never overlap.
    windows = [lv["prompts"] for r in res["runs"] for lv in r["levels"]]
    assert windows[0]["first"] >= 2                                     # after the warm-up requests
    for prev, cur in zip(windows, windows[1:]):
        assert cur["first"] >= prev["end"] > prev["first"]
    assert all(w["end"] - w["first"] >= len(lv["requests"]) for w, lv in
               zip(windows, [lv for r in res["runs"] for lv in r["levels"]]))
    assert not any(w["reused"] for w in windows)
    an = res["analysis"]
    assert an["reference"]["system"] == "blink" and len(an["table"]) == 2
    col = [r for r in an["table"] if r["condition"] != "isolated"][0]
    assert set(col["ratio"]) >= {"geo_p99_ttft_ms", "geo_p99_tpot_ms", "tput_at_sat_rps"}
    rows = list(csv.DictReader(open(out / "smoke.csv")))
    assert len(rows) == 6 and float(rows[0]["request_throughput"]) > 0
    md = (out / "smoke.md").read_text()
    assert "Summary (paper Tables 6 and 7)" in md and "smoke-latency.png" in md
    assert "no prefix-cache hits are possible" in md
    assert (out / "smoke-latency.png").read_bytes()[:4] == b"\x89PNG"


def test_repeats_alternate_the_conditions_on_one_server_and_report_the_spread(tmp_path):
    out = tmp_path / "out"
    p = _blink("--preset", "smoke", "--model", "null", "--levels", "1,2", "--duration-s", "1",
               "--interferer", "pyhog:1", "--repeats", "2", "--out", str(out), "--name", "rep")
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(gzip.decompress((out / "rep.json.gz").read_bytes()))
    order = [(r["repeat"], r["condition"]) for r in res["runs"]]
    assert order == [(0, "isolated"), (0, "colocated:pyhogx1@cpuall"), (1, "isolated"), (1, "colocated:pyhogx1@cpuall")]
    assert len({r["server"]["ready_s"] for r in res["runs"]}) == 1   # one server for every sweep
    (deg,) = res["analysis"]["degradation"]
    assert deg["system"] == "blink" and deg["repeats"] == 2 and len(deg["tok_ratio_geo"]["values"]) == 2
    assert set(deg["tok_ratio_by_level"]) == {"1.0", "2.0"}   # JSON keys: the offered loads
    md = (out / "rep.md").read_text()
    assert "## Colocated / isolated over repeats" in md and "### blink / isolated #2" in md
    rows = list(csv.DictReader(open(out / "rep.csv")))
    assert [r["repeat"] for r in rows] == ["0"] * 4 + ["1"] * 4


def test_bad_flags_are_clear_errors_not_tracebacks(tmp_path):
    for args, needle in ((["--levels", "1,x"], "--levels"), (["--interferer", "ffmpeg:2"], "unknown interferer"),
                         (["--server-cpus", "77"], "CPU"), (["--input-len", "uniform:9:1"], "length spec"),
                         (["--systems", "blink,vllm", "--model", "null"], "peers need --model default"),
                         (["--repeats", "0"], "--repeats must be >= 1")):
        p = _blink("--preset", "smoke", *args, "--out", str(tmp_path), timeout_s=60)
        assert p.returncode == 2, (args, p.stderr)
        assert needle in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)


def test_missing_peer_is_reported_and_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("BLINK_PEERS_DIR", str(tmp_path / "no-peers"))
    p = _blink("--check", timeout_s=60)
    assert p.returncode == 0 and "vllm" in p.stdout and "MISSING" in p.stdout
    out = tmp_path / "out"
    p = _blink("--preset", "smoke", "--systems", "vllm", "--out", str(out), "--name", "x", timeout_s=60)
    assert p.returncode == 1
    assert "SKIPPED system vllm" in p.stderr and "not installed" in p.stderr
    assert json.loads(gzip.decompress((out / "x.json.gz").read_bytes()))["skipped"][0]["system"] == "vllm"
