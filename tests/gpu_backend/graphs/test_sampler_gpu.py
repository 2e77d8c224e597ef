"""The in-graph sampler's sampling surface on a real GPU (marked `gpu`: skipped without an
NVIDIA GPU of compute capability >= 9.0, its driver and cuda-python). The CPU side of each
check runs in CI: test_sampler_twin.py and test_sampling_surface_cpu.py.

    sampler.sample_step on CUDA tensors against the same code on CPU tensors (its twin,
        itself diffed with the CPU daemon's sampler): processed logits and logprobs within
        float32 tolerance, the same greedy picks, top ids equal except at near ties
    sample_step captured in a torch CUDA graph and replayed: the seats' counts and recent
        tokens advance in-graph, replay after replay, as eagerly on the CPU
    executors in-process on a tiny random model, against the CPU executor:
        cuda-hostloop: penalties, logit_bias, allowed ids, bad words, min_tokens and
            logprob records (seats filled by the host loop's SeatTable)
        cuda (the persistent scheduler): the same, with seats taken at admission and
            filled by the staging kernel from the ring, and the logprob records its finish
            kernel writes into the ring; prompt logprobs refused with INVALID_REQUEST
"""
from __future__ import annotations

import json
import pathlib
import sys
import threading
import time

import numpy as np
import pytest
import torch

from gpu_backend.executors import ExecutorOptions
from gpu_backend.graphs import sampler
from gpu_backend.model import LlamaModel, tiny_config
from shared_layout import ErrorCode, FinishReason

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import test_sampler_twin as twin_t  # noqa: E402
import test_sampling_surface_cpu as surf  # noqa: E402

pytestmark = pytest.mark.gpu
CONFIG = tiny_config(num_layers=4, num_heads=4, num_kv_heads=4, head_dim=64)
GPU_ATOL = 2e-3          # GPU vs CPU float32 (issue 18's bound for logprobs)


def _to(p: sampler.RowParams, s: sampler.SeatState, device: str):
    p2 = sampler.RowParams(*(None if getattr(p, f) is None else getattr(p, f).to(device)   # automaton_* may be unset
                             for f in p.__dataclass_fields__))
    s2 = sampler.SeatState(s.seats, s.vocab, device)
    for name, t in vars(s).items():
        if isinstance(t, torch.Tensor):
            getattr(s2, name).copy_(t)
    return p2, s2


def test_sampler_on_the_gpu_matches_its_cpu_twin():
    seqs = twin_t._requests()
    p, s = twin_t._graph_side(seqs)
    pg, sg = _to(p, s, "cuda")
    raw = twin_t._logits(len(seqs), 5)
    x_cpu, x_gpu = sampler.process(raw, p, s), sampler.process(raw.cuda(), pg, sg).cpu()
    assert torch.equal(torch.isneginf(x_cpu), torch.isneginf(x_gpu))
    fin = torch.isfinite(x_cpu)
    assert torch.allclose(x_cpu[fin], x_gpu[fin], atol=1e-5)
    assert x_cpu.argmax(-1).tolist() == x_gpu.argmax(-1).tolist()
    cpu, gpu = sampler.sample_step(raw, p, s), sampler.sample_step(raw.cuda(), pg, sg)
    agree = (cpu.tokens == gpu.tokens.cpu()).float().mean().item()
    assert agree >= 0.8, agree                  # the inverse CDF may land one token over at a CDF step
    same = cpu.tokens == gpu.tokens.cpu()
    assert torch.allclose(cpu.logprob[same], gpu.logprob.cpu()[same], atol=1e-5)
    assert torch.allclose(cpu.top_logprobs, gpu.top_logprobs.cpu(), atol=1e-5)
    diff = cpu.top_ids != gpu.top_ids.cpu()
    assert bool((cpu.top_logprobs[diff] == gpu.top_logprobs.cpu()[diff]).all())       # ties only
    rows = torch.nonzero(same).flatten()                    # seats of rows that drew alike: counted alike
    assert torch.equal(s.counts[p.seat[rows]], sg.counts.cpu()[p.seat[rows]])


def test_sample_step_captures_and_updates_seats_in_graph():
    seqs = twin_t._requests()
    p, s = twin_t._graph_side(seqs)
    p.temperature.zero_()                       # greedy: the CPU eager run takes the same path
    pg, sg = _to(p, s, "cuda")
    logits = torch.zeros(len(seqs), twin_t.V, device="cuda")
    out = {}
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        sampler.sample_step(logits, pg, sg)     # warm-up outside the capture
    stream.synchronize()
    pg, sg = _to(p, s, "cuda")                  # the warm-up updated the seats: start again
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        res = sampler.sample_step(logits, pg, sg)
        out["tokens"] = res.tokens.clone()
        pg.index.add_(1)
    for step in range(5):
        raw = twin_t._logits(len(seqs), 50 + step)
        logits.copy_(raw)
        g.replay()
        want = sampler.sample_step(raw, p, s)
        p.index += 1
        assert out["tokens"].cpu().tolist() == want.tokens.tolist(), step
    torch.cuda.synchronize()
    assert torch.equal(sg.counts.cpu(), s.counts) and torch.equal(sg.recent.cpu(), s.recent)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_surface")
    (folder / "config.json").write_text(json.dumps(CONFIG.to_hf()))
    return folder


@pytest.fixture(scope="module")
def model_cpu():
    return LlamaModel.random(CONFIG, seed=0)        # what `--model random:<folder>` builds


@pytest.fixture(scope="module")
def reference(model_cpu):
    from shared_layout import Ring
    work = surf._work(model_cpu)
    ring = Ring.create(bytearray(surf.GEOM.total_size), surf.GEOM)
    return work, surf._serve(ring, surf._cpu_executor(model_cpu, ring).step, work)


def _serve_executor(executor, ring, work):
    stop, errors = threading.Event(), []

    def run():
        try:
            executor.serve(ring, stop)
        except Exception as e:       # surfaced below
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        return surf._serve(ring, lambda: time.sleep(0.002), work)
    finally:
        stop.set()
        t.join(60)
        assert not errors, errors


def _agree(got, want, work, max_parted: int) -> None:
    """Tokens equal up to a first parting (GPU vs CPU arithmetic at a near tie) in at most
    max_parted requests; logprob records of the common prefix within GPU_ATOL."""
    parted = 0
    for (f, e, toks, recs), (wf, we, wtoks, wrecs) in zip(got, want):
        assert (f, e) in ((wf, we), (FinishReason.LENGTH, ErrorCode.NONE), (FinishReason.STOP, ErrorCode.NONE))
        n = next((i for i, (a, b) in enumerate(zip(toks, wtoks)) if a != b), min(len(toks), len(wtoks)))
        parted += toks != wtoks
        if recs is not None and n:
            assert np.allclose(recs[0][:n], wrecs[0][:n], atol=GPU_ATOL)
            assert np.allclose(recs[3][:n], wrecs[3][:n], atol=GPU_ATOL)
    assert parted <= max_parted, parted


def _options(folder, **kw) -> ExecutorOptions:
    base = dict(model=f"random:{folder}", max_batch_size=surf.BATCH, max_prefill_tokens=surf.BUDGET,
                block_size=surf.BS, max_model_len=surf.MAX_LEN, kv_cache_mb=8, shutdown_grace_s=2.0,
                dtype="float32")   # compared with the float32 CPU twin, not the executors' default bf16
    base.update(kw)
    return ExecutorOptions(**base)


@pytest.fixture
def tiny_buckets(monkeypatch):
    monkeypatch.setenv("BLINK_GRAPH_BUCKETS", json.dumps({"split_len": surf.BUCKETS.split_len,
                                                           "len_granularity": surf.BUCKETS.len_granularity}))


def test_hostloop_applies_the_surface_on_the_gpu(tiny_folder, reference, shm_ring, tiny_buckets):
    from gpu_backend.executors.cuda_hostloop import CudaHostLoopExecutor
    work, want = reference
    ex = CudaHostLoopExecutor(_options(tiny_folder))
    try:
        got = _serve_executor(ex, shm_ring(surf.GEOM), work)
    finally:
        ex.close()
    _agree(got, want, work, max_parted=2)


def test_persistent_scheduler_applies_the_surface_on_the_gpu(tiny_folder, reference, shm_ring, tiny_buckets):
    """Seats taken at admission and filled by the staging kernel from the ring, logprob records
    written by the finish kernel; prompt logprobs refused, the others undisturbed."""
    from gpu_backend.executors.cuda import CudaExecutor
    work, want = reference
    refused = ([5, 6, 7], 4, dict(ignore_eos=True, prompt_logprobs=2))
    ex = CudaExecutor(_options(tiny_folder))
    try:
        got = _serve_executor(ex, shm_ring(surf.GEOM), work + [refused])
    finally:
        ex.close()
    _agree(got[:-1], want, work, max_parted=2)
    assert got[-1][:2] == (FinishReason.ERROR, ErrorCode.INVALID_REQUEST)
