"""bench.cuda_scheduler's report from the counters the scheduler loop really keeps: the CPU twin
(csrc/sched_loop.h on host threads) serves an echo workload both ways (the frontend doorbell, and
a scan in every iteration), and its counters go through the same _persistent_stats and
write_results the GPU run uses, so a lent GPU's run does not end on a missing key."""
from __future__ import annotations

import time

import pytest

from bench import cuda_scheduler as cs
from gpu_backend.cuda import build, structs
from gpu_backend.cuda.config import SchedulerConfig
from shared_layout import Ring, RingGeometry, SlotState


@pytest.fixture(scope="module")
def twin_lib():
    if build.find_gxx() is None:
        pytest.skip("no g++")
    from gpu_backend.cuda import twin
    return twin.lib()


def _twin_run(ring_buf, geom, cfg) -> dict:
    from gpu_backend.cuda.twin import TwinScheduler
    ring = Ring.create(ring_buf, geom)
    cs.Bench._fill(ring, 16, 16, 32)
    tw = TwinScheduler(ring, cfg, threads=2)
    t0 = time.monotonic_ns()
    tw.start()
    deadline = time.monotonic() + 30
    while not (ring.state[:16] == SlotState.DECODE_COMPLETED).all():
        assert time.monotonic() < deadline, "the twin did not serve the workload"
        time.sleep(0.001)
    t1 = time.monotonic_ns()
    tw.stop()
    assert tw.join(30)
    cs.Bench._check(None, ring, 16, 16, 32)   # an instance method that reads nothing of its instance
    counters = {k: int(getattr(tw.stats, k)) for k in (*structs.COUNTERS, "max_window_launches")}
    return {**cs._persistent_stats(counters, t1 - t0), "launch_retries": counters["launch_retries"],
            "shared_state": cfg.shared_state}


def test_the_report_of_twin_counters_has_every_table(twin_lib, tmp_path, monkeypatch):
    monkeypatch.delenv("BLINK_SCHED_SHARED_STATE", raising=False)   # the default's tables
    geom = RingGeometry(4096, 1 << 16, 1 << 16)
    cfg = SchedulerConfig(max_batch_size=8, max_model_len=64, idle_sleep_ns=0)
    bell = _twin_run(bytearray(geom.total_size), geom, cfg)
    every = _twin_run(bytearray(geom.total_size), geom, SchedulerConfig(max_batch_size=8, max_model_len=64,
                                                                        idle_sleep_ns=0, full_scan_us=0))
    assert every["scans_per_step"] >= 1 > bell["scans_per_step"]
    full = _twin_run(bytearray(geom.total_size), geom, SchedulerConfig(max_batch_size=8, max_model_len=64,
                                                                       idle_sleep_ns=0, fast_plan=False))
    assert full["fast_plan_share"] == 0 < bell["fast_plan_share"] <= 1
    assert bell["shared_state"]   # the default
    in_device = _twin_run(bytearray(geom.total_size), geom, SchedulerConfig(max_batch_size=8, max_model_len=64,
                                                                            idle_sleep_ns=0, shared_state=False))
    assert in_device["steps"] == bell["steps"] and in_device["plan_us_per_step"] > 0
    assert bell["plan_us_per_step"] >= bell["policy_us_per_step"] > 0
    med = {"median_us": 1.0, "p10_us": 1.0, "p90_us": 1.0, "n": 1}
    results = {"date": cs.DATE, "machine": "twin", "device": "CPU twin", "sms": 0,
               "scan": {"slots": 4096, "device_memory": med, "host_mapped": med},
               "launch": {"device_fire_and_forget": {"api_call": med, "launch_to_child_start": med,
                                                     "launch_to_done_seen": med},
                          "host_launch": {"launch_to_child_start": med, "launch_to_done_seen": med},
                          "device_tail_relaunch": med, "ratio_host_over_device_start": 1.0,
                          "ratio_host_over_device_done": 1.0},
               "ops": {"reps": 1000, "runs": 5, "ns": {k: 10.0 + i for i, (k, _) in enumerate(cs.OPS)}},
               "workloads": [{"batch": 8, "requests": 16, "tokens_per_request": 32, "prompt_len": 16,
                              "persistent": bell, "persistent_scan_every_iteration": every,
                              "persistent_full_plan": full, "persistent_state_ab": in_device,
                              "persistent_device_ring": {"error": "not on a CPU"}, "host_loop": every,
                              "ratio_makespan_host_over_persistent": 1.0}]}
    stem = cs.write_results(results, tmp_path, "twin")
    md = stem.with_suffix(".md").read_text()
    in_shared = md.split("The loop's state in shared memory, A/B in this run")[1]
    assert (f"| 8 | {bell['scheduler_overhead_us_per_step']} | {bell['publish_us_per_step']} | "
            f"{bell['plan_us_per_step']} |") in in_shared
    assert f"| {in_device['scheduler_overhead_us_per_step']} | {in_device['publish_us_per_step']} |" in in_shared
    assert "by default: its params, state and counters in the block's shared memory" in md
    # a failed A/B run: its row keeps the table's columns, the default's numbers under its own home
    for p, failed_home in ((bell, "device"), (in_device, "shared")):
        results["workloads"][0].update(persistent=p, persistent_state_ab={"error": "boom"})
        table = cs.write_results(results, tmp_path, "twin").with_suffix(".md").read_text().split(
            "The loop's state in shared memory, A/B in this run")[1].split("\n\n")[1].splitlines()
        row = next(r for r in table if "boom" in r)
        assert row.count("|") == table[0].count("|"), (row, table[0])
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1 if failed_home == "device" else 8] == str(p["scheduler_overhead_us_per_step"])
        assert cells[8 if failed_home == "device" else 1] == "failed: boom"
    results["workloads"][0].update(persistent=bell, persistent_state_ab=in_device)
    md = cs.write_results(results, tmp_path, "twin").with_suffix(".md").read_text()
    ops = md.split("What thread 0 strings together between two steps")[1]
    assert all(f"| {what} | {10.0 + i} |" in ops for i, (_, what) in enumerate(cs.OPS))
    for heading in ("The persistent schedule phase in parts", "The frontend doorbell, A/B in this run",
                    "Overhead per step by phase", "The survey, A/B in this run"):
        assert heading in md
    ab = md.split("The frontend doorbell, A/B in this run")[1]
    assert f"| 8 | {bell['us_per_step']} | {bell['scans_per_step']} |" in ab
    survey = md.split("The survey, A/B in this run")[1]
    assert (f"| 8 | {round(100 * bell['fast_plan_share'])}% | {round(100 * bell['fast_admit_share'])}% | "
            f"{bell['par_commits']} | {bell['fill_blocks']} "
            f"({bell['fill_evictions']}) | {bell['commit_us_per_step']} | {bell['plan_us_per_step']} |") in survey
    assert bell["commit_us_per_step"] > 0 == full["commit_us_per_step"]    # the walk's commits are in its plan
    assert full["par_commits"] == 0 < bell["par_commits"]      # the echo's blocks, committed by every thread
    # publish's ring reads for block keys (timed by the longest thread each step, a part of publish, in
    # its table): none, the key chain keeps up with the tokens (the prompt at intake, each token as published)
    assert bell["pub_keys_us_per_step"] == 0 < bell["publish_us_per_step"]
    phases = md.split("Overhead per step by phase")[1]
    assert (f"| 8 | {bell['scan_us_per_step']} | {bell['publish_us_per_step']} | {bell['pub_keys_us_per_step']} | "
            f"{bell['commit_us_per_step']} | {bell['plan_us_per_step']} |") in phases


def test_mixed_lengths_are_served_and_checked_by_their_own_length(twin_lib):
    """The mixed workload: each request stops at its own length (the twin serves them; a reap in
    most steps), and the check reads each request's tokens up to its length, no further."""
    from gpu_backend.cuda.twin import TwinScheduler
    geom = RingGeometry(4096, 1 << 16, 1 << 16)
    lengths = cs._lengths(24, 40, mixed=True)
    assert lengths.min() >= 10 and lengths.max() <= 40 and len(set(lengths.tolist())) > 5
    assert (cs._lengths(24, 40, mixed=True) == lengths).all()          # the same draw every run
    ring = Ring.create(bytearray(geom.total_size), geom)
    cs.Bench._fill(ring, 24, 16, lengths)
    tw = TwinScheduler(ring, SchedulerConfig(max_batch_size=8, max_model_len=64, idle_sleep_ns=0), threads=2)
    tw.start()
    deadline = time.monotonic() + 30
    while not (ring.state[:24] == SlotState.DECODE_COMPLETED).all():
        assert time.monotonic() < deadline, "the twin did not serve the workload"
        time.sleep(0.001)
    tw.stop()
    assert tw.join(30)
    assert (ring.slots["generated"][:24] == lengths).all()
    cs.Bench._check(None, ring, 24, 16, lengths)
    stride = int(lengths.max())
    short = int(lengths.argmin())
    ring.output_arena[short * stride + int(lengths[short])] += 1       # past its length: not read
    cs.Bench._check(None, ring, 24, 16, lengths)
    ring.output_arena[short * stride] += 1                              # within it: a wrong token
    with pytest.raises(AssertionError, match=rf"requests \[{short}\]"):
        cs.Bench._check(None, ring, 24, 16, lengths)


def test_the_ops_kinds_are_bench_cu_s_in_its_order():
    """bench.cu's blink_bench_ops writes out[k] for its BLINK_OPS_* kinds in enum order; OPS names
    them in the same order (a kind added on one side only would shift every name after it)."""
    import re
    src = (build.CSRC / "bench.cu").read_text()
    enum = re.search(r"enum \{(.*?)BLINK_OPS_N", src, re.S).group(1)
    kinds = [k.lower() for k in re.findall(r"BLINK_OPS_(\w+)", enum)]
    assert kinds == [k for k, _ in cs.OPS]
    assert all(f"BLINK_OPS_TIME(BLINK_OPS_{k.upper()}," in src or f"out[BLINK_OPS_{k.upper()}]" in src for k in kinds)
