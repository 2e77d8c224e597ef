"""The persistent scheduler on a real GPU (marked `gpu`: skipped without an
NVIDIA GPU of compute capability >= 9.0, its driver and cuda-python).

    host-mapped shm ring -> SchedulerRuntime (device graphs, tail relaunches)
    device-memory ring   -> the same, the frontend's writes copied in by the driver
    `blink gpu-daemon --executor cuda --model null` + the real RingClient:
        10,000 requests with random lengths and cancellations through 4096 slots

None of these use pytest-asyncio (the GPU image lacks it): async code runs
under asyncio.run inside plain tests.
"""
from __future__ import annotations

import asyncio
import pathlib
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from gpu_backend.cuda import structs
from gpu_backend.cuda.child_env import child_env
from gpu_backend.cuda.config import SchedulerConfig
from shared_layout import (ErrorCode, FinishReason, Ring, RingGeometry, SlotRequest, SlotState, doorbell_write,
                           submit_writes)
from shared_layout.layout import SLOT
from shared_layout.shm import ShmRegion

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from frontend_player import FrontendPlayer  # noqa: E402
from test_cuda_twin_loop import (ADMIT_STATS, COMMIT_CFG, EVICT, GEOM, PREFIX_STATS, SURVEY_CFG,  # noqa: E402
                                 SURVEY_GEOM, _serve_workload, drain, echo, prefix_table, serve_admission_workload,
                                 serve_survey_workload, serve_twin_commit_workload, submit_admission_workload,
                                 submit_commit_workload)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def device():
    from gpu_backend.cuda import driver
    return driver.open_device(0)


@pytest.fixture(scope="module")
def module(device):
    from gpu_backend.cuda.runtime import Module
    return Module()


def runtime_on(ring: Ring, device, module, **cfg):
    from gpu_backend.cuda.device_ring import HostMappedRing
    from gpu_backend.cuda.runtime import SchedulerRuntime
    base = dict(max_batch_size=8, max_model_len=512, beat_interval_s=0.005, grace_s=2.0)
    base.update(cfg)
    mapped = HostMappedRing(ring)
    rt = SchedulerRuntime(device, SchedulerConfig(**base), ring.geom, mapped.device_addr, module)
    rt.start()
    return rt, mapped


def shut(rt, mapped, abort=False):
    rt.request_stop(abort)
    assert rt.wait(30), "scheduler did not exit"
    s = rt.stats()
    rt.close()
    mapped.close()
    return s


@pytest.mark.parametrize("shared_state", [True, False], ids=["shared_state", "device_state"])
def test_echo_through_tail_relaunch_windows(ring_name, device, module, shared_state):
    """shared_state: every instance copies its params, state, counters and allocator scalars into shared
    memory and writes them back (the state before each launch: the step graph reads it there)."""
    region = ShmRegion.create(ring_name, GEOM.total_size)
    ring = Ring.create(region.buf, GEOM)
    rt, mapped = runtime_on(ring, device, module, window_limit=4, shared_state=shared_state)
    fp, rng, want = FrontendPlayer(ring), np.random.default_rng(11), {}
    for _ in range(150):
        if len(fp.inflight) >= 48:
            for r in drain(fp).values():
                assert r.tokens == want[r.seq] and r.finish == FinishReason.LENGTH
        prompt = rng.integers(0, 49152, int(rng.integers(1, 40))).tolist()
        n = int(rng.integers(1, 120))
        fp.submit(prompt, n)
        want[fp.next_seq - 1] = echo(prompt, n)
    for r in drain(fp).values():
        assert r.tokens == want[r.seq] and r.finish == FinishReason.LENGTH
        assert r.t_picked_ns <= r.t_first_ns and abs(r.t_first_ns - time.monotonic_ns()) < 60e9
    s = shut(rt, mapped)
    assert s.exit_code == structs.EXIT_SHUTDOWN and not s.running
    assert s.counters["windows"] > 50 and s.counters["completed"] == 150
    assert s.counters["launches"] == s.counters["steps_prefill"] + s.counters["steps_decode"]
    assert s.counters["max_window_launches"] <= 4


def test_default_window_rolls_over_under_load(ring_name, device, module):
    """The default window (100 launch attempts, 20 below the device's cap of 120 per graph
    execution) under load: at least 5 roll-overs by tail launch, no window over its limit,
    every token right."""
    from gpu_backend.cuda.config import DEFAULT_WINDOW
    region = ShmRegion.create(ring_name, GEOM.total_size)
    ring = Ring.create(region.buf, GEOM)
    rt, mapped = runtime_on(ring, device, module, idle_sleep_ns=0)
    assert rt.config.window_limit == DEFAULT_WINDOW
    fp, rng, want = FrontendPlayer(ring), np.random.default_rng(12), {}
    for _ in range(40):                   # 8 seats, ~200 tokens each: > 600 steps
        if len(fp.inflight) >= 32:
            for r in drain(fp).values():
                assert r.tokens == want[r.seq]
        prompt = rng.integers(0, 49152, int(rng.integers(1, 20))).tolist()
        n = int(rng.integers(150, 250))
        fp.submit(prompt, n)
        want[fp.next_seq - 1] = echo(prompt, n)
    for r in drain(fp).values():
        assert r.tokens == want[r.seq] and r.finish == FinishReason.LENGTH
    s = shut(rt, mapped)
    print("roll-overs under load:", s.counters)
    assert s.exit_code == structs.EXIT_SHUTDOWN
    assert s.counters["windows"] - 1 >= 5, s.counters
    assert s.counters["max_window_launches"] <= DEFAULT_WINDOW
    assert s.counters["launches"] == s.counters["steps_prefill"] + s.counters["steps_decode"]
    # the survey's warp ballots planned the steady decode steps (every token above is right), and the
    # first ones, checked against the full walks on the device, agreed
    assert 0 < s.counters["fast_plans"] <= s.counters["steps_decode"], s.counters
    assert s.counters["fast_plan_mismatches"] == 0, s.counters


def _device_against_the_walk(ring_name, device, module, unique: int = 40, **cfg):
    """submit_commit_workload (`unique` unique prompts) on the device and through thread 0's walk in the
    twin on the same run: every token; the same prefix cache, key for key (the device's table read
    back), the same hits, misses and steps. Returns the device's counters."""
    region = ShmRegion.create(ring_name, SURVEY_GEOM.total_size)
    ring = Ring.create(region.buf, SURVEY_GEOM)
    fp = FrontendPlayer(ring)
    want = submit_commit_workload(fp, unique)          # before the scheduler starts: one scan sees them all
    rt, mapped = runtime_on(ring, device, module, **{**COMMIT_CFG, **cfg})
    for r in drain(fp, 60).values():
        assert r.tokens == want[r.seq] and r.finish == FinishReason.LENGTH, r.seq
    rt.request_stop()
    assert rt.wait(30), "scheduler did not exit"
    table = prefix_table(rt.read_buffer, rt.config.kv_blocks)   # the device's table, before close frees it
    s = shut(rt, mapped)
    assert s.exit_code == structs.EXIT_SHUTDOWN and s.counters["fast_plan_mismatches"] == 0, s.counters
    # thread 0's walk in the twin, on the same run (a ring in plain memory)
    walk, walk_table = serve_twin_commit_workload(Ring.create(bytearray(SURVEY_GEOM.total_size), SURVEY_GEOM),
                                                  fast_plan=False, unique=unique, **cfg)
    assert table == walk_table
    for name in PREFIX_STATS:
        assert s.counters[name] == getattr(walk.stats, name), name
    return s.counters


def test_the_survey_commits_blocks_in_parallel_on_the_device_as_the_walk(ring_name, device, module):
    """The commit phase on the device (its compare-and-swap inserts, duplicates met in one step, its
    first commits checked by thread 0's walk) against the walk."""
    c = _device_against_the_walk(ring_name, device, module)
    print("parallel commits on the device:", c)
    assert c["par_commits"] > 0, c


def test_the_survey_evicts_blocks_in_parallel_on_the_device_as_the_walk(ring_name, device, module):
    """A pool the workload outgrows: the fill phase's evictions on the device (LRU order, keys marked
    and removed run by run by the block's threads, the first ones checked) against the walk."""
    c = _device_against_the_walk(ring_name, device, module, **EVICT)
    print("parallel evictions on the device:", c)
    assert c["fill_evictions"] > 100, c


def test_the_survey_evicts_on_the_device_as_the_walk_with_the_state_in_device_memory(ring_name, device, module):
    """The evicting commit workload with the loop's params, state, counters and allocator scalars in
    device memory (shared_state=False, blink_scheduler; bench.cuda_scheduler's A/B): the walk's cache
    and counters."""
    c = _device_against_the_walk(ring_name, device, module, shared_state=False, **EVICT)
    print("parallel evictions on the device, state in device memory:", c)
    assert c["fill_evictions"] > 100, c


@pytest.mark.parametrize("num_blocks", [0, 1200])
def test_the_survey_admits_on_the_device_as_the_walk(ring_name, device, module, num_blocks):
    """The PREFILL steps that admit into freed seats, planned from the survey on the device (the first
    32 checked against the full planner there), against thread 0's walks in the twin on the same run:
    every token, the same steps, hits, misses, preemptions and prefix cache (the device's table read
    back); a pool for every seat's context, and one where admissions wait for blocks and decode steps
    preempt."""
    region = ShmRegion.create(ring_name, SURVEY_GEOM.total_size)
    ring = Ring.create(region.buf, SURVEY_GEOM)
    fp = FrontendPlayer(ring)
    want = submit_admission_workload(fp)                 # before the scheduler starts: one scan sees them all
    rt, mapped = runtime_on(ring, device, module, **SURVEY_CFG, num_blocks=num_blocks)
    res = drain(fp, 120)
    assert len(res) == 400
    for r in res.values():
        assert r.tokens == want[r.seq] and r.finish == FinishReason.LENGTH, r.seq
    rt.request_stop()
    assert rt.wait(30), "scheduler did not exit"
    table = prefix_table(rt.read_buffer, rt.config.kv_blocks)
    s = shut(rt, mapped)
    c = s.counters
    print(f"survey admissions on the device ({num_blocks} blocks):", c)
    assert s.exit_code == structs.EXIT_SHUTDOWN and c["fast_plan_mismatches"] == 0, c
    assert 2 * c["fast_admits"] > c["steps_prefill"], c
    walk = serve_admission_workload(Ring.create(bytearray(SURVEY_GEOM.total_size), SURVEY_GEOM), fast_plan=False,
                                    num_blocks=num_blocks)
    assert table == prefix_table(walk.buffer, walk.config.kv_blocks)
    for name in ADMIT_STATS:
        assert c[name] == getattr(walk.stats, name), name


def test_the_survey_at_256_seats_on_the_device(ring_name, device, module):
    """The survey's warp ballots over eight words a round, its reap and the fill phase's blocks at
    256 running on the device (the twin runs the same workload and checks every plan): every token
    right, every KV block back."""
    region = ShmRegion.create(ring_name, SURVEY_GEOM.total_size)
    ring = Ring.create(region.buf, SURVEY_GEOM)
    rt, mapped = runtime_on(ring, device, module, **SURVEY_CFG)
    serve_survey_workload(ring)
    s = shut(rt, mapped)
    print("survey at 256 seats:", s.counters)
    assert s.exit_code == structs.EXIT_SHUTDOWN
    assert s.counters["fast_plans"] > 0 and s.counters["fill_blocks"] > 0 and s.counters["completed"] == 320
    assert s.counters["fast_plan_mismatches"] == 0, s.counters
    # every KV block came back (the exit's last beat publishes the pool on the ring header)
    assert ring.get("kv_blocks_free") == ring.get("kv_blocks_total") == rt.config.kv_blocks


def test_the_frontend_doorbell_starts_the_scans_on_the_device(ring_name, device, module):
    """With the full-scan interval out of reach, the kernel scans the host-mapped slots only when
    the frontend doorbell moved: an idle loop does not scan, a write without the bell waits for
    one, rung submissions and a cancel are served (tests/gpu_backend/cuda/test_twin_doorbell.py
    is the CPU twin's version)."""
    from test_twin_doorbell import NEVER_US, write_without_bell
    region = ShmRegion.create(ring_name, GEOM.total_size)
    ring = Ring.create(region.buf, GEOM)
    rt, mapped = runtime_on(ring, device, module, full_scan_us=NEVER_US, idle_sleep_ns=20_000, max_model_len=8192)
    time.sleep(0.2)
    idle = rt.stats().counters
    assert idle["iterations"] > 100 and idle["scans"] <= 1, idle
    write_without_bell(ring, 5, [1, 2, 3], 4, seq=1)
    time.sleep(0.2)
    assert ring.state[5] == SlotState.PREFILL_PENDING
    fp = FrontendPlayer(ring)
    fp.next_seq = 2
    fp.port.ring_doorbell()
    deadline = time.monotonic() + 10
    while ring.state[5] != SlotState.DECODE_COMPLETED:
        assert time.monotonic() < deadline, "not served after the bell"
        time.sleep(0.001)
    assert ring.tokens(5, 0, 4).tolist() == [1, 2, 3, 1]
    ring.cancel_flags[5] = 0
    ring.state[5] = SlotState.EMPTY
    slots = [fp.submit([7, 8], 30) for _ in range(3)] + [fp.submit([9], 8_000)]   # ~0.2 s of steps
    fp.cancel(slots[-1])
    results = {r.slot: r for r in drain(fp).values()}
    for s in slots[:3]:
        assert (results[s].finish, results[s].tokens) == (FinishReason.LENGTH, echo([7, 8], 30))
    assert results[slots[-1]].finish == FinishReason.ABORT
    s = shut(rt, mapped)
    print("doorbell on the device:", {k: s.counters[k] for k in ("iterations", "scans", "scan_ns")})
    assert s.exit_code == structs.EXIT_SHUTDOWN
    assert s.counters["scans"] < s.counters["iterations"] / 10, s.counters


def test_same_results_as_the_cpu_engine(ring_name, device, module):
    from gpu_backend.engine import Engine, EngineConfig
    from gpu_backend.executors.null import EchoRunner
    from gpu_backend.scheduler.intake import IntakeConfig
    from gpu_backend.scheduler.policy import PolicyConfig, blocks_needed
    region = ShmRegion.create(ring_name, GEOM.total_size)
    ring = Ring.create(region.buf, GEOM)
    rt, mapped = runtime_on(ring, device, module, eos_ids=(7,), window_limit=5, max_batch_size=5,
                            max_prefill_tokens=64, block_size=4)
    got = _serve_workload(ring, drain, 3)
    assert shut(rt, mapped).exit_code == structs.EXIT_SHUTDOWN
    ref = Ring.create(bytearray(GEOM.total_size), GEOM)
    engine = Engine(ref, EchoRunner(), EngineConfig(PolicyConfig(5, 64, 4), 5 * blocks_needed(512, 4)),
                    IntakeConfig(49152, 512, eos_ids=(7,)))

    def engine_drain(fp):
        while any(not fp.done(s) for s in fp.inflight):
            engine.step()
        return drain(fp)

    assert got == _serve_workload(ref, engine_drain, 3)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "lvf"])
def test_same_results_under_each_policy_and_prefix_cache(ring_name, device, module, policy):
    """The device loop under --scheduling-policy with prefix caching, on a trace the twin test
    (test_twin_policies.py) runs: the Python scheduler's outputs, preemption count and prefix-cache
    counters (hits and misses, tokens and blocks) on the ring header."""
    from gpu_backend.scheduler.policy import SchedPolicy, blocks_needed
    from test_twin_policies import MAX_LEN, PREFIX_COUNTERS, _python, _trace
    sp = SchedPolicy[policy.upper()]
    shared = sp != SchedPolicy.LVF           # LVF + tight + shared: the Python scheduler's own MemoryError
    num_blocks = blocks_needed(MAX_LEN, 4) + 4
    trace = _trace(7 + int(sp), shared)
    region = ShmRegion.create(ring_name, GEOM.total_size)
    ring = Ring.create(region.buf, GEOM)
    fp, got = FrontendPlayer(ring), {}
    for prompt, n, params in trace:         # all of it before the loop starts, as the twin test does: one
        fp.submit(prompt, n, **params)      # intake claims it all, so the decisions are the trace's alone
    rt, mapped = runtime_on(ring, device, module, max_batch_size=4, max_prefill_tokens=64, block_size=4,
                            num_blocks=num_blocks, max_model_len=MAX_LEN, scheduling_policy=policy,
                            prefix_caching=True, beat_interval_s=0.002)
    for r in drain(fp).values():
        got[r.seq] = (r.tokens, int(r.finish))
    time.sleep(0.02)                          # a heartbeat after the last step
    stats = shut(rt, mapped)
    counters = {k: int(ring.get(k)) for k in PREFIX_COUNTERS}
    _, want, want_pre, want_prefix = _python(trace, sp, 4, 4, num_blocks)
    assert got == want
    preempted = stats.counters["preempted"]
    assert (preempted, counters) == (want_pre, want_prefix)
    assert preempted > 0 and (counters["prefix_hit_blocks"] > 0 or not shared)


def test_cancel_stale_epoch_and_abort(ring_name, device, module):
    region = ShmRegion.create(ring_name, GEOM.total_size)
    ring = Ring.create(region.buf, GEOM)
    rt, mapped = runtime_on(ring, device, module, max_model_len=8192, grace_s=0.2)
    fp = FrontendPlayer(ring)
    slots = [fp.submit([3, 4, 5], 8000) for _ in range(6)]
    for s in slots[:3]:
        fp.cancel(s)
    ring.set("frontend_epoch", ring.get("frontend_epoch") + 1)
    res = {r.slot: r for r in drain(fp, 20).values()}
    for s in slots[:3]:
        assert res[s].finish == FinishReason.ABORT and res[s].error in (ErrorCode.NONE, ErrorCode.STALE_EPOCH)
    for s in slots[3:]:
        assert (res[s].finish, res[s].error) == (FinishReason.ABORT, ErrorCode.STALE_EPOCH)
    long_ones = [fp.submit([1, 2], 8000) for _ in range(3)]
    time.sleep(0.01)
    s = shut(rt, mapped)          # drain for 0.2 s, then ABORT/BACKEND_SHUTDOWN
    assert s.exit_code == structs.EXIT_SHUTDOWN
    for r in drain(fp, 5).values():
        assert r.slot in long_ones and r.tokens == echo([1, 2], len(r.tokens))
        assert (r.finish, r.error) in ((FinishReason.ABORT, ErrorCode.BACKEND_SHUTDOWN), (FinishReason.LENGTH, 0))


def test_ring_in_device_memory(device, module):
    from gpu_backend.cuda.device_ring import DeviceRing
    from gpu_backend.cuda.runtime import SchedulerRuntime
    geom = RingGeometry(4096, 1 << 18, 1 << 18)
    dring = DeviceRing(geom)
    rt = SchedulerRuntime(device, SchedulerConfig(max_batch_size=64, idle_sleep_ns=0, window_limit=16), geom,
                          dring.device_addr, module)
    rt.start()
    rng = np.random.default_rng(5)
    want = {}
    for i in range(200):
        slot = int(rng.integers(0, 4096)) if i else 4095
        while slot in want:
            slot = (slot + 1) % 4096
        prompt = rng.integers(0, 49152, int(rng.integers(1, 30))).astype(np.int32)
        n = int(rng.integers(1, 60))
        req = SlotRequest(seq=i + 1, prompt_offset=i * 64, prompt_len=len(prompt), output_offset=i * 64, max_tokens=n)
        dring.write_batch(submit_writes(geom, slot, req, prompt) + [doorbell_write(i + 1)])
        want[slot] = (i * 64, echo(prompt.tolist(), n))
    deadline = time.monotonic() + 30
    while True:
        states = np.frombuffer(dring.read(geom.slots_offset, geom.slot_count * SLOT.size), np.uint8)
        st = states.reshape(geom.slot_count, SLOT.size)[:, :4].copy().view("<u4")[:, 0]
        if all(st[s] == SlotState.DECODE_COMPLETED for s in want):
            break
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for slot, (ooff, toks) in want.items():
        out = np.frombuffer(dring.read(geom.output_token_offset(ooff), 4 * len(toks)), "<i4").tolist()
        assert out == toks
    rt.request_stop()
    assert rt.wait(30) and rt.stats().counters["scans"] > 0
    rt.close()
    dring.close()


# -- the real frontend against the daemon process ---------------------------------------------------

def _start_daemon(ring_name: str, *extra: str) -> subprocess.Popen:
    env = child_env()
    return subprocess.Popen([sys.executable, "-m", "dpu_frontend.cli", "gpu-daemon", "--executor", "cuda", "--model",
                             "null", "--ring", ring_name, *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


async def _serve_10k(ring_name: str, n_requests: int, seed: int) -> dict:
    from dpu_frontend.ring_client import QueueFull, RingClient, RingClientConfig, SamplingParams
    from dpu_frontend.transport import shm_factory
    client = RingClient(shm_factory(ring_name), RingClientConfig(max_queue=8192, health_window_s=10.0))
    await client.start()
    deadline = time.monotonic() + 120
    while not client.health().healthy:
        assert time.monotonic() < deadline, client.health()
        await asyncio.sleep(0.05)
    rng = random.Random(seed)
    tally = {"length": 0, "abort": 0, "long": 0, "tokens": 0, "cancelled": 0}
    sem = asyncio.Semaphore(3000)

    async def one(i: int):
        async with sem:
            long_one = rng.random() < 0.02
            prompt = [rng.randrange(49152) for _ in range(rng.randint(1, 64))]
            n = rng.randint(1000, 3000) if long_one else rng.randint(1, 64)
            # ~5% of the short ones and half the long ones are cancelled part way: a long one's cancel
            # mostly comes with hundreds of tokens left, so it reaches the backend before the end
            cancel_after = rng.randint(0, n) if rng.random() < (0.5 if long_one else 0.05) else None
            while True:
                try:
                    h = await client.submit(prompt, SamplingParams(max_tokens=n, ignore_eos=True), queue_timeout_s=60)
                    break
                except QueueFull as e:
                    await asyncio.sleep(e.retry_after_s)
            got: list[int] = []
            cancelled = False
            async for batch in h:
                got.extend(batch)
                if cancel_after is not None and len(got) >= cancel_after:
                    h.cancel()
                    cancel_after, cancelled = None, True
            assert got == echo(prompt, len(got)), f"request {i}: tokens mixed up or duplicated"
            if h.finish_reason == "length":
                assert len(got) == n, f"request {i}: {len(got)} of {n} tokens"
            else:
                assert h.finish_reason == "abort" and cancelled, (i, h.finish_reason, h.error, cancelled)
            tally[h.finish_reason] += 1
            tally["cancelled"] += cancelled
            tally["long"] += long_one and len(got) >= 1000
            tally["tokens"] += len(got)

    await asyncio.gather(*(one(i) for i in range(n_requests)))
    await client.close()
    return tally


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_10k_requests_through_the_frontend_and_daemon(ring_name):
    proc = _start_daemon(ring_name, "--slots", "4096", "--prompt-arena-tokens", str(1 << 22),
                         "--output-arena-tokens", str(1 << 24), "--max-batch-size", "256")
    try:
        tally = asyncio.run(_serve_10k(ring_name, 10_000, seed=2026))
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert tally["length"] + tally["abort"] == 10_000
    # a cancel that reaches the backend after the last token leaves LENGTH (the faster the loop, the
    # more do: 15 of 563 short-heavy cancels aborted on an H200), so aborts are a floor, carried by the
    # long requests' cancels, and every abort was asked for (above)
    assert tally["long"] > 50 and tally["cancelled"] > 300 and tally["abort"] >= 20
    assert "persistent scheduler started" in err
