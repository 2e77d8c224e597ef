"""The persistent loop's scheduling policies and prefix cache (csrc/sched_loop.h through
blink_plan_step_policy and kv_alloc.h's blink_pkv_*) against the Python scheduler package,
on the same traces:

    one trace, submitted before either side runs (one scan / one intake claims it all)
      twin:   TwinScheduler(SchedulerConfig(scheduling_policy=..., prefix_caching=True)), the
              echo step in a launch callback that records every step's chunks
      Python: Engine(EngineConfig(PolicyConfig(policy=...), prefix_caching=True)) with a
              runner that records the same
    -> the same steps (slot, first position, tokens of each chunk: admissions, preemptions and
       recompute show in them), the same outputs, the same preemption count and the same
       prefix-cache counters on the ring header (hits and misses, tokens and blocks)

Tight pools force preemption; prompts sharing a long prefix show hits. Then the model's
step graphs on the CPU (tiny random model): a prefix-sharing trace gives the CPU executor's
greedy tokens while reading the shared blocks.
"""
from __future__ import annotations

import pathlib
import sys
import time

import numpy as np
import pytest

from gpu_backend.cuda import structs
from gpu_backend.cuda.config import SchedulerConfig
from gpu_backend.engine import Engine, EngineConfig
from gpu_backend.executors.null import EchoRunner
from gpu_backend.scheduler.intake import IntakeConfig
from gpu_backend.scheduler.policy import PolicyConfig, SchedPolicy, blocks_needed
from shared_layout import Ring, RingGeometry

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from frontend_player import FrontendPlayer  # noqa: E402

GEOM = RingGeometry(64, 1 << 16, 1 << 16)
MAX_LEN = 128
PREFIX_COUNTERS = ("prefix_hit_tokens", "prefix_miss_tokens", "prefix_hit_blocks", "prefix_miss_blocks")


def _trace(seed: int, shared: bool):
    """[(prompt, max_tokens, params)]: mixed lengths and priorities; with `shared`, most prompts
    start with one of two long prefixes (several blocks)."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 1000, 37).tolist(), rng.integers(0, 1000, 21).tolist()]
    out = []
    for i in range(24):
        tail = rng.integers(0, 1000, int(rng.integers(1, 12))).tolist()
        prompt = (prefixes[i % 2] + tail) if shared and i % 5 else rng.integers(0, 1000, int(rng.integers(5, 40))).tolist()
        out.append((prompt, int(rng.integers(5, 50)), dict(priority=int(rng.integers(-2, 3)))))
    return out


class Recorder:
    """Echo tokens; each step's chunks as (slot, start, tokens)."""

    def __init__(self):
        self.steps = []


def _python(trace, policy: SchedPolicy, batch: int, block: int, num_blocks: int, prefix: bool = True):
    ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    rec, echo = Recorder(), EchoRunner()

    class Runner:
        def run(self, batch_):
            rec.steps.append(tuple((c.seq.slot, c.start, c.num_tokens) for c in batch_.chunks))
            return echo.run(batch_)

    engine = Engine(ring, Runner(), EngineConfig(PolicyConfig(batch, 64, block, policy=policy), num_blocks,
                                                 prefix_caching=prefix), IntakeConfig(49152, MAX_LEN))
    fp = FrontendPlayer(ring)
    for prompt, n, params in trace:
        fp.submit(prompt, n, **params)
    out, preempted, pause = {}, [], engine._pause
    engine._pause = lambda victims: (preempted.extend(victims), pause(victims))
    deadline = time.monotonic() + 60
    while fp.inflight:
        assert time.monotonic() < deadline
        engine.step()
        for s in [s for s in fp.inflight if fp.done(s)]:
            r = fp.collect(s)
            out[r.seq] = (r.tokens, int(r.finish))
    return rec.steps, out, len(preempted), {k: int(ring.get(k)) for k in PREFIX_COUNTERS}


def _twin(ring, trace, policy: SchedPolicy, batch: int, block: int, num_blocks: int, prefix: bool = True):
    from gpu_backend.cuda.twin import TwinScheduler
    rec, holder = Recorder(), {}

    def launch(ctx, which) -> int:
        tw = holder["tw"]
        st = tw.state
        reqs = (structs.Req * ring.geom.slot_count).from_address(tw.buffer("reqs").ctypes.data)
        slots, starts, lens = tw.buffer("chunk_slot"), tw.buffer("chunk_start"), tw.buffer("chunk_len")
        sample, out = tw.buffer("chunk_sample"), tw.buffer("step_tokens", np.int32)
        rec.steps.append(tuple((int(slots[c]), int(starts[c]), int(lens[c])) for c in range(st.n_chunks)))
        for c in range(st.n_chunks):
            if sample[c]:
                r = reqs[int(slots[c])]
                out[c] = ring.prompt_arena[r.prompt_offset + r.generated % r.prompt_len]
        tw.buffer("done")[0] = st.step_no
        return 0

    fp = FrontendPlayer(ring)
    for prompt, n, params in trace:
        fp.submit(prompt, n, **params)
    cfg = SchedulerConfig(max_batch_size=batch, max_prefill_tokens=64, block_size=block, num_blocks=num_blocks,
                          max_model_len=MAX_LEN, idle_sleep_ns=20_000, beat_interval_s=0.002,
                          scheduling_policy=policy.name.lower(), prefix_caching=prefix)
    tw = holder["tw"] = TwinScheduler(ring, cfg, threads=2, launch_cb=launch)
    tw.start()                                   # after holder has it: the first launch reads it
    out, deadline = {}, time.monotonic() + 60
    try:
        while fp.inflight:
            assert time.monotonic() < deadline
            for s in [s for s in fp.inflight if fp.done(s)]:
                r = fp.collect(s)
                out[r.seq] = (r.tokens, int(r.finish))
            time.sleep(0.001)
        time.sleep(0.01)       # a heartbeat after the last step: the header's counters
    finally:
        tw.stop()
        assert tw.join(20) and tw.exit_code == structs.EXIT_SHUTDOWN
    pkv = structs.PKV.from_address(tw.buffer("pkv").ctypes.data)
    assert tw.state.free_blocks == num_blocks == pkv.never_cached + pkv.evictable and pkv.extra_refs == 0
    return rec.steps, out, int(tw.stats.preempted), {k: int(ring.get(k)) for k in PREFIX_COUNTERS}


@pytest.mark.parametrize("shared", [False, True], ids=["distinct", "shared-prefix"])
@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "tight"])
@pytest.mark.parametrize("policy", list(SchedPolicy), ids=lambda p: p.name.lower())
def test_twin_loop_decides_as_the_python_scheduler(twin_lib, shm_ring, policy, tight, shared):
    block, batch = 4, 4
    num_blocks = blocks_needed(MAX_LEN, block) + (4 if tight else 200)
    trace = _trace(7 + int(policy), shared)
    want_steps, want_out, want_pre, want_prefix = _python(trace, policy, batch, block, num_blocks)
    got_steps, got_out, got_pre, got_prefix = _twin(shm_ring(GEOM), trace, policy, batch, block, num_blocks)
    assert got_out == want_out
    for i, (g, w) in enumerate(zip(got_steps, want_steps)):
        assert g == w, f"step {i}: twin {g} python {w}"
    assert len(got_steps) == len(want_steps)
    assert got_pre == want_pre
    assert got_prefix == want_prefix
    if tight:
        assert got_pre > 0
    if shared:
        assert got_prefix["prefix_hit_blocks"] > 10 and got_prefix["prefix_hit_tokens"] > 40
    elif not tight:
        assert got_prefix["prefix_hit_blocks"] == 0


def test_prefix_caching_off_on_the_twin(twin_lib, shm_ring):
    """--no-prefix-caching: no lookups, no commits, no hits; the Python scheduler's decisions."""
    num_blocks = blocks_needed(MAX_LEN, 4) + 4
    trace = _trace(3, True)
    want = _python(trace, SchedPolicy.FCFS, 4, 4, num_blocks, prefix=False)
    got = _twin(shm_ring(GEOM), trace, SchedPolicy.FCFS, 4, 4, num_blocks, prefix=False)
    assert got == want
    assert got[3]["prefix_hit_blocks"] == 0 and got[3]["prefix_miss_blocks"] > 0


def test_priority_order_on_the_twin(twin_lib, shm_ring):
    """One seat, requests pending together: PRIORITY serves the lowest priority value first (then
    arrival), FCFS the submit order."""
    trace = [([i + 1, i + 2], 3, dict(priority=p)) for i, p in enumerate([2, 0, 1, 0, -1, 2])]
    for policy, want in ((SchedPolicy.PRIORITY, [4, 1, 3, 2, 0, 5]), (SchedPolicy.FCFS, [0, 1, 2, 3, 4, 5])):
        steps, out, _, _ = _twin(shm_ring(GEOM), trace, policy, 1, 4, blocks_needed(MAX_LEN, 4) + 8)
        first = []
        for step in steps:
            for slot, _, _ in step:
                if slot not in first:
                    first.append(slot)
        assert first == want, policy


# --- the model's step graphs on the CPU: shared blocks read back ------------------------------------

def test_prefix_sharing_through_cpu_graphs_gives_the_cpu_executors_tokens(twin_lib, shm_ring):
    from gpu_backend.cuda.twin import TwinScheduler
    from gpu_backend.executors import ExecutorOptions
    from gpu_backend.executors.cpu import CpuExecutor
    from gpu_backend.graphs.buckets import BucketConfig, BucketTable
    from gpu_backend.graphs.cpu_graphs import CpuGraphs
    from gpu_backend.model import LlamaModel, tiny_config
    model = LlamaModel.random(tiny_config(), seed=5)
    bs, batch, budget = 4, 4, 48
    prefix = list(range(100, 127))                  # 27 tokens: 6 full blocks shared
    work = [(prefix + [200 + i, 300 + i], 10, dict(ignore_eos=True)) for i in range(6)]
    geom = RingGeometry(64, 1 << 14, 1 << 14)

    def serve(ring, step):
        fp = FrontendPlayer(ring)
        slots = [fp.submit(p, n, **kw) for p, n, kw in work[:1]]
        while not fp.done(slots[0]):
            step()
        first = fp.collect(slots[0]).tokens
        slots = [fp.submit(p, n, **kw) for p, n, kw in work[1:]]   # after the first: its blocks are cached
        out, deadline = {}, time.monotonic() + 120
        while len(out) < len(slots):
            assert time.monotonic() < deadline
            step()
            for i, s in enumerate(slots):
                if i not in out and fp.done(s):
                    out[i] = fp.collect(s).tokens
        return [first] + [out[i] for i in range(len(slots))]

    ref_ring = Ring.create(bytearray(geom.total_size), geom)
    cpu = CpuExecutor(ExecutorOptions(model="tiny", max_batch_size=batch, max_prefill_tokens=budget, block_size=bs,
                                      kv_cache_mb=1, max_model_len=MAX_LEN), model=model)
    want = serve(ref_ring, cpu.engine(ref_ring).step)

    table = BucketTable(BucketConfig(max_batch_size=batch, max_prefill_tokens=budget, max_model_len=MAX_LEN,
                                     block_size=bs, split_len=16, len_granularity=4))
    graphs = CpuGraphs(model, table, 200)
    cfg = SchedulerConfig(max_batch_size=batch, max_prefill_tokens=budget, block_size=bs, num_blocks=200,
                          max_model_len=MAX_LEN, vocab_size=model.config.vocab_size, launch_retry_limit=0,
                          idle_sleep_ns=20_000, beat_interval_s=0.002)
    holder = {}
    ring = shm_ring(geom)
    tw = holder["tw"] = TwinScheduler(ring, cfg, threads=2, launch_cb=graphs.launch_cb(lambda: holder["tw"].params_addr),
                                      graphs=graphs.graph_table(), max_rows=table.max_rows)
    tw.start()
    try:
        got = serve(ring, lambda: time.sleep(0.002))
        time.sleep(0.01)
    finally:
        tw.stop()
        assert tw.join(20) and tw.exit_code == structs.EXIT_SHUTDOWN
    assert got == want
    assert tw.stats.prefix_hit_blocks == 5 * 6 and tw.stats.prefix_hit_tokens == 5 * 24
    assert int(ring.get("prefix_hit_blocks")) == 30 and int(ring.get("prefix_caching")) == 1
    assert int(ref_ring.get("prefix_hit_blocks")) == 30


def test_the_daemons_options_reach_the_parameter_block():
    from gpu_backend.cuda.config import scheduling_fields
    from gpu_backend.executors import ExecutorOptions
    opts = ExecutorOptions(scheduling_policy="lvf", prefix_caching=False, ttft_slo_ms=700, tbt_slo_ms=40)
    cfg = SchedulerConfig(max_batch_size=4, block_size=4, max_model_len=64, **scheduling_fields(opts))
    p = cfg.params(GEOM, 0, {}, 0)
    assert (p.rules.policy, p.prefix_caching, p.ttft_slo_us, p.tbt_slo_us) == (structs.POLICY_LVF, 0, 700_000, 40_000)
    assert (p.rules.lvf_alpha_milli, p.rules.lvf_beta_f_milli) == (3000, 500)     # policy.PolicyConfig's defaults
    assert p.pkv_table_cap >= 2 * cfg.kv_blocks and p.pkv_table_cap & (p.pkv_table_cap - 1) == 0
    with pytest.raises(ValueError):
        SchedulerConfig(scheduling_policy="sjf")
