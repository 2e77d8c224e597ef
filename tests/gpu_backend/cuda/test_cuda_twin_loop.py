"""The persistent scheduler's loop (csrc/sched_loop.h) on CPU threads over a
real shared-memory ring: the same source the kernel runs, with the echo step
inline and the window's tail relaunch replaced by a fresh instance. Checked
against the engine the CPU executor uses (gpu_backend.engine, null runner)."""
from __future__ import annotations

import ctypes
import pathlib
import sys
import threading
import time

import numpy as np
import pytest

from gpu_backend.cuda import structs
from gpu_backend.cuda.config import SchedulerConfig
from gpu_backend.engine import Engine, EngineConfig
from gpu_backend.executors.null import EchoRunner
from gpu_backend.scheduler.intake import IntakeConfig
from gpu_backend.scheduler.policy import PolicyConfig, blocks_needed
from shared_layout import ErrorCode, FinishReason, Ring, RingGeometry, SlotState

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from frontend_player import FrontendPlayer  # noqa: E402

GEOM = RingGeometry(64, 1 << 16, 1 << 16)


def echo(prompt, n):
    return [prompt[i % len(prompt)] for i in range(n)]


def drain(fp: FrontendPlayer, timeout_s: float = 30.0) -> dict:
    """Collect every in-flight request; slot -> Result."""
    out, deadline = {}, time.monotonic() + timeout_s
    while fp.inflight:
        assert time.monotonic() < deadline, f"{len(fp.inflight)} requests never completed"
        for slot in [s for s in fp.inflight if fp.done(s)]:
            r = fp.collect(slot)
            out[r.seq] = r
        time.sleep(0.001)
    return out


def twin(ring, **cfg):
    from gpu_backend.cuda.twin import TwinScheduler
    base = dict(max_batch_size=8, max_model_len=512, idle_sleep_ns=50_000, beat_interval_s=0.005, grace_s=2.0)
    base.update(cfg)
    threads = base.pop("threads", 4)
    cb = base.pop("launch_cb", None)
    tw = TwinScheduler(ring, SchedulerConfig(**base), threads=threads, launch_cb=cb)
    return tw


def stop(tw, abort=False):
    tw.stop(abort)
    assert tw.join(30), "twin scheduler did not exit"
    # every fast plan and survey reap agreed with the full planner and the reap's walk beside it
    assert tw.stats.fast_plan_mismatches == 0
    return tw.exit_code


@pytest.mark.parametrize("shared_state", [True, False], ids=["shared_state", "device_state"])
def test_echo_through_many_launch_windows(twin_lib, shm_ring, shared_state):
    """shared_state: every instance (windows of 3 launches) copies the state into shared memory and writes
    it back at its exit, and the next one starts from there (queue, running list, step number, counters)."""
    ring = shm_ring(GEOM)
    tw = twin(ring, window_limit=3, shared_state=shared_state).start()
    fp, rng, want = FrontendPlayer(ring), np.random.default_rng(1), {}
    for _ in range(120):
        if len(fp.inflight) >= 48:
            for r in drain(fp).values():
                assert r.tokens == want[r.seq] and r.finish == FinishReason.LENGTH
        prompt = rng.integers(0, 49152, int(rng.integers(1, 40))).tolist()
        n = int(rng.integers(1, 80))
        fp.submit(prompt, n)
        want[fp.next_seq - 1] = echo(prompt, n)
    for r in drain(fp).values():
        assert r.tokens == want[r.seq] and r.finish == FinishReason.LENGTH
    assert stop(tw) == structs.EXIT_SHUTDOWN
    s = tw.stats
    assert s.windows > 20 and s.launches == s.steps_prefill + s.steps_decode
    assert s.claimed == s.completed == 120 and s.tokens == sum(len(v) for v in want.values())
    assert tw.control.running == 0 and tw.params.shared_state == shared_state
    assert tw.state.n_running == 0 and tw.state.w_count == 0
    assert twin_lib.blink_twin_ring_rmw() == 0        # no atomic ever touched the ring or the control block


def submit_mixed(fp, rng, shared: list[int], count: int, n_tokens) -> dict:
    """`count` requests, every other one opening with the `shared` prompt prefix, then 1-29 random
    tokens; n_tokens() output tokens each. Returns seq -> the echo it must get."""
    want = {}
    for i in range(count):
        prompt = (shared if i % 2 else []) + rng.integers(0, 49152, int(rng.integers(1, 30))).tolist()
        n = n_tokens()
        fp.submit(prompt, n)
        want[fp.next_seq - 1] = echo(prompt, n)
    return want


SURVEY_GEOM = RingGeometry(512, 1 << 17, 1 << 17)
SURVEY_CFG = dict(max_batch_size=256, block_size=4, max_model_len=256, idle_sleep_ns=0)


def serve_survey_workload(ring, n_requests: int = 320) -> dict:
    """The survey at full width (twin and GPU alike): 256 seats, so a round of the survey covers
    eight ballot words, and more requests than seats with mixed lengths and shared prefixes
    (fast plans, the survey's reap of the early finishers, blocks taken in the fill phase, the
    full planner admitting into freed seats). Checks every token; returns the results."""
    fp, rng = FrontendPlayer(ring), np.random.default_rng(21)
    want = submit_mixed(fp, rng, rng.integers(0, 49152, 12).tolist(), n_requests, lambda: int(rng.integers(5, 90)))
    res = drain(fp, 120)
    assert len(res) == n_requests
    for r in res.values():
        assert r.tokens == want[r.seq] and r.finish == FinishReason.LENGTH, r.seq
    return res


def test_the_survey_at_256_seats(twin_lib, shm_ring):
    ring = shm_ring(SURVEY_GEOM)
    tw = twin(ring, threads=8, **SURVEY_CFG).start()
    serve_survey_workload(ring)
    assert stop(tw) == structs.EXIT_SHUTDOWN            # fast_plan_mismatches == 0 too
    s = tw.stats
    assert s.fast_plans > 0 and s.fill_blocks > 0 and s.completed == 320
    # every KV block came back (the exit's last beat publishes the pool on the ring header)
    assert ring.get("kv_blocks_free") == ring.get("kv_blocks_total") == tw.config.kv_blocks


def test_a_survey_that_disagrees_is_turned_off_and_the_full_walks_serve(twin_lib, shm_ring):
    """A twin built with a planted survey fault (its needy bitmap misses running position 0's
    block) and the device's setting: only the first 32 fast plans checked. The first check that
    meets the fault disagrees with the full planner; that step is served by the full plan, the
    survey is off from then on, and every request still gets its tokens and its blocks back."""
    from gpu_backend.cuda.twin import TwinScheduler
    ring = shm_ring(SURVEY_GEOM)
    tw = TwinScheduler(ring, SchedulerConfig(**SURVEY_CFG, beat_interval_s=0.005), threads=4,
                       defines=("BLINK_PLANT_SURVEY_FAULT",))
    assert tw.params.fast_plan_checks == structs.CHECK_ALWAYS
    tw.params.fast_plan_checks = 32
    tw.start()
    serve_survey_workload(ring)
    tw.stop()
    assert tw.join(30) and tw.exit_code == structs.EXIT_SHUTDOWN
    s, st = tw.stats, tw.state
    assert s.fast_plan_mismatches == 1 and st.fast_plan_off == 1
    assert 0 < st.fast_checked <= 32 and s.fast_plans < st.fast_checked   # the failing one never applied
    assert s.fast_plans < s.steps_decode // 2                              # the full walks served the rest
    assert ring.get("kv_blocks_free") == ring.get("kv_blocks_total")


COMMIT_CFG = dict(max_batch_size=64, block_size=4, max_model_len=128, idle_sleep_ns=0, beat_interval_s=0.005)


def submit_commit_workload(fp, unique: int = 40, tokens: dict | None = None) -> dict:
    """Blocks committed in step, with duplicates: 8 prompts of 5 tokens, 12 copies each, and `unique`
    unique prompts of 3-30 tokens, submitted before the scheduler starts (one scan sees them all, so
    the run is the same run each time, on the twin and on the device). Copies admitted in one step
    compute the same blocks and commit them in the same step (the first in chunk order wins); copies
    admitted later hit the cache. Prefills of one full block and decode steps take the commit phase;
    longer prefills the walk. Returns seq -> the echo it must get (into `tokens`, if given: seq -> (its
    prompt, that echo))."""
    rng, want = np.random.default_rng(5), {}
    prompts = [rng.integers(0, 49152, 5).tolist() for _ in range(8)]
    jobs = [(prompts[i % 8], 24 + 4 * (i % 3)) for i in range(96)]
    jobs += [(rng.integers(0, 49152, int(rng.integers(3, 31))).tolist(), int(rng.integers(4, 40))) for _ in range(unique)]
    for prompt, n in jobs:
        fp.submit(prompt, n)
        want[fp.next_seq - 1] = echo(prompt, n)
        if tokens is not None:
            tokens[fp.next_seq - 1] = (prompt, want[fp.next_seq - 1])
    return want


def prefix_table(buffer, num_blocks: int) -> dict:
    """The prefix cache's table as key -> block, from a scheduler's buffers (`buffer(name, dtype)`),
    checked against the blocks' own keys and the allocator's count."""
    cap = structs.pkv_table_cap(num_blocks)
    keys, blocks = buffer("pkv_table_key", np.uint64)[:cap], buffer("pkv_table_block", np.uint32)[:cap]
    table = {int(k): int(b) for k, b in zip(keys, blocks) if b != 0xFFFF_FFFF}
    pkv = structs.PKV.from_buffer_copy(buffer("pkv", np.uint8)[:ctypes.sizeof(structs.PKV)].tobytes())
    assert pkv.cached == len(table) == int(buffer("pkv_has_key", np.uint32)[:num_blocks].sum())
    key = buffer("pkv_key", np.uint64)
    assert all(int(key[b]) == k for k, b in table.items())   # each block knows its key
    return table


PREFIX_STATS = ("prefix_hit_tokens", "prefix_miss_tokens", "prefix_hit_blocks", "prefix_miss_blocks",
                "steps_prefill", "steps_decode", "preempted", "tokens")


def serve_twin_commit_workload(ring, fast_plan: bool = True, checks: int | None = None, defines=(), unique: int = 40,
                               tokens: dict | None = None, **cfg):
    """submit_commit_workload through the twin (`cfg` over COMMIT_CFG); every token and every KV block
    back. Returns the scheduler (stopped) and its prefix cache's table."""
    from gpu_backend.cuda.twin import TwinScheduler
    fp = FrontendPlayer(ring)
    want = submit_commit_workload(fp, unique, tokens)
    tw = TwinScheduler(ring, SchedulerConfig(**{**COMMIT_CFG, **cfg}, fast_plan=fast_plan), threads=4,
                       defines=defines)
    if checks is not None:
        tw.params.fast_plan_checks = checks
    tw.start()
    for r in drain(fp, 60).values():
        assert r.tokens == want[r.seq] and r.finish == FinishReason.LENGTH, r.seq
    tw.stop()
    assert tw.join(30) and tw.exit_code == structs.EXIT_SHUTDOWN
    assert ring.get("kv_blocks_free") == ring.get("kv_blocks_total")
    return tw, prefix_table(tw.buffer, tw.config.kv_blocks)


def test_blocks_committed_in_parallel_are_the_walks(twin_lib, shm_ring):
    """The commit phase against thread 0's walk (fast_plan=False), on the same run: the same prefix
    cache (every key to the same block), the same hits and misses, the same steps; and thread 0's
    check of every parallel commit (the twin's tests check them all) never disagreed."""
    par, par_table = serve_twin_commit_workload(shm_ring(SURVEY_GEOM))
    walk, walk_table = serve_twin_commit_workload(shm_ring(SURVEY_GEOM), fast_plan=False)
    s, w = par.stats, walk.stats
    assert s.fast_plan_mismatches == 0 and par.state.commit_checked > 0
    assert w.par_commits == 0
    # most of the cache came in parallel (268 of its 432 blocks; the prefills of several blocks go to the
    # walk), and each request's commits move on with it (else every later block waits for the walk)
    assert 2 * s.par_commits > len(par_table)
    assert par_table == walk_table and len(par_table) > 100
    for name in PREFIX_STATS:
        assert getattr(s, name) == getattr(w, name), name
    assert s.prefix_hit_blocks > 0   # (the planted fault below shows copies meeting in one commit phase)


EVICT = dict(unique=200, num_blocks=900)   # the commit workload with 200 unique prompts outgrows 900 blocks


def test_the_cached_keys_are_the_python_schedulers_hash_chains(twin_lib, shm_ring):
    """Every key in the prefix cache after the commit workload is kv_cache.hash_chain's key of a block
    of some request's prompt + output, as the Python scheduler keys it: the loop hashes a prompt read
    from the ring at intake (blink_keys_read, its loads issued 16 at a time) and each generated token
    as it publishes it (blink_key_feed), and most cached blocks hold generated tokens, so a token
    hashed out of turn changes keys here."""
    from gpu_backend.scheduler.kv_cache import hash_chain
    tokens: dict = {}
    _, table = serve_twin_commit_workload(shm_ring(SURVEY_GEOM), tokens=tokens)
    bs = COMMIT_CFG["block_size"]
    chains = {k for prompt, out in tokens.values() for k in hash_chain(prompt + out, bs)}
    prompt_keys = {k for prompt, _ in tokens.values() for k in hash_chain(prompt, bs)}
    assert table and set(table) <= chains
    assert len(set(table) - prompt_keys) > len(table) // 2


KEY_RUNS = {"evictions": EVICT,
            "preemptions, block 3, chunked prefill": dict(unique=120, block_size=3, num_blocks=240, max_prefill_tokens=5),
            "preemptions, block 16": dict(unique=120, block_size=16, num_blocks=45)}


@pytest.mark.parametrize("run", KEY_RUNS)
def test_keys_made_as_tokens_are_published_are_the_ones_read_back_from_the_ring(twin_lib, shm_ring, run):
    """The key chain kept up with the tokens (the prompt at intake, each generated token at publish)
    against a twin built to read every generated token back from the ring for the keys
    (BLINK_KEYS_FROM_RING: the loop before; over the host-mapped ring a block's key cost ~20 us on
    the H200) and one whose chain falls behind now and then (BLINK_KEYS_SKIP_FEED: keys read from
    the ring and fed keys mixed in one chain), on workloads that outgrow their pool (evictions;
    preemptions and recompute; other block sizes, chunked prefill): the same prefix cache, hits,
    misses and steps,
    every key a hash_chain key; and where the chain kept up, publish read no ring token for a key
    (pub_keys_ns counts only the time of ring reads for keys, and the clock is read only around them)."""
    from gpu_backend.scheduler.kv_cache import hash_chain
    cfg, tokens = KEY_RUNS[run], {}
    fed, fed_table = serve_twin_commit_workload(shm_ring(SURVEY_GEOM), tokens=tokens, **cfg)
    bs = cfg.get("block_size", COMMIT_CFG["block_size"])
    assert set(fed_table) <= {k for prompt, out in tokens.values() for k in hash_chain(prompt + out, bs)}
    assert fed.stats.prefix_hit_blocks > 0 and fed.stats.pub_keys_ns == 0
    assert fed.stats.fill_evictions > 100 if run == "evictions" else fed.stats.preempted > 0
    for defines in (("BLINK_KEYS_FROM_RING",), ("BLINK_KEYS_SKIP_FEED",)):
        other, other_table = serve_twin_commit_workload(shm_ring(SURVEY_GEOM), defines=defines, **cfg)
        assert other_table == fed_table and len(fed_table) > 20, defines
        for name in PREFIX_STATS:
            assert getattr(other.stats, name) == getattr(fed.stats, name), (defines, name)
        assert other.stats.pub_keys_ns > 0, defines


def test_blocks_evicted_in_parallel_are_the_walks(twin_lib, shm_ring):
    """A pool the workload outgrows: the decode steps' blocks come from the LRU's cached ones, taken by
    the fill phase in LRU order with their keys removed from the table by every thread at once. Against
    thread 0's walk (blink_pkv_alloc, fast_plan=False) on the same run: the same table, hits, misses,
    evictions and steps; the table checked after every parallel eviction (the twin's tests check all)."""
    par, par_table = serve_twin_commit_workload(shm_ring(SURVEY_GEOM), **EVICT)
    walk, walk_table = serve_twin_commit_workload(shm_ring(SURVEY_GEOM), fast_plan=False, **EVICT)
    s, w = par.stats, walk.stats
    assert s.fast_plan_mismatches == 0 and s.fill_evictions > 100 and w.fill_evictions == 0
    assert par.state.evict_checked > 0                     # each parallel eviction's table checked
    assert par_table == walk_table
    for name in PREFIX_STATS:
        assert getattr(s, name) == getattr(w, name), name
    pkv = [structs.PKV.from_buffer_copy(t.buffer("pkv", np.uint8)[:ctypes.sizeof(structs.PKV)].tobytes())
           for t in (par, walk)]
    assert pkv[0].evictions == pkv[1].evictions > s.fill_evictions // 2
    assert (pkv[0].lru_head, pkv[0].lru_tail, pkv[0].evictable) == (pkv[1].lru_head, pkv[1].lru_tail, pkv[1].evictable)


def test_parallel_evictions_that_break_the_table_are_healed(twin_lib, shm_ring):
    """A twin whose fill phase leaves the evicted keys' marks in the table (planted): the check after
    the first parallel eviction finds them, counts the disagreement, rebuilds the table from the
    blocks' own keys and turns the parallel paths off; the cache ends as the walk's."""
    _, walk_table = serve_twin_commit_workload(shm_ring(SURVEY_GEOM), fast_plan=False, **EVICT)
    tw, table = serve_twin_commit_workload(shm_ring(SURVEY_GEOM), defines=("BLINK_PLANT_EVICT_FAULT",), **EVICT)
    assert tw.stats.fast_plan_mismatches == 1 and tw.state.fast_plan_off == 1 and tw.stats.fill_evictions > 0
    assert table == walk_table


def test_a_commit_phase_that_disagrees_is_turned_off_and_the_walk_commits(twin_lib, shm_ring):
    """A twin built with a planted fault (a candidate whose key an earlier one holds wins too) and
    the device's setting (the first 32 checked): the check that meets it disagrees, that step's
    blocks are committed by the walk, the parallel paths stay off, and the prefix cache is still
    the walk's."""
    _, walk_table = serve_twin_commit_workload(shm_ring(SURVEY_GEOM), fast_plan=False)
    tw, table = serve_twin_commit_workload(shm_ring(SURVEY_GEOM), checks=32, defines=("BLINK_PLANT_COMMIT_FAULT",))
    assert tw.stats.fast_plan_mismatches == 1 and tw.state.fast_plan_off == 1
    assert 0 < tw.state.commit_checked <= 32
    assert table == walk_table


def submit_admission_workload(fp) -> dict:
    """serve_admission_workload's 400 requests (seq -> the echo it must get)."""
    rng = np.random.default_rng(33)
    return submit_mixed(fp, rng, rng.integers(0, 49152, 12).tolist(), 400, lambda: int(rng.integers(5, 90)))


def serve_admission_workload(ring, fast_plan: bool = True, checks: int | None = None, defines=(), num_blocks=0,
                             shared_state: bool | None = None):
    """400 requests of 5-89 output tokens (prompts of 1-29 tokens, every other one behind a shared
    12-token prefix) on 256 seats, submitted before the start (one scan sees them all: the same run
    each time). Requests end at different steps, so most PREFILL steps admit into seats the step
    before freed, with every running request a decoder: the survey's admissions. Every token and every
    KV block back; `num_blocks`: a pool too small for them all (admissions wait for blocks, decode steps
    preempt). Returns the scheduler (stopped)."""
    from gpu_backend.cuda.twin import TwinScheduler
    fp = FrontendPlayer(ring)
    want = submit_admission_workload(fp)
    tw = TwinScheduler(ring, SchedulerConfig(**SURVEY_CFG, beat_interval_s=0.005, fast_plan=fast_plan,
                                             num_blocks=num_blocks), threads=4, defines=defines)
    if checks is not None:
        tw.params.fast_plan_checks = checks
    if shared_state is not None:
        tw.params.shared_state = int(shared_state)
    tw.start()
    res = drain(fp, 120)
    assert len(res) == 400
    for r in res.values():
        assert r.tokens == want[r.seq] and r.finish == FinishReason.LENGTH, r.seq
    tw.stop()
    assert tw.join(30) and tw.exit_code == structs.EXIT_SHUTDOWN
    assert ring.get("kv_blocks_free") == ring.get("kv_blocks_total")
    return tw


ADMIT_STATS = PREFIX_STATS + ("completed", "claimed")


@pytest.mark.parametrize("num_blocks", [0, 1200])
def test_admissions_planned_by_the_survey_are_the_full_planners(twin_lib, shm_ring, num_blocks):
    """Rule 1's PREFILL steps planned from the survey's counts (blink_fast_admit: no walk of the
    running list) against thread 0's walks (fast_plan=False) on the same run: the same steps, hits,
    misses, preemptions and prefix cache, with every admission checked against the full planner
    beside it (the twin's setting), with the first 32 checked (the device's) and with none; a pool
    for every seat's whole context, and one of 1,200 blocks, where an admission leaves the decoders'
    next blocks free (rule 2b's reserve) and decode steps preempt."""
    walk = serve_admission_workload(shm_ring(SURVEY_GEOM), fast_plan=False, num_blocks=num_blocks)
    walk_table = prefix_table(walk.buffer, walk.config.kv_blocks)
    assert walk.stats.fast_admits == walk.stats.fast_plans == 0
    for checks in (None, 0, 32):
        tw = serve_admission_workload(shm_ring(SURVEY_GEOM), checks=checks, num_blocks=num_blocks)
        s = tw.stats
        assert s.fast_plan_mismatches == 0 and tw.state.fast_plan_off == 0
        # most PREFILL steps admit from the survey (the first, with nobody running yet, is the full planner's)
        assert 2 * s.fast_admits > s.steps_prefill > 20, (s.fast_admits, s.steps_prefill)
        assert (s.preempted > 0) == bool(num_blocks)
        if checks is None:                    # every one checked (again where a full window plans it again)
            assert tw.state.admit_checked >= s.fast_admits
        else:
            assert tw.state.admit_checked <= checks and (tw.state.admit_checked > 0) == (checks > 0)
        for name in ADMIT_STATS:
            assert getattr(s, name) == getattr(walk.stats, name), (checks, name)
        assert prefix_table(tw.buffer, tw.config.kv_blocks) == walk_table


def test_an_admission_that_disagrees_is_turned_off_and_the_full_planner_serves(twin_lib, shm_ring):
    """A twin whose survey admissions take one seat too many (planted) and the device's setting (the
    first 32 checked): the first check disagrees, the full planner's plan serves that step, the
    survey is off from then on, and the run is the walk's."""
    walk = serve_admission_workload(shm_ring(SURVEY_GEOM), fast_plan=False)
    tw = serve_admission_workload(shm_ring(SURVEY_GEOM), checks=32, defines=("BLINK_PLANT_ADMIT_FAULT",))
    s = tw.stats
    assert s.fast_plan_mismatches == 1 and tw.state.fast_plan_off == 1
    assert tw.state.admit_checked == 1 and s.fast_admits == 0
    for name in ADMIT_STATS:
        assert getattr(s, name) == getattr(walk.stats, name), name


def test_the_survey_switch_and_its_checks(monkeypatch):
    from gpu_backend.cuda.config import FAST_PLAN_ENV
    assert SchedulerConfig().fast_plan and SchedulerConfig().fast_plan_checks == 32
    monkeypatch.setenv(FAST_PLAN_ENV, "0")           # the lease's one-line fallback: the full walks
    cfg = SchedulerConfig()
    assert not cfg.fast_plan
    p = cfg.params(GEOM, 0, {}, 0)
    assert p.fast_plan == 0 and p.fast_plan_checks == 32
    for bad in (-1, 1 << 32, 2.5):
        with pytest.raises(ValueError, match="fast_plan_checks"):
            SchedulerConfig(fast_plan_checks=bad)


def test_the_host_sees_every_counter(twin_lib, shm_ring):
    """The beat copies every counter of the device's stats to the host-mapped control block, the
    host's only view of them on a GPU (runtime.stats): after the exit's last beat they are equal."""
    ring = shm_ring(GEOM)
    tw = twin(ring, window_limit=3).start()
    fp = FrontendPlayer(ring)
    for i in range(12):
        fp.submit(list(range(1, 6 + i)), 30)
    drain(fp)
    assert stop(tw) == structs.EXIT_SHUTDOWN
    s = tw.stats
    assert s.fast_plans > 0 and s.reap_ns > 0 and s.rows_ns > 0
    assert {k: getattr(tw.control, k) for k in structs.COUNTERS} == {k: getattr(s, k) for k in structs.COUNTERS}


def test_default_window_rolls_over_well_inside_the_device_cap(twin_lib, shm_ring):
    """Under load, with the default window: at least 5 roll-overs, and no instance made more
    launch attempts than its window (the device's cap is 120 per graph execution)."""
    from gpu_backend.cuda.config import DEFAULT_WINDOW, DEVICE_LAUNCH_LIMIT
    assert DEFAULT_WINDOW <= DEVICE_LAUNCH_LIMIT - 20
    ring = shm_ring(GEOM)
    tw = twin(ring, idle_sleep_ns=0).start()
    fp, rng, want = FrontendPlayer(ring), np.random.default_rng(3), {}
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
    assert stop(tw) == structs.EXIT_SHUTDOWN
    s = tw.stats
    assert s.windows - 1 >= 5, (s.windows, s.launches)
    assert s.max_window_launches <= DEFAULT_WINDOW
    assert s.launches <= s.windows * DEFAULT_WINDOW
    assert twin_lib.blink_twin_ring_rmw() == 0


class RefusingEcho:
    """A launch callback: refuses the first `refusals` attempts of every step (as the device
    refuses a graph whose previous launch still winds down), then runs the echo step."""

    def __init__(self, ring, refusals: int):
        self.ring, self.refusals, self.tw = ring, refusals, None
        self.pending = self.refused = self.steps = 0

    def __call__(self, ctx, which) -> int:
        if self.pending < self.refusals:
            self.pending += 1
            self.refused += 1
            return 801                       # any cudaError_t but success
        self.pending = 0
        tw, st = self.tw, self.tw.state
        reqs = (structs.Req * self.ring.geom.slot_count).from_address(tw.buffer("reqs").ctypes.data)
        slots, sample, out = tw.buffer("chunk_slot"), tw.buffer("chunk_sample"), tw.buffer("step_tokens", np.int32)
        for c in range(st.n_chunks):
            if sample[c]:
                r = reqs[int(slots[c])]
                out[c] = self.ring.prompt_arena[r.prompt_offset + r.generated % r.prompt_len]
        self.steps += 1
        tw.buffer("done")[0] = st.step_no
        return 0


def _with_refusals(ring, refusals: int, n_requests: int):
    launcher = RefusingEcho(ring, refusals)
    tw = twin(ring, idle_sleep_ns=0, launch_cb=launcher)
    launcher.tw = tw
    tw.start()
    fp, rng, want = FrontendPlayer(ring), np.random.default_rng(5), {}
    for _ in range(n_requests):
        prompt = rng.integers(0, 49152, int(rng.integers(1, 20))).tolist()
        n = int(rng.integers(20, 60))
        fp.submit(prompt, n)
        want[fp.next_seq - 1] = echo(prompt, n)
    res = drain(fp)
    assert stop(tw) == structs.EXIT_SHUTDOWN
    return tw, launcher, res, want


def test_refused_launches_are_retried_and_counted_toward_the_window(twin_lib, shm_ring):
    tw, launcher, res, want = _with_refusals(shm_ring(GEOM), 2, 24)
    assert all(r.tokens == want[r.seq] and r.finish == FinishReason.LENGTH for r in res.values())
    s = tw.stats
    assert s.launches == launcher.steps and s.launch_retries == launcher.refused == 2 * s.launches
    assert s.windows - 1 >= (3 * s.launches) // 100        # three attempts a step fill a window of 100
    assert s.max_window_launches <= 100 + 2


def test_a_launch_refused_up_to_the_cap_fails_its_step_not_the_cap(twin_lib, shm_ring):
    tw, launcher, res, _ = _with_refusals(shm_ring(GEOM), 10_000, 3)
    assert {r.finish for r in res.values()} == {FinishReason.ERROR}
    assert {r.error for r in res.values()} == {ErrorCode.INTERNAL}
    assert tw.stats.max_window_launches == 120 and launcher.steps == 0


def test_the_window_limits_mirror_the_header(twin_lib):
    from gpu_backend.cuda import config
    assert twin_lib.blink_device_launch_cap() == config.DEVICE_LAUNCH_LIMIT
    assert twin_lib.blink_max_window() == config.MAX_WINDOW == config.DEFAULT_WINDOW
    for bad in (0, config.MAX_WINDOW + 1, config.DEVICE_LAUNCH_LIMIT):
        with pytest.raises(ValueError):
            SchedulerConfig(window_limit=bad)


def test_no_read_modify_write_on_the_ring_in_device_code():
    """Device atomics only on device memory: the loop's only atomics are add_shared and max_shared,
    on the block's shared values, or_bit, block-scoped on its own bitmaps, and cas32, block-scoped on
    the prefix cache's table (the commit phase's inserts); the twin counts one that lands in the ring
    or the control block. The slot claim is a plain store: no CAS on the ring."""
    import re
    csrc = pathlib.Path(__file__).resolve().parents[3] / "gpu_backend" / "csrc"
    calls = []
    for path in sorted(csrc.glob("*")):
        if path.suffix in (".h", ".cuh", ".cu"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                calls += [(path.name, n, m, line) for m in re.findall(r"\b(atomic\w+|cas32)\s*\(", line)]
    assert {(f, m) for f, _, m, _ in calls} <= {("sched_platform.cuh", "atomicAdd_block"),
                                                ("sched_platform.cuh", "atomicMax_block"),
                                                ("sched_platform.cuh", "atomicOr_block"),
                                                ("sched_platform.cuh", "atomicCAS_block"), ("sched_platform.cuh", "cas32"),
                                                ("sched_loop.h", "cas32"), ("bench.cu", "atomicAdd"),
                                                ("bench.cu", "atomicAdd_block")}, calls   # (bench.cu's: shared memory)
    uses = [line for f, _, m, line in calls if (f, m) == ("sched_loop.h", "cas32")]
    assert uses and all("plat.cas32(&pkv->table_block[" in line for line in uses), uses


def _serve_workload(ring, serve_until_idle, rng_seed: int):
    """Submit a mixed workload (stop ids, EOS, ignore_eos, context limit, bad requests); seq -> (tokens, finish, error)."""
    fp, rng = FrontendPlayer(ring), np.random.default_rng(rng_seed)
    results = {}
    for _ in range(60):
        if len(fp.inflight) >= 40:
            results.update(serve_until_idle(fp))
        plen = int(rng.integers(1, 30))
        prompt = rng.integers(0, 50, plen).tolist()
        kind = rng.integers(0, 8)
        params = {}
        n = int(rng.integers(1, 60))
        if kind == 0:
            params["stop_ids"] = (int(rng.choice(prompt)),)
        elif kind == 1:
            params["ignore_eos"] = True
        elif kind == 2:
            prompt = rng.integers(0, 50, 500).tolist()      # 500 + n tokens > max_model_len 512: LENGTH early
        elif kind == 3:
            prompt[0] = 60000                              # outside the vocabulary
        elif kind == 4:
            prompt = [1] * 512                             # prompt_len >= max_model_len
        elif kind == 5:
            params["top_p"] = 0.0                          # invalid sampling parameter
        fp.submit(prompt, n, **params)
    results.update(serve_until_idle(fp))
    return {seq: (r.tokens, int(r.finish), int(r.error)) for seq, r in results.items()}


def test_same_results_as_the_cpu_engine(twin_lib, shm_ring):
    eos = (7,)
    ring = shm_ring(GEOM)
    tw = twin(ring, eos_ids=eos, window_limit=5, max_batch_size=5, max_prefill_tokens=64, block_size=4).start()
    got = _serve_workload(ring, drain, 3)
    assert stop(tw) == structs.EXIT_SHUTDOWN

    ref_ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    policy = PolicyConfig(max_batch_size=5, max_prefill_tokens=64, block_size=4)
    engine = Engine(ref_ring, EchoRunner(), EngineConfig(policy, 5 * blocks_needed(512, 4)),
                    IntakeConfig(49152, 512, eos_ids=eos))

    def engine_drain(fp):
        while any(not fp.done(s) for s in fp.inflight):
            engine.step()
        return drain(fp)

    want = _serve_workload(ref_ring, engine_drain, 3)
    assert got == want
    finishes = {(f, e) for _, f, e in want.values()}
    assert {(FinishReason.STOP, 0), (FinishReason.LENGTH, 0), (FinishReason.ERROR, ErrorCode.INVALID_TOKEN),
            (FinishReason.ERROR, ErrorCode.PROMPT_TOO_LONG), (FinishReason.ERROR, ErrorCode.INVALID_REQUEST)} <= finishes


@pytest.mark.parametrize("threads,together", [(8, False), (2, True)])
def test_a_token_outside_the_vocabulary_anywhere_in_the_prompt_is_refused(twin_lib, shm_ring, threads, together):
    """Intake reads a prompt's ids 16 at a time (blink_tokens_ok): one arrival in a scan of 8 threads
    (the block strides over the prompt) and many at once (a thread per prompt); a bad id at any
    position of a load group (first, last, past the first group, a partial last group) refuses only
    its request."""
    rng = np.random.default_rng(11)
    ring = shm_ring(GEOM)
    fp = FrontendPlayer(ring)
    tw = twin(ring, threads=threads, max_model_len=128).start()
    cases, got = [], {}
    for pos, bad in [(0, 49152), (15, -1), (16, 60000), (17, 49152), (39, 1 << 30), (None, None)]:
        prompt = rng.integers(0, 49152, 40).tolist()
        if pos is not None:
            prompt[pos] = bad
        slot = fp.submit(prompt, 3)
        cases.append((fp.next_seq - 1, prompt, pos))
        if not together:
            got[fp.next_seq - 1] = fp.wait(slot)
    got.update(drain(fp))
    assert len(got) == len(cases)
    for seq, prompt, pos in cases:
        r = got[seq]
        if pos is None:
            assert (r.finish, r.tokens) == (FinishReason.LENGTH, echo(prompt, 3))
        else:
            assert (r.finish, r.error) == (FinishReason.ERROR, ErrorCode.INVALID_TOKEN), pos
    assert stop(tw) == structs.EXIT_SHUTDOWN


def test_preemption_with_a_tight_kv_pool(twin_lib, shm_ring):
    ring = shm_ring(GEOM)
    tw = twin(ring, max_batch_size=8, block_size=4, max_model_len=128, num_blocks=blocks_needed(128, 4) + 6,
              window_limit=7).start()
    fp, rng, want = FrontendPlayer(ring), np.random.default_rng(7), {}
    for _ in range(40):
        prompt = rng.integers(0, 1000, int(rng.integers(10, 40))).tolist()
        n = int(rng.integers(20, 80))
        fp.submit(prompt, n)
        want[fp.next_seq - 1] = echo(prompt, n)
    for r in drain(fp).values():
        assert r.tokens == want[r.seq]
    assert stop(tw) == structs.EXIT_SHUTDOWN
    assert tw.stats.preempted > 0
    # the fast plan gave way to the full planner (rule 3's preemptions) and agreed with it where it stood
    assert tw.stats.fast_plans > 0 and tw.stats.fast_plan_mismatches == 0


@pytest.mark.parametrize("threads,prefix_caching,per_wave,seats", [(4, True, 16, 16), (3, False, 28, 16),
                                                                   (4, False, 90, 80)])
def test_steady_decode_steps_are_planned_by_the_survey(twin_lib, shm_ring, threads, prefix_caching, per_wave, seats):
    """With nobody waiting (16 requests a wave, 16 seats) or every seat taken (28), the decode
    steps come from the survey's fast plan (no walk of the running list by one thread); the
    twin runs the full planner beside every one of them and counts any disagreement. Requests
    cross block boundaries in step and out of step, finish mid-batch (the reap, which frees a
    seat for a waiting one: the full planner's case), and share prompt prefixes (commits
    between survey and plan). 80 seats span three bitmap words: the survey's reap places a kept
    request by the gone ones in the words before its own."""
    ring = shm_ring(GEOM if per_wave <= GEOM.slot_count else RingGeometry(128, 1 << 16, 1 << 16))
    tw = twin(ring, threads=threads, max_batch_size=seats, block_size=4, max_model_len=256,
              prefix_caching=prefix_caching, idle_sleep_ns=0).start()
    fp, rng = FrontendPlayer(ring), np.random.default_rng(11)
    shared = rng.integers(0, 49152, 12).tolist()
    for wave in range(3):                                          # wave 1 crosses block boundaries in step
        want = submit_mixed(fp, rng, shared, per_wave, lambda: 40 if wave == 1 else int(rng.integers(5, 70)))
        for r in drain(fp).values():
            assert r.tokens == want[r.seq] and r.finish == FinishReason.LENGTH
    assert stop(tw) == structs.EXIT_SHUTDOWN
    s = tw.stats
    assert s.fast_plan_mismatches == 0
    assert s.fast_plans >= s.steps_decode // 2, (s.fast_plans, s.steps_decode)
    assert s.fast_plans <= s.steps_decode
    assert s.fill_blocks > 0            # the fill phase took blocks in parallel, as blink_pkv_alloc would have


def test_fcfs_admission_by_seq(twin_lib, shm_ring):
    """Requests pending together are served in submit order (one seat)."""
    ring = shm_ring(GEOM)
    fp = FrontendPlayer(ring)
    for i in range(20):                       # submitted before the scheduler runs: one scan sees them all
        fp.submit([i + 1], 3)
    # scatter the seqs over slots so slot order differs from seq order
    tw = twin(ring, max_batch_size=1).start()
    results = drain(fp)
    assert stop(tw) == structs.EXIT_SHUTDOWN
    order = sorted(results.values(), key=lambda r: r.t_first_ns)
    assert [r.seq for r in order] == sorted(results)


class SlowEcho:
    """A launch callback: the echo in Python with a delay, so a request runs long enough to cancel."""

    def __init__(self, tw, ring, delay_s: float):
        self.tw, self.ring, self.delay_s = tw, ring, delay_s

    def __call__(self, ctx, which) -> int:
        tw, st = self.tw, self.tw.state
        reqs = (structs.Req * self.ring.geom.slot_count).from_address(tw.buffer("reqs").ctypes.data)
        slots, sample, out = tw.buffer("chunk_slot"), tw.buffer("chunk_sample"), tw.buffer("step_tokens", np.int32)
        for c in range(st.n_chunks):
            if sample[c]:
                r = reqs[int(slots[c])]
                out[c] = self.ring.prompt_arena[r.prompt_offset + r.generated % r.prompt_len]
        time.sleep(self.delay_s)
        tw.buffer("done")[0] = st.step_no
        return 0


class InFlightEcho(SlowEcho):
    """A launch callback that returns at once and finishes the step on another thread `delay_s` later,
    as a device-launched graph does: the scheduler's loop goes on while the step is in flight. Before
    it raises the done flag it notes any of the step's slots already completed under it."""

    def __init__(self, tw, ring, fp, delay_s: float):
        super().__init__(tw, ring, delay_s)
        self.fp, self.completed_under_step, self.steps, self.threads = fp, [], 0, []

    def __call__(self, ctx, which) -> int:
        tw, st = self.tw, self.tw.state
        reqs = (structs.Req * self.ring.geom.slot_count).from_address(tw.buffer("reqs").ctypes.data)
        slots, sample, out = tw.buffer("chunk_slot"), tw.buffer("chunk_sample"), tw.buffer("step_tokens", np.int32)
        mine = [int(slots[c]) for c in range(st.n_chunks)]
        for c in range(st.n_chunks):
            if sample[c]:
                r = reqs[mine[c]]
                out[c] = self.ring.prompt_arena[r.prompt_offset + r.generated % r.prompt_len]
        step_no = st.step_no

        def finish():
            time.sleep(self.delay_s)
            self.completed_under_step += [s for s in mine if self.fp.done(s)]
            self.steps += 1
            tw.buffer("done")[0] = step_no

        self.threads.append(threading.Thread(target=finish, daemon=True))
        self.threads[-1].start()
        return 0


@pytest.mark.parametrize("how", ["abort", "drain_deadline"])
def test_an_abort_waits_for_the_step_in_flight(twin_lib, shm_ring, how):
    """An abort (or a drain whose grace runs out) while a step is in flight ends every request only
    once that step is done: the step still reads their copies and seats and writes their logprob
    records into the ring, so their slots must not go back to the frontend under it."""
    ring = shm_ring(GEOM)
    fp, holder = FrontendPlayer(ring), {}
    tw = twin(ring, launch_cb=lambda ctx, which: holder["cb"](ctx, which), max_model_len=8192,
              grace_s=0.3 if how == "drain_deadline" else 2.0)   # the wait for the step: within the grace
    holder["cb"] = cb = InFlightEcho(tw, ring, fp, 0.15)
    tw.start()
    slots = [fp.submit([3, 4, 5], 4000) for _ in range(4)]
    deadline = time.monotonic() + 10
    while cb.steps < 3:                      # the requests run; a step is in flight most of the time
        assert time.monotonic() < deadline
        time.sleep(0.01)
    tw.stop(abort=how == "abort")
    assert tw.join(10) and tw.exit_code == structs.EXIT_SHUTDOWN
    for t in cb.threads:                     # every step launched has finished
        t.join(5)
    assert cb.completed_under_step == []
    for s in slots:
        r = fp.collect(s)
        assert (r.finish, r.error) == (FinishReason.ABORT, ErrorCode.BACKEND_SHUTDOWN)
        assert r.tokens == echo([3, 4, 5], len(r.tokens))


def test_an_abort_waits_for_a_stuck_step_only_within_the_grace(twin_lib, shm_ring):
    """A step that does not finish (a hung graph): the abort waits for it at most the drain's grace
    period, beating meanwhile, then ends the requests anyway; the scheduler exits long before the
    step timeout, inside the host's wait for it."""
    ring = shm_ring(GEOM)
    fp, holder = FrontendPlayer(ring), {}
    tw = twin(ring, launch_cb=lambda ctx, which: holder["cb"](ctx, which), max_model_len=8192, grace_s=0.5)
    holder["cb"] = cb = InFlightEcho(tw, ring, fp, 0.05)
    tw.start()
    slots = [fp.submit([3, 4, 5], 4000) for _ in range(2)]
    deadline = time.monotonic() + 10
    while cb.steps < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    cb.delay_s = 8.0                          # the next step hangs (past this test's waits)
    steps = cb.steps
    while len(cb.threads) <= steps + 1:       # it has been launched
        assert time.monotonic() < deadline
        time.sleep(0.005)
    beats = tw.stats.heartbeat
    t0 = time.monotonic()
    tw.stop(abort=True)
    assert tw.join(5) and tw.exit_code == structs.EXIT_SHUTDOWN
    assert 0.4 < time.monotonic() - t0 < 3.0  # the grace (0.5 s), not the step timeout (30 s)
    assert tw.stats.heartbeat > beats + 10    # beating while it waited (every 5 ms)
    for s in slots:
        assert fp.collect(s).finish == FinishReason.ABORT


def _slow_twin(ring, **cfg):
    holder = {}
    tw = twin(ring, launch_cb=lambda ctx, which: holder["cb"](ctx, which), **cfg)
    holder["cb"] = SlowEcho(tw, ring, 0.001)
    return tw


def test_cancel_and_stale_epoch_end_requests_within_a_step(twin_lib, shm_ring):
    ring = shm_ring(GEOM)
    tw = _slow_twin(ring, max_model_len=8192).start()
    fp = FrontendPlayer(ring)
    slots = [fp.submit([3, 4, 5], 4000) for _ in range(6)]
    time.sleep(0.05)
    for s in slots[:3]:
        fp.cancel(s)
    time.sleep(0.05)
    ring.set("frontend_epoch", ring.get("frontend_epoch") + 1)     # a restarted frontend
    results = drain(fp, 10)
    assert stop(tw) == structs.EXIT_SHUTDOWN
    by_slot = {r.slot: r for r in results.values()}
    for s in slots[:3]:
        assert (by_slot[s].finish, by_slot[s].error) == (FinishReason.ABORT, ErrorCode.NONE)
    for s in slots[3:]:
        assert (by_slot[s].finish, by_slot[s].error) == (FinishReason.ABORT, ErrorCode.STALE_EPOCH)
    for r in results.values():                                    # tokens published before the end are echoes
        assert 0 < len(r.tokens) < 4000 and r.tokens == echo([3, 4, 5], len(r.tokens))


def test_cancels_of_waiting_and_running_requests_are_reaped_and_the_rest_go_on(twin_lib, shm_ring):
    """Two seats, six long requests: cancel two still waiting and one running. The schedule phase
    walks its waiting and running lists only when the scan flags a cancel (sched_loop.h): each
    cancelled one ends ABORT (a waiting one with no tokens), the others finish LENGTH with echoes."""
    ring = shm_ring(GEOM)
    tw = _slow_twin(ring, max_batch_size=2, max_model_len=8192).start()
    fp = FrontendPlayer(ring)
    slots = [fp.submit([7, 8, 9], 300) for _ in range(6)]
    deadline = time.monotonic() + 10
    while sum(ring.state[s] == SlotState.DECODE_PROCESSING for s in slots) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    running = [s for s in slots if ring.state[s] == SlotState.DECODE_PROCESSING]
    waiting = [s for s in slots if s not in running]
    cancelled = {running[0], waiting[-1], waiting[-2]}
    for s in cancelled:
        fp.cancel(s)
    results = {r.slot: r for r in drain(fp, 30).values()}
    assert stop(tw) == structs.EXIT_SHUTDOWN
    for s in slots:
        r = results[s]
        if s in cancelled:
            assert (r.finish, r.error) == (FinishReason.ABORT, ErrorCode.NONE), s
            assert r.tokens == echo([7, 8, 9], len(r.tokens)) and len(r.tokens) < 300
            if s in waiting[-2:]:
                assert r.tokens == []
        else:
            assert r.finish == FinishReason.LENGTH and r.tokens == echo([7, 8, 9], 300), s


def test_stop_drains_in_flight_within_the_grace_period(twin_lib, shm_ring):
    ring = shm_ring(GEOM)
    tw = _slow_twin(ring, grace_s=5.0).start()
    fp = FrontendPlayer(ring)
    slots = [fp.submit([9, 8], 50) for _ in range(4)]
    deadline = time.monotonic() + 10
    while any(ring.state[s] == SlotState.PREFILL_PENDING for s in slots):   # claimed: in flight, not waiting
        assert time.monotonic() < deadline
        time.sleep(0.001)
    tw.stop()
    assert tw.join(20)
    assert tw.exit_code == structs.EXIT_SHUTDOWN
    late = fp.submit([1], 5)                                     # after the stop: never claimed
    results = drain_except(fp, late)
    assert all(r.finish == FinishReason.LENGTH and r.tokens == echo([9, 8], 50) for r in results)
    assert ring.state[late] == SlotState.PREFILL_PENDING


def drain_except(fp, keep):
    deadline = time.monotonic() + 10
    out = []
    while set(fp.inflight) - {keep}:
        assert time.monotonic() < deadline
        for slot in [s for s in fp.inflight if s != keep and fp.done(s)]:
            out.append(fp.collect(slot))
        time.sleep(0.001)
    return out


def test_grace_expiry_and_abort_end_requests_backend_shutdown(twin_lib, shm_ring):
    ring = shm_ring(GEOM)
    tw = _slow_twin(ring, grace_s=0.05, max_model_len=8192).start()
    fp = FrontendPlayer(ring)
    for _ in range(3):
        fp.submit([1, 2], 3000)
    time.sleep(0.05)
    tw.stop()
    assert tw.join(10) and tw.exit_code == structs.EXIT_SHUTDOWN
    for r in drain(fp, 5).values():
        assert (r.finish, r.error) == (FinishReason.ABORT, ErrorCode.BACKEND_SHUTDOWN)
        assert r.tokens == echo([1, 2], len(r.tokens))


def test_ring_shutdown_word_and_heartbeat(twin_lib, shm_ring):
    ring = shm_ring(GEOM)
    tw = twin(ring, beat_interval_s=0.002).start()
    b0 = ring.get("backend_heartbeat")
    time.sleep(0.1)
    b1 = ring.get("backend_heartbeat")
    assert b1 > b0 and abs(ring.get("backend_heartbeat_ns") - time.monotonic_ns()) < 1e9
    assert tw.control.running == 1 and tw.control.heartbeat > 0
    ring.set("shutdown", 1)
    assert tw.join(10) and tw.exit_code == structs.EXIT_SHUTDOWN
    assert tw.control.running == 0
    assert ctypes.sizeof(tw.control) == ctypes.sizeof(structs.SchedControl)


def test_external_buffers_and_a_launch_callback(twin_lib, shm_ring):
    """The host-driven baseline's shape: buffers the caller owns (pinned memory on a GPU box), the
    step run by a callback that stores the done flag itself."""
    ring = shm_ring(GEOM)
    cfg = SchedulerConfig(max_batch_size=4, max_model_len=512, idle_sleep_ns=50_000)
    owned = {k: (ctypes.c_uint64 * -(-n // 8))() for k, n in cfg.buffer_sizes(GEOM.slot_count).items()}
    from gpu_backend.cuda.twin import TwinScheduler
    holder = {}
    tw = TwinScheduler(ring, cfg, threads=1, launch_cb=lambda c, w: holder["cb"](c, w),
                       buffers={k: ctypes.addressof(v) for k, v in owned.items()})
    holder["cb"] = SlowEcho(tw, ring, 0.0)
    tw.start()
    fp = FrontendPlayer(ring)
    for i in range(10):
        fp.submit([i, i + 1, i + 2], 20)
    for r in drain(fp).values():
        assert r.tokens == echo([r.seq - 1, r.seq, r.seq + 1], 20)
    assert stop(tw) == structs.EXIT_SHUTDOWN
    assert structs.SchedState.from_address(ctypes.addressof(owned["state"])).step_no == tw.stats.launches > 0
