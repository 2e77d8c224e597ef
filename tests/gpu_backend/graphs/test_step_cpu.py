"""The step graphs' computation on the CPU, end to end, against the references:

    host loop:  Engine (B's policy, allocator, publishing) + HostLoopRunner ->
                C++ staging (csrc/model_step.h) + StepFunction + finish, eager
    persistent: the scheduler's CPU twin (csrc/sched_loop.h on host threads, the
                device KV allocator, graph lookup and rows) launching the same
                CPU graphs

Greedy tokens must equal greedy_generate (the unbatched dense reference) and
the CPU executor's, through chunked prefill, split rows, preemption and the
max-shape fallback; seeded sampling must reproduce itself on both paths."""
from __future__ import annotations

import ctypes
import pathlib
import sys
import time

import numpy as np
import pytest
import torch

from gpu_backend.cuda import structs
from gpu_backend.cuda.config import SchedulerConfig
from gpu_backend.engine import Engine, EngineConfig
from gpu_backend.executors import ExecutorOptions
from gpu_backend.graphs.buckets import ROW_SAMPLE, BucketConfig, BucketTable
from gpu_backend.graphs.cpu_graphs import CpuGraphs
from gpu_backend.graphs.hostloop import CpuLauncher, HostLoopRunner, StepBlock
from gpu_backend.scheduler.intake import IntakeConfig
from gpu_backend.model import greedy_generate
from gpu_backend.scheduler.policy import PolicyConfig, blocks_needed
from shared_layout import FinishReason, Ring, RingGeometry

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from frontend_player import FrontendPlayer  # noqa: E402

GEOM = RingGeometry(64, 1 << 14, 1 << 14)
MAX_LEN, BS, BATCH, BUDGET = 128, 4, 4, 48
BUCKETS = BucketConfig(max_batch_size=BATCH, max_prefill_tokens=BUDGET, max_model_len=MAX_LEN, block_size=BS,
                       split_len=16, len_granularity=4)


def workload(vocab: int, n: int, seed: int, sampled: bool = False):
    """(prompt, max_tokens, params) triples: prompts from 1 to 60 tokens (longer than split_len and
    than the prefill budget: chunked, split rows), outputs up to 40."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(3, vocab, int(rng.integers(1, 61))).tolist()
        params = dict(ignore_eos=True)
        if sampled:
            params.update(temperature=float(rng.choice([0.7, 1.0, 1.5])), top_p=float(rng.choice([0.8, 1.0])),
                          top_k=int(rng.choice([0, 5, 50])), seed=int(rng.integers(0, 2**62)))
        out.append((prompt, int(rng.integers(1, 41)), params))
    return out


def serve_engine(ring: Ring, engine: Engine, work) -> list[list[int]]:
    fp = FrontendPlayer(ring)
    for prompt, n, params in work:             # all pending before the first step: deterministic batches
        fp.submit(prompt, n, **params)
    res = {}
    deadline = time.monotonic() + 120
    while fp.inflight:
        assert time.monotonic() < deadline
        engine.step()
        for s in [s for s in fp.inflight if fp.done(s)]:
            r = fp.collect(s)
            res[r.seq] = r
    assert all(r.finish == FinishReason.LENGTH for r in res.values())
    return [res[i + 1].tokens for i in range(len(work))]


def hostloop_engine(model, ring: Ring, num_blocks: int, table: BucketTable | None = None):
    table = table or BucketTable(BUCKETS)
    graphs = CpuGraphs(model, table, num_blocks)
    block = StepBlock(BATCH, table.max_rows, blocks_needed(MAX_LEN, BS))
    runner = HostLoopRunner(ring, block, CpuLauncher(graphs, block, ring), table)
    engine = Engine(ring, runner, EngineConfig(PolicyConfig(BATCH, BUDGET, BS), num_blocks),
                    IntakeConfig(model.config.vocab_size, MAX_LEN, ()))
    return engine, runner


def serve_twin(model, ring: Ring, num_blocks: int, work, table: BucketTable | None = None, threads: int = 2,
               kernels: str = "torch"):
    from gpu_backend.cuda.twin import TwinScheduler
    table = table or BucketTable(BUCKETS)
    graphs = CpuGraphs(model, table, num_blocks, kernels)
    cfg = SchedulerConfig(max_batch_size=BATCH, max_prefill_tokens=BUDGET, block_size=BS, num_blocks=num_blocks,
                          max_model_len=MAX_LEN, vocab_size=model.config.vocab_size, launch_retry_limit=0,
                          idle_sleep_ns=20_000, beat_interval_s=0.005)
    fp = FrontendPlayer(ring)
    for prompt, n, params in work:             # pending before the scheduler starts: one scan sees them all
        fp.submit(prompt, n, **params)
    holder = {}
    tw = TwinScheduler(ring, cfg, threads=threads, launch_cb=graphs.launch_cb(lambda: holder["tw"].params_addr),
                       graphs=graphs.graph_table(), max_rows=table.max_rows)
    holder["tw"] = tw
    tw.start()
    res, deadline = {}, time.monotonic() + 120
    while fp.inflight:
        assert time.monotonic() < deadline, "twin did not finish"
        for s in [s for s in fp.inflight if fp.done(s)]:
            r = fp.collect(s)
            res[r.seq] = r
        time.sleep(0.002)
    tw.stop()
    assert tw.join(20) and tw.exit_code == structs.EXIT_SHUTDOWN
    assert tw.state.free_blocks == num_blocks                       # every KV block came back
    assert tw.stats.fast_plan_mismatches == 0                       # survey plans and reaps = the full walks
    return [res[i + 1].tokens for i in range(len(work))], tw, graphs


def test_hostloop_greedy_equals_the_reference(tiny_model, twin_lib):
    work = workload(tiny_model.config.vocab_size, 12, seed=1)
    ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    engine, runner = hostloop_engine(tiny_model, ring, num_blocks=blocks_needed(MAX_LEN, BS) + 4)   # tight: preempts
    got = serve_engine(ring, engine, work)
    want = [greedy_generate(tiny_model, p, n) for p, n, _ in work]
    assert got == want
    used = {runner.table.shapes[g] for g in np.flatnonzero(runner.graph_steps)}
    assert any(g.kind == 1 and g.len == 16 and g.rows > 1 for g in used)     # split rows happened
    assert any(g.kind == 2 for g in used)


def test_hostloop_greedy_equals_the_cpu_executor(tiny_model, twin_lib):
    from gpu_backend.executors.cpu import CpuExecutor
    work = workload(tiny_model.config.vocab_size, 10, seed=2)
    ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    engine, _ = hostloop_engine(tiny_model, ring, num_blocks=200)
    got = serve_engine(ring, engine, work)
    ref_ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    cpu = CpuExecutor(ExecutorOptions(model="tiny", max_batch_size=BATCH, max_prefill_tokens=BUDGET, block_size=BS,
                                      kv_cache_mb=1, max_model_len=MAX_LEN), model=tiny_model)
    assert got == serve_engine(ref_ring, cpu.engine(ref_ring), work)


def test_persistent_twin_greedy_equals_the_reference(tiny_model, twin_lib, shm_ring):
    work = workload(tiny_model.config.vocab_size, 14, seed=3)
    got, tw, graphs = serve_twin(tiny_model, shm_ring(GEOM), blocks_needed(MAX_LEN, BS) + 6, work)
    assert got == [greedy_generate(tiny_model, p, n) for p, n, _ in work]
    s = tw.stats
    assert s.preempted > 0 and s.steps_prefill > 0 and s.steps_decode > 0
    assert sum(graphs.launches) == s.launches
    assert s.fast_plans > 0 and s.fast_plan_mismatches == 0      # model steps planned from the survey too


def test_max_shape_fallback_serves_what_no_tighter_graph_covers(tiny_model, twin_lib, shm_ring):
    pruned = BucketTable(BucketConfig(max_batch_size=BATCH, max_prefill_tokens=BUDGET, max_model_len=MAX_LEN,
                                      block_size=BS, split_len=16, len_granularity=4, max_graph_tokens=8,
                                      decode_rows=(1,), decode_ctxs=(16,)))
    work = workload(tiny_model.config.vocab_size, 6, seed=4)
    got, tw, _ = serve_twin(tiny_model, shm_ring(GEOM), 200, work, table=pruned)
    assert got == [greedy_generate(tiny_model, p, n) for p, n, _ in work]
    assert tw.stats.fallback_steps > 0


def test_seeded_sampling_reproduces_on_both_paths(tiny_model, twin_lib, shm_ring):
    work = workload(tiny_model.config.vocab_size, 8, seed=5, sampled=True)
    runs = []
    for _ in range(2):
        ring = Ring.create(bytearray(GEOM.total_size), GEOM)
        engine, _ = hostloop_engine(tiny_model, ring, num_blocks=200)
        runs.append(serve_engine(ring, engine, work))
    assert runs[0] == runs[1]
    greedy = [greedy_generate(tiny_model, p, n) for p, n, _ in work]
    assert runs[0] != greedy                       # it did sample
    twin_tokens, _, _ = serve_twin(tiny_model, shm_ring(GEOM), 200, work)
    assert twin_tokens == runs[0]                  # same seeds, same batches: same draws on the device path
    # a preemption recomputes and draws the same tokens again (the draw depends on (seed, token index) only)
    ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    engine, _ = hostloop_engine(tiny_model, ring, num_blocks=blocks_needed(MAX_LEN, BS) + 2)
    assert serve_engine(ring, engine, work) == runs[0]


def test_unseeded_requests_draw_different_streams(tiny_model, twin_lib):
    prompt = [5, 6, 7]
    work = [(prompt, 24, dict(ignore_eos=True, temperature=2.0))] * 2
    ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    engine, _ = hostloop_engine(tiny_model, ring, num_blocks=200)
    a, b = serve_engine(ring, engine, work)
    assert a != b


def test_staging_fills_rows_and_padding(tiny_model, twin_lib):
    """The graph's first kernel (C++), checked field by field on a hand-made step."""
    table = BucketTable(BUCKETS)
    graphs = CpuGraphs(tiny_model, table, num_blocks=50)
    ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    ring.prompt_arena[100:110] = np.arange(1000, 1010)
    ring.output_arena[200:203] = [7, 8, 9]
    block = StepBlock(BATCH, table.max_rows, 8)
    r = block.reqs[0]
    r.prompt_offset, r.prompt_len, r.output_offset, r.num_blocks = 100, 10, 200, 4
    r.temperature, r.top_p, r.top_k, r.seed = 0.5, 0.9, 7, 2**63 + 5
    block.tables[0, :4] = [11, 3, 40, 2]
    # one chunk: positions 6..12 (prompt 6..9, then outputs 0..2), cut into rows of 4 + 3
    for j, row in enumerate([(0, 6, 4, 0), (0, 10, 3, ROW_SAMPLE)]):
        block.row_slot[j], block.row_start[j], block.row_len[j], block.row_flags[j] = row
    block.state.n_rows = 2
    params = block.params(block.addr, np.frombuffer(ring.buf, np.uint8).ctypes.data, ring)
    R, S, C = 3, 4, 32
    twin_lib.blink_twin_stage(ctypes.addressof(params), ctypes.byref(graphs.io), R, S, C)
    b = graphs.buffers
    assert b.input_ids[:12].tolist() == [1006, 1007, 1008, 1009, 7, 8, 9, 0, 0, 0, 0, 0]
    assert b.positions[:12].tolist() == [6, 7, 8, 9, 10, 11, 12, 0, 0, 0, 0, 0]
    sink = 50
    assert b.slot_mapping[:12].tolist() == [3 * 4 + 2, 3 * 4 + 3, 40 * 4, 40 * 4 + 1, 40 * 4 + 2, 40 * 4 + 3, 2 * 4,
                                            sink * 4 + 3, sink * 4, sink * 4 + 1, sink * 4 + 2, sink * 4 + 3]
    assert b.block_tables[:24].view(3, 8).tolist() == [[11, 3, 40, 2] + [sink] * 4] * 2 + [[sink] * 8]
    assert b.q_lens[:3].tolist() == [4, 3, 0]
    assert b.token_index[:2].tolist() == [0, 3] and b.seeds[0] == 5 - 2**63
    assert torch.allclose(b.temperature[:3], torch.tensor([0.5, 0.5, 0.0]))
    assert b.top_k[:3].tolist() == [7, 7, 0]
    params.policy.vocab_size = 1008           # ids scribbled out of the vocabulary since intake become 0
    twin_lib.blink_twin_stage(ctypes.addressof(params), ctypes.byref(graphs.io), R, S, C)
    assert b.input_ids[:8].tolist() == [1006, 1007, 0, 0, 7, 8, 9, 0]
    b.tokens[:3] = torch.tensor([99, 123, 77])
    block.state.step_no = 41
    twin_lib.blink_twin_finish(ctypes.addressof(params), ctypes.byref(graphs.io))
    assert block.step_tokens[0] == 123
    done = ctypes.c_uint32.from_address(block.addr + block.layout["done"]).value
    assert done == 41


def test_step_function_shapes_do_not_depend_on_data(tiny_model):
    """Every graph shape runs with padding only (no rows): finite tokens, nothing written
    outside the sink block."""
    table = BucketTable(BUCKETS)
    graphs = CpuGraphs(tiny_model, table, num_blocks=10)
    for g in table.shapes:
        graphs.buffers.input_ids.zero_()
        graphs.buffers.slot_mapping.fill_(10 * BS)            # every token into the sink block
        graphs.buffers.block_tables.fill_(10)
        graphs.step.run(g)
    assert graphs.pool.k[:, :10].abs().sum() == 0 and graphs.pool.k[:, 10].abs().sum() > 0


@pytest.mark.parametrize("threads", [1, 4])
def test_twin_thread_counts(tiny_model, twin_lib, shm_ring, threads):
    work = workload(tiny_model.config.vocab_size, 5, seed=6)
    got, _, _ = serve_twin(tiny_model, shm_ring(GEOM), 100, work, threads=threads)
    assert got == [greedy_generate(tiny_model, p, n) for p, n, _ in work]


class CopyingLauncher:
    """CudaLauncher's copy plan on the CPU: only StepBlock.extents() reach a second block (the
    stand-in for device memory) that the graphs read; the tokens are copied back."""

    def __init__(self, graphs: CpuGraphs, block: StepBlock, ring: Ring):
        self.graphs, self.block = graphs, block
        self.dev = np.full(block.nbytes, 0xAB, np.uint8)          # garbage wherever nothing was copied
        self.params = block.params(self.dev.ctypes.data, np.frombuffer(ring.buf, np.uint8).ctypes.data, ring)

    def launch(self, graph: int, n_chunks: int) -> None:
        for off, n in self.block.extents(n_chunks):
            ctypes.memmove(self.dev.ctypes.data + off, self.block.addr + off, n)
        assert self.graphs.launch(ctypes.addressof(self.params), graph * 2) == 0
        off = self.block.layout["step_tokens"]
        ctypes.memmove(self.block.addr + off, self.dev.ctypes.data + off, 4 * n_chunks)


def test_the_device_copy_plan_carries_everything_the_graph_reads(tiny_model, twin_lib):
    work = workload(tiny_model.config.vocab_size, 10, seed=8)
    ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    table = BucketTable(BUCKETS)
    graphs = CpuGraphs(tiny_model, table, 40)
    block = StepBlock(BATCH, table.max_rows, blocks_needed(MAX_LEN, BS))
    runner = HostLoopRunner(ring, block, CopyingLauncher(graphs, block, ring), table)
    engine = Engine(ring, runner, EngineConfig(PolicyConfig(BATCH, BUDGET, BS), 40),
                    IntakeConfig(tiny_model.config.vocab_size, MAX_LEN, ()))
    assert serve_engine(ring, engine, work) == [greedy_generate(tiny_model, p, n) for p, n, _ in work]
