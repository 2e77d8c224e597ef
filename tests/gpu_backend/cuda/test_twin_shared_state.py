"""shared_state (SchedulerConfig, the default; BLINK_SCHED_SHARED_STATE=0 turns it off): each scheduler instance copies its
parameter block, state, counters and the prefix-cache allocator's scalars into the block's shared
memory, works there, and writes them back to device memory before each launch (the state: the step
graph reads it) and at each beat and its exit (sched_loop.h blink_copy_local; on the device a kernel of its
own, blink_scheduler_shared). On the CPU twin,
whose inline step reads the params in device memory as the graph does (host_twin.cc launch_step):
the workloads that exercise every phase give the same tokens, prefix cache and counters either way,
across preemption, evictions and admissions (and across many instances: test_cuda_twin_loop.py's
echo through launch windows, parametrized over it). A twin
without the write-back before a launch, or without the one at a beat, fails these (checked by hand
on 2026-11-27: wrong tokens; a crash at the next instance)."""
from __future__ import annotations

import ctypes

import pytest

from gpu_backend.cuda import structs
from gpu_backend.cuda.config import SchedulerConfig
from test_cuda_twin_loop import (ADMIT_STATS, GEOM, KEY_RUNS, PREFIX_STATS, SURVEY_GEOM,  # noqa: E402
                                 prefix_table, serve_admission_workload, serve_twin_commit_workload)



def test_the_switch_reaches_the_params(monkeypatch):
    monkeypatch.delenv("BLINK_SCHED_SHARED_STATE", raising=False)
    cfg = SchedulerConfig()
    assert cfg.shared_state is True   # the default since the H200 timed it (bench/results/*-gpu-check-4)
    assert cfg.params(GEOM, 0, {}, 0).shared_state == 1 and cfg.params(GEOM, 0, {}, 0).home == 0
    for off in ("0", " 0 "):
        monkeypatch.setenv("BLINK_SCHED_SHARED_STATE", off)
        assert SchedulerConfig().shared_state is False and SchedulerConfig().params(GEOM, 0, {}, 0).shared_state == 0
    monkeypatch.setenv("BLINK_SCHED_SHARED_STATE", "1")
    assert SchedulerConfig().shared_state is True


@pytest.mark.parametrize("run", KEY_RUNS)
def test_commits_evictions_and_preemptions_are_the_same_in_shared_memory(twin_lib, shm_ring, run):
    cfg = KEY_RUNS[run]
    off, off_table = serve_twin_commit_workload(shm_ring(SURVEY_GEOM), shared_state=False, **cfg)
    on, on_table = serve_twin_commit_workload(shm_ring(SURVEY_GEOM), shared_state=True, **cfg)
    assert on.params.shared_state == 1 and off.params.shared_state == 0
    assert on_table == off_table and len(on_table) > 20
    for name in PREFIX_STATS + ("fast_plans", "fill_evictions", "par_commits", "completed", "claimed"):
        assert getattr(on.stats, name) == getattr(off.stats, name), name
    assert on.stats.fast_plan_mismatches == 0
    # the allocator's scalars came back from shared memory at the exit
    on_pkv, off_pkv = (structs.PKV.from_buffer_copy(t.buffer("pkv", "u1")[:ctypes.sizeof(structs.PKV)].tobytes())
                       for t in (on, off))
    for name in ("lru_head", "lru_tail", "evictable", "cached", "evictions", "never_cached"):
        assert getattr(on_pkv, name) == getattr(off_pkv, name), name


def test_admissions_under_a_small_pool_are_the_same_in_shared_memory(twin_lib, shm_ring):
    off = serve_admission_workload(shm_ring(SURVEY_GEOM), num_blocks=1200, shared_state=False)
    on = serve_admission_workload(shm_ring(SURVEY_GEOM), num_blocks=1200, shared_state=True)
    assert on.stats.preempted > 0 and on.stats.fast_admits > 0
    for name in ADMIT_STATS + ("fast_admits", "fast_plans"):
        assert getattr(on.stats, name) == getattr(off.stats, name), name
    assert prefix_table(on.buffer, on.config.kv_blocks) == prefix_table(off.buffer, off.config.kv_blocks)
    assert (on.state.admit_checked, on.state.fast_checked) == (off.state.admit_checked, off.state.fast_checked)
