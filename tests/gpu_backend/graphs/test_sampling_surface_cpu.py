"""The sampling surface through the step graphs on the CPU, end to end over a ring:

    host loop:  Engine + HostLoopRunner (seats filled by SeatTable) -> C++ staging
                (csrc/model_step.h: per-row penalties, min_p, min_tokens ids, seat)
                + StepFunction (graphs/sampler.sample_step) -> tokens and logprob records
    persistent: the scheduler's CPU twin (csrc/sched_loop.h: intake checks, seats taken at
                admission and given back on preemption; csrc/model_step.h: the staging
                fills a fresh seat from the ring, the finish kernel writes logprob
                records into the ring) launching the same CPU graphs

against the CPU executor (logits_processors + sampling + logprobs): the same greedy
tokens under penalties, logit_bias, allowed ids, bad words and min_tokens, the same
logprob records within float32 tolerance; sampled rows never draw a banned token; the
device refuses prompt logprobs (its graphs compute each row's last logits only) with
INVALID_REQUEST."""
from __future__ import annotations

import pathlib
import sys
import time

import numpy as np
import pytest

from gpu_backend.cuda import structs
from gpu_backend.cuda.config import SchedulerConfig
from gpu_backend.engine import Engine, EngineConfig
from gpu_backend.executors import ExecutorOptions
from gpu_backend.graphs.buckets import ROW_LOGPROBS, ROW_SAMPLE, BucketConfig, BucketTable
from gpu_backend.graphs.cpu_graphs import CpuGraphs
from gpu_backend.graphs.hostloop import CpuLauncher, HostLoopRunner, StepBlock
from gpu_backend.scheduler.intake import IntakeConfig
from gpu_backend.model import greedy_generate
from gpu_backend.scheduler.policy import PolicyConfig, blocks_needed
from shared_layout import ErrorCode, FinishReason, Ring, RingGeometry
from shared_layout.extra import SamplingExtra

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from frontend_player import FrontendPlayer  # noqa: E402

GEOM = RingGeometry(64, 1 << 14, 1 << 14)
MAX_LEN, BS, BATCH, BUDGET = 128, 4, 4, 48
BUCKETS = BucketConfig(max_batch_size=BATCH, max_prefill_tokens=BUDGET, max_model_len=MAX_LEN, block_size=BS,
                       split_len=16, len_granularity=4)
LOGPROB_ATOL = 1e-4      # the graph's forward and the CPU executor's differ in summation order only


def _work(model):
    """(prompt, max_tokens, params): greedy requests using every rule, built from the plain
    greedy continuation so each rule changes the output."""
    p1, p2, p3 = [5, 6, 7, 8, 9], [100, 200, 300, 17, 17, 4], list(range(40, 75))    # p3: split rows
    g1, g3 = greedy_generate(model, p1, 12), greedy_generate(model, p3, 12)
    base = dict(ignore_eos=True)
    return [
        (p1, 12, dict(base, logprobs=5)),
        (p1 + g1[:3], 40, dict(base, repetition_penalty=1.6, presence_penalty=0.8, frequency_penalty=0.6,
                               logprobs=20)),
        (p1, 40, dict(base, extra=SamplingExtra(logit_bias=((77, 40.0), (g1[0], -50.0))), frequency_penalty=2.0)),
        (p2, 10, dict(base, extra=SamplingExtra(allowed_token_ids=tuple(range(20, 60)), bad_words=((21,), (30, 31))),
                      logprobs=3)),
        (p3, 12, dict(base, stop_ids=(g3[0], g3[2]), min_tokens=6, logprobs=2)),
        (p3, 40, dict(base, extra=SamplingExtra(bad_words=((g3[0], g3[1]), (g3[3],))))),
        (p1, 8, dict(base, min_p=0.3, top_k=3, logprobs=1)),      # greedy: min_p / top_k change nothing
    ]


def _serve(ring: Ring, step, work, logprobs: bool = True):
    """Submit every request, run until all complete: [(finish, error, tokens, records or None)]."""
    fp = FrontendPlayer(ring)
    slots = [fp.submit(p, n, **params) for p, n, params in work]
    out = {}
    deadline = time.monotonic() + 120
    while len(out) < len(slots):
        assert time.monotonic() < deadline
        step()
        for i, s in enumerate(slots):
            if i not in out and fp.done(s):
                req = fp.inflight[s]["req"]
                recs = fp.logprobs(s) if logprobs and req.logprobs >= 0 else None
                r = fp.collect(s)
                out[i] = (r.finish, r.error, r.tokens, recs)
    return [out[i] for i in range(len(work))]


def _hostloop(model, ring: Ring, num_blocks: int = 200):
    table = BucketTable(BUCKETS)
    graphs = CpuGraphs(model, table, num_blocks)
    block = StepBlock(BATCH, table.max_rows, blocks_needed(MAX_LEN, BS))
    runner = HostLoopRunner(ring, block, CpuLauncher(graphs, block, ring), table)
    engine = Engine(ring, runner, EngineConfig(PolicyConfig(BATCH, BUDGET, BS), num_blocks),
                    IntakeConfig(model.config.vocab_size, MAX_LEN, ()))
    return engine, runner


def _cpu_executor(model, ring: Ring):
    from gpu_backend.executors.cpu import CpuExecutor
    cpu = CpuExecutor(ExecutorOptions(model="tiny", max_batch_size=BATCH, max_prefill_tokens=BUDGET, block_size=BS,
                                      kv_cache_mb=1, max_model_len=MAX_LEN), model=model)
    return cpu.engine(ring)


def _same_records(got, want, k: int) -> None:
    lp, rank, ids, vals = got
    wlp, wrank, wids, wvals = want
    assert np.allclose(lp, wlp, atol=LOGPROB_ATOL) and np.allclose(vals, wvals, atol=LOGPROB_ATOL)
    close = np.abs(wlp[:, None] - wvals) < 2 * LOGPROB_ATOL          # the token near-tied with a neighbour
    assert ((rank == wrank) | close.sum(axis=1).astype(bool)).all()
    for r in range(ids.shape[0]):                                     # top ids equal except at near ties
        for j in np.nonzero(ids[r] != wids[r])[0]:
            assert (np.abs(wvals[r] - wvals[r, j]) < 2 * LOGPROB_ATOL).sum() > 1, (r, j)
    assert ids.shape[1] == k


@pytest.fixture(scope="module")
def reference(tiny_model):
    work = _work(tiny_model)
    ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    engine = _cpu_executor(tiny_model, ring)
    return work, _serve(ring, engine.step, work)


def test_hostloop_applies_the_surface_as_the_cpu_executor_does(tiny_model, twin_lib, reference):
    work, want = reference
    ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    engine, runner = _hostloop(tiny_model, ring)
    marked, launch = [], runner.launcher.launch

    def launch_and_look(graph, n_chunks):      # the staged lp_want of each row: the host loop's mark
        launch(graph, n_chunks)
        n = runner.block.state.n_rows
        flags = [int(f) for f in runner.block.row_flags[:n]]
        wanted = runner.launcher.buffers.lp_want[:n].tolist()
        assert wanted == [int(bool(f & ROW_SAMPLE and f & ROW_LOGPROBS)) for f in flags]
        marked.append(sum(wanted))
    runner.launcher.launch = launch_and_look
    got = _serve(ring, engine.step, work)
    # one marked row for each token drawn for a request asking logprobs, none for the others
    assert sum(marked) == sum(len(got[i][2]) for i, (_, _, kw) in enumerate(work) if kw.get("logprobs") is not None)
    plain = [greedy_generate(tiny_model, p, n) for p, n, _ in work]
    for i, ((f, e, toks, recs), (wf, we, wtoks, wrecs)) in enumerate(zip(got, want)):
        assert (f, e, toks) == (wf, we, wtoks), i
        if recs is not None:
            _same_records(recs, wrecs, work[i][2]["logprobs"])
    # every processed request (1 to 5) left the plain greedy path: the rules did something
    assert all(got[i][2] != plain[i][:len(got[i][2])] for i in (1, 2, 3, 4, 5))
    assert got[0][2] == plain[0] and got[6][2] == plain[6]
    assert len(got[4][2]) >= 6 and not set(got[4][2][:6]) & {plain[4][0], plain[4][2]}   # stops held off
    assert set(got[3][2]) <= set(range(20, 60)) - {21}
    assert runner.seats.fills >= 4                                          # requests 1, 2, 3, 5 got seats


def test_hostloop_seats_survive_preemption(tiny_model, twin_lib, reference):
    """A pool tight enough to preempt: seats are taken back and refilled from the output, and
    the tokens stay the CPU executor's."""
    work, want = reference
    ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    engine, runner = _hostloop(tiny_model, ring, num_blocks=blocks_needed(MAX_LEN, BS) + 2)
    preempted, pause = [], engine._pause
    engine._pause = lambda victims: (preempted.extend(victims), pause(victims))
    got = _serve(ring, engine.step, work, logprobs=False)
    assert [g[2] for g in got] == [w[2] for w in want]
    assert preempted


def test_hostloop_sampled_rows_respect_every_ban(tiny_model, twin_lib):
    allowed = tuple(range(50, 90))
    work = [([3, 4, 5], 24, dict(ignore_eos=True, temperature=1.5, seed=i, logprobs=0,
                                  extra=SamplingExtra(allowed_token_ids=allowed, bad_words=((60,), (70, 71))),
                                  presence_penalty=1.0, min_p=0.01)) for i in range(4)]
    ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    engine, _ = _hostloop(tiny_model, ring)
    got = _serve(ring, engine.step, work)
    again = _serve(ring, engine.step, work)
    for (_, _, toks, recs), (_, _, toks2, _) in zip(got, again):
        assert toks == toks2                                    # seeded: reproduces
        assert set(toks) <= set(allowed) - {60}
        assert all(not (a == 70 and b == 71) for a, b in zip(toks, toks[1:]))
        assert recs[2].shape == (24, 0) and np.isfinite(recs[0]).all() and (recs[1] >= 1).all()
    assert len({tuple(t) for _, _, t, _ in got}) > 1


def _twin(model, ring: Ring, work, num_blocks: int = 200):
    from gpu_backend.cuda.twin import TwinScheduler
    table = BucketTable(BUCKETS)
    graphs = CpuGraphs(model, table, num_blocks)
    cfg = SchedulerConfig(max_batch_size=BATCH, max_prefill_tokens=BUDGET, block_size=BS, num_blocks=num_blocks,
                          max_model_len=MAX_LEN, vocab_size=model.config.vocab_size, launch_retry_limit=0,
                          idle_sleep_ns=20_000, beat_interval_s=0.005)
    holder = {}
    tw = TwinScheduler(ring, cfg, threads=2, launch_cb=graphs.launch_cb(lambda: holder["tw"].params_addr),
                       graphs=graphs.graph_table(), max_rows=table.max_rows)
    holder["tw"] = tw
    tw.start()
    try:
        return _serve(ring, lambda: time.sleep(0.002), work), tw
    finally:
        tw.stop()
        assert tw.join(20) and tw.exit_code == structs.EXIT_SHUTDOWN
        assert tw.state.free_blocks == num_blocks


@pytest.mark.parametrize("num_blocks", [200, blocks_needed(MAX_LEN, BS) + 2])
def test_persistent_twin_applies_the_surface_as_the_cpu_executor_does(tiny_model, twin_lib, shm_ring, reference,
                                                                      num_blocks):
    """The device path: intake copies and checks the surface, admission takes a seat that the
    staging kernel fills from the ring (sampling data, prompt, output: also after a preemption
    gave it back), the graph updates it, the finish kernel writes each token's record into the
    ring before its count."""
    work, want = reference
    got, tw = _twin(tiny_model, shm_ring(GEOM), work, num_blocks=num_blocks)
    if num_blocks < 200:
        assert tw.stats.preempted > 0                  # seats given back and refilled from the output
    for i, ((f, e, toks, recs), (wf, we, wtoks, wrecs)) in enumerate(zip(got, want)):
        assert (f, e, toks) == (wf, we, wtoks), i
        if recs is not None:
            _same_records(recs, wrecs, work[i][2]["logprobs"])


def test_persistent_twin_refuses_prompt_logprobs_only(tiny_model, twin_lib, shm_ring, reference):
    work, want = reference
    got, _ = _twin(tiny_model, shm_ring(GEOM), [([5, 6, 7], 4, dict(ignore_eos=True, prompt_logprobs=2)), work[2]])
    assert got[0][:2] == (FinishReason.ERROR, ErrorCode.INVALID_REQUEST)
    assert got[1][:3] == want[2][:3]                                # the others undisturbed


def test_staging_fills_a_fresh_seat_as_seatstate_fill(tiny_model, twin_lib):
    """blink_fill_seat (the staging kernel, C++) against sampler.SeatState.fill, tensor for
    tensor, from the slot's sampling data in the prompt arena, its prompt and its output; the
    sampling row carries the seat, the others the sink; a seat not fresh is left alone."""
    import ctypes

    import torch

    from gpu_backend.graphs import sampler
    from shared_layout.extra import encode_extra
    from shared_layout.layout import FLAG_LOGPROBS

    table = BucketTable(BUCKETS)
    graphs = CpuGraphs(tiny_model, table, num_blocks=50)
    V = tiny_model.config.vocab_size
    ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    prompt, output = [5, 9, 9, 300, 17], list(range(100, 170)) + [7, 8]           # output past the 63 recent
    extra = SamplingExtra(logit_bias=((3, 2.5), (17, -1.0), (3, 0.5)), allowed_token_ids=(3, 4, 17, 300, 7),
                          bad_words=((4,), (7, 8, 9), (8, 3), tuple(range(200, 264)), (511,)))
    words = encode_extra(extra)
    ring.prompt_arena[100:105] = prompt
    ring.prompt_arena[105:105 + words.size] = words
    ring.output_arena[200:200 + len(output)] = output
    block = StepBlock(BATCH, table.max_rows, 20)
    r = block.reqs[0]
    r.prompt_offset, r.prompt_len, r.output_offset, r.num_blocks, r.max_tokens = 100, 5, 200, 20, 100
    r.generated, r.extra_offset = len(output), 105
    r.n_logit_bias, r.n_allowed_ids, r.bad_words_words = extra.counts
    r.seat, r.seat_fresh, r.flags = 2, 1, 0
    r.presence_penalty, r.repetition_penalty, r.min_tokens = 0.5, 0.0, 3
    r.n_mask_stops = 2
    r.mask_stops[0], r.mask_stops[1] = 7, 2
    for j, row in enumerate([(0, 70, 4, 0), (0, 74, 3, ROW_SAMPLE)]):
        block.row_slot[j], block.row_start[j], block.row_len[j], block.row_flags[j] = row
    block.state.n_rows = 2
    params = block.params(block.addr, np.frombuffer(ring.buf, np.uint8).ctypes.data, ring)
    twin_lib.blink_twin_stage(ctypes.addressof(params), ctypes.byref(graphs.io), 3, 4, 80)
    want = sampler.SeatState(graphs.buffers.seats.seats, V)
    want.fill(2, prompt, output, extra.logit_bias, extra.allowed_token_ids, extra.bad_words)
    got = graphs.buffers.seats
    for name in ("bias", "counts", "prompt_mask", "recent", "bad_prefix", "bad_len", "bad_last"):
        assert torch.equal(getattr(got, name)[2], getattr(want, name)[2]), name
    b = graphs.buffers
    assert b.seat[:3].tolist() == [got.sink, 2, got.sink]
    assert b.stop_ids[1, :3].tolist() == [7, 2, -1] and b.min_tokens[1] == 3
    assert float(b.presence[1]) == 0.5 and float(b.repetition[1]) == 1.0          # 0: off
    assert b.lp_want[:3].tolist() == [0, 0, 0]                 # no request asks logprobs: none computed
    # lp_want: the sampling row of a request with FLAG_LOGPROBS (the device scheduler's copies), or
    # a row the host loop marks ROW_LOGPROBS; never a row that does not sample, nor padding
    r.flags = FLAG_LOGPROBS
    twin_lib.blink_twin_stage(ctypes.addressof(params), ctypes.byref(graphs.io), 3, 4, 80)
    assert b.lp_want[:3].tolist() == [0, 1, 0]
    r.flags = 0
    block.row_flags[0], block.row_flags[1] = ROW_LOGPROBS, ROW_SAMPLE | ROW_LOGPROBS
    twin_lib.blink_twin_stage(ctypes.addressof(params), ctypes.byref(graphs.io), 3, 4, 80)
    assert b.lp_want[:3].tolist() == [0, 1, 0]
    block.row_flags[0], block.row_flags[1] = 0, ROW_SAMPLE
    # not fresh: the staging leaves the seat as the graph's updates made it
    got.counts[2, 5] = 42.0
    r.seat_fresh = 0
    twin_lib.blink_twin_stage(ctypes.addressof(params), ctypes.byref(graphs.io), 3, 4, 80)
    assert float(got.counts[2, 5]) == 42.0
    # the finish kernel writes a record only with FLAG_LOGPROBS (the device scheduler's request copies)
    r.flags, r.logprobs, r.logprobs_offset, r.generated = FLAG_LOGPROBS, 2, 40, 1
    b.lp_token[1], b.lp_rank[1] = -1.5, 3
    b.lp_top_ids[1, :2] = torch.tensor([11, 12])
    b.lp_top_vals[1, :2] = torch.tensor([-0.25, -0.5])
    twin_lib.blink_twin_finish(ctypes.addressof(params), ctypes.byref(graphs.io))
    from shared_layout.layout import decode_logprob_records
    lp, rank, ids, vals = decode_logprob_records(ring.logprob_arena[40 + 6:40 + 12], 2)
    assert (lp.tolist(), rank.tolist(), ids.tolist(), vals.tolist()) == ([-1.5], [3], [[11, 12]], [[-0.25, -0.5]])
