"""bench/cuda_graphs.py's machinery without a GPU: the daemon it starts (here the
null executor), the N x I -> O workload written into the ring and timed from the
backend's stamps, the ratios and the report; a clear refusal without a GPU; and
the TensorRT probe, which skips cleanly where TensorRT is absent."""
from __future__ import annotations

import argparse
import pathlib

import pytest

import bench.cuda_graphs as bench
from gpu_backend.cuda import driver
from gpu_backend.graphs import tensorrt


def test_workloads_through_a_real_daemon(tmp_path, ring_name):
    args = argparse.Namespace(buckets=None, slots=64, max_batch_size=16, max_prefill_tokens=256,
                              max_model_len=256, kv_cache_mb=16, startup_timeout_s=120, dtype="float32")
    daemon = bench.Daemon("cpu", "null", ring_name, args, tmp_path)
    try:
        assert daemon.setup_s > 0
        for n, i, o in ((16, 32, 8), (8, 100, 20), (16, 32, 8)):      # slots are handed back between runs
            seen = len(daemon.periods())
            r = bench.run_workload(daemon.ring, n, i, o, bench.Energy(), seed=n + i)
            assert r["tokens"] == n * o and 0 < r["makespan_ms"] <= r["seen_ms"] + 1
            assert r["clocks"]["samples"] >= 1        # (no NVML here: the CPU's clock where the kernel shows it)
            # the engine's busy period of this run (BLINK_ENGINE_PERIODS, set by Daemon): at least the
            # decode steps, its time split between the engine's own Python and the runner
            p = daemon.period_after(seen)
            assert p is not None and p["steps"] >= o and p["wall_ms"] > 0
            assert p["engine_ms"] > 0 and abs(p["engine_ms"] + p["runner_ms"] - p["wall_ms"]) < 0.01
        with pytest.raises(bench.BenchError, match="does not fit"):
            bench.run_workload(daemon.ring, 65, 4, 4, bench.Energy(), seed=1)
    finally:
        daemon.stop()
    assert "ready" in daemon.tail()
    assert not pathlib.Path(f"/dev/shm/{ring_name}").exists()


def test_no_run_repeats_another_runs_prompt_blocks():
    """Every run_workload call of a daemon's conditions takes its own seed, so no prompt's first KV block
    (16 tokens) repeats anywhere in the run plan: a repeat would be served from the prefix cache and make
    a later condition look faster (the H200's 2026-11-27 run: 68% of prefill tokens hit)."""
    workloads = [(64, 128, 32), (64, 512, 128), (256, 128, 128)]
    seeds = bench.run_seeds(workloads, 3)
    assert len(seeds) == len(bench.CONDITIONS) * len(workloads) * (1 + 3)
    firsts = [p[:16].tobytes() for (_c, (n, i, _o), _r), seed in seeds.items()
              for p in bench.workload_prompts(seed, n, i, 49152)]
    assert len(firsts) == 3 * 4 * (64 + 64 + 256) and len(set(firsts)) == len(firsts)


def _fake(p_iso, h_iso, p_int, h_int, p_all=None, h_all=None):
    def runs(a, b, c):
        out = {"isolated": {"64x128->32": {"makespan_ms": a, "j_per_token": 0.5}},
               "interference": {"64x128->32": {"makespan_ms": b}}}
        if c is not None:
            out["all_cores"] = {"64x128->32": {"makespan_ms": c}}
        return out
    return {"date": bench.DATE, "machine": "t", "model": "m", "dtype": "float32", "daemon_cpu": 0,
            "interferer_cpus": [1, 2], "interferer": "pyhog", "energy": "nvml", "config": {"repeats": 3},
            "device": "x", "executors": {"cuda": {"setup_s": 1, "report": {}, "runs": runs(p_iso, p_int, p_all)},
                                         "cuda-hostloop": {"setup_s": 1, "report": {},
                                                           "runs": runs(h_iso, h_int, h_all)}}}


def test_ratios_and_report(tmp_path):
    res = _fake(100.0, 150.0, 110.0, 210.0)
    res["ratios"] = bench.ratios(res, [(64, 128, 32)])
    r = res["ratios"]["64x128->32"]
    assert r["hostloop_over_persistent_isolated"] == 1.5 and r["hostloop_over_persistent_interference"] == 1.909
    t = res["ratios"]["targets"]
    assert r["cuda_retention"] == 0.909 and not t["met"] and not t["retention_met"]     # 1.5x < issue 17's 1.7x
    stem = bench.write_results(res, tmp_path, "t")
    md = stem.with_suffix(".md").read_text()
    assert "| 64x128->32 | isolated | 100.0 | 150.0 | 1.5x |" in md and "(target >= 1.7: NOT met)" in md
    res = _fake(100.0, 175.0, 100.0, 175.0)
    res["ratios"] = bench.ratios(res, [(64, 128, 32)])
    assert res["ratios"]["targets"]["met"] and res["ratios"]["targets"]["hostloop_over_persistent"] == 1.75
    res["dtype"] = "bfloat16"                  # the bf16 A/B beside the float32 one, in the same $OUT
    assert bench.write_results(res, tmp_path, "t").name == f"{bench.DATE}-t-cuda_graphs-bf16"


def test_the_host_loops_runs_in_parts(tmp_path):
    """Each host-loop run's `engine period` (summed where a run had several) becomes a row, us a step:
    the staging is what the runner took beyond the launch call and the wait."""
    res = _fake(100.0, 150.0, 110.0, 210.0)
    run = res["executors"]["cuda-hostloop"]["runs"]["isolated"]["64x128->32"]
    run["makespan_ms_all"] = [150.0]
    run["host_periods"] = [{"steps": 40, "wall_ms": 150.0, "engine_ms": 50.0, "runner_ms": 100.0,
                            "launch_ms": 4.0, "wait_ms": 80.0}]
    res["ratios"] = bench.ratios(res, [(64, 128, 32)])
    md = bench.write_results(res, tmp_path, "t").with_suffix(".md").read_text()
    assert "| 64x128->32 | isolated | 150.0 | 40 | 3750.0 | 1250.0 | 400.0 | 100.0 | 2000.0 |" in md
    assert bench.host_loop_parts({"cuda": res["executors"]["cuda"]}) == []


class FakeNvml:
    """pynvml's calls Clocks makes, over a list of (SM MHz, reasons) readings."""
    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2

    def __init__(self, readings):
        self.readings, self.i = readings, 0

    def nvmlDeviceGetClockInfo(self, handle, which):
        return self.readings[min(self.i, len(self.readings) - 1)][0] if which == 1 else 4800

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        r = self.readings[min(self.i, len(self.readings) - 1)][1]
        self.i += 1
        return r


def test_the_clocks_each_run_went_at(tmp_path):
    """Clocks: NVML's SM and memory clocks over the samples (median, least) and the reasons OR-ed; the
    report puts them beside each run's makespan, both executors."""
    clocks = bench.Clocks()
    clocks.nvml, clocks.handle = FakeNvml([(1980, 0), (1980, 0), (1500, 0x4), (1980, 0x1)]), object()
    clocks.samples = [clocks.sample() for _ in range(4)]
    clocks.cpu_mhz = [3000, 2400]
    c = clocks.summary()
    assert (c["sm_mhz"], c["sm_mhz_min"], c["mem_mhz"], c["reasons"], c["samples"]) == (1980, 1500, 4800, "0x5", 4)
    assert (c["cpu_mhz"], c["cpu_mhz_min"]) == (2700, 2400)
    with bench.Clocks(period_s=0.001) as live:   # the thread samples until the run ends
        import time
        time.sleep(0.02)
    assert live.summary()["samples"] >= 2
    res = _fake(100.0, 150.0, 110.0, 210.0)
    for e, ms in (("cuda", 100.0), ("cuda-hostloop", 150.0)):
        run = res["executors"][e]["runs"]["isolated"]["64x128->32"]
        run["makespan_ms_all"], run["clocks"] = [ms], [c]
    res["ratios"] = bench.ratios(res, [(64, 128, 32)])
    md = bench.write_results(res, tmp_path, "t").with_suffix(".md").read_text()
    assert "| cuda-hostloop | 64x128->32 | isolated | 150.0 | 1980 (1500) | 4800 (4800) | 0x5 |" in md
    assert "| cuda | 64x128->32 | isolated | 100.0 | 1980 (1500) |" in md


def test_every_core_busy_is_its_own_condition(tmp_path):
    """all_cores: the interferer on the daemon's core too; the persistent target takes the worse of the
    two interfered conditions, and the host loop's own retention there is reported."""
    res = _fake(100.0, 150.0, 101.0, 152.0, 99.0, 450.0)
    res["ratios"] = bench.ratios(res, [(64, 128, 32)])
    r, t = res["ratios"]["64x128->32"], res["ratios"]["targets"]
    assert r["hostloop_over_persistent_all_cores"] == 4.545 and r["cuda-hostloop_retention_all_cores"] == 0.333
    assert r["cuda_retention_all_cores"] == 1.01 and t["persistent_min_retention"] == 0.99 and t["retention_met"]
    assert t["hostloop_min_retention_all_cores"] == 0.333
    md = bench.write_results(res, tmp_path, "t").with_suffix(".md").read_text()
    assert "| 64x128->32 | all_cores | 99.0 | 450.0 | 4.545x |" in md and "| 0.99 | 0.987 | 1.01 | 0.333 |" in md


def test_refuses_in_one_line_without_a_gpu(capsys):
    if driver.unavailable_reason() is None:
        pytest.skip("a usable GPU is present")
    assert bench.main(["--quick", "--out", "/tmp"]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "needs a GPU" in out[0]


def test_tensorrt_probe_is_one_line():
    line = tensorrt.status()
    assert "\n" not in line and "PyTorch capture" in line
    if tensorrt.unavailable_reason() is not None:
        assert "skipped" in line
