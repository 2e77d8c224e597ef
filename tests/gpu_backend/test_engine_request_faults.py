"""A failure inside one request fails that request only: an exception in its sampling, or NaN
logits, ends it ERROR/INTERNAL while the requests batched with it keep their exact greedy
output (the engine reruns a failed batch chunk by chunk) and the daemon's loop goes on."""
from __future__ import annotations

import pathlib
import random
import sys

import pytest
import torch

from gpu_backend import sampling
from gpu_backend.executors.cpu import CpuRunner
from gpu_backend.kv_pool import KVCacheConfig, KVPool
from gpu_backend.model import LlamaModel, greedy_generate, tiny_config
from shared_layout import ErrorCode, FinishReason

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_engine_cpu import drain, make_engine, rand_prompt  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return LlamaModel.random(tiny_config(), seed=3)


class PoisonedRunner(CpuRunner):
    """The real runner, but a step that samples for a poisoned prompt raises (in any batch)."""
    poisoned: tuple[int, ...] = ()

    def run(self, batch):
        if any(c.sample and tuple(c.seq.prompt) == self.poisoned for c in batch.chunks):
            raise RuntimeError("simulated failure in one request's sampling")
        return super().run(batch)


def test_an_exception_in_one_requests_sampling_fails_it_alone(model):
    cfg = model.config
    runner = PoisonedRunner(model, KVPool(KVCacheConfig(256, 4, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)))
    engine, fe = make_engine(model, runner=runner)
    rng = random.Random(11)
    good1, bad, good2 = rand_prompt(rng, 9), rand_prompt(rng, 7), rand_prompt(rng, 12)
    runner.poisoned = tuple(bad)
    a, b, c = fe.submit(good1, 12), fe.submit(bad, 12), fe.submit(good2, 12)
    res = drain(engine, fe, [a, b, c])
    assert (res[b].finish, res[b].error) == (FinishReason.ERROR, ErrorCode.INTERNAL)
    assert res[a].tokens == greedy_generate(model, good1, 12)      # batched with it, untouched
    assert res[c].tokens == greedy_generate(model, good2, 12)
    assert engine.scheduler.allocator.free_count == engine.scheduler.allocator.num_blocks and not engine.owned


def test_nan_logits_of_one_request_fail_it_alone(model, monkeypatch):
    engine, fe = make_engine(model)
    rng = random.Random(12)
    good, bad = rand_prompt(rng, 8), rand_prompt(rng, 6)
    real = sampling.sample

    def poison(logits, seqs):   # the model produced NaN for one request's row (greedy would hide it)
        logits = logits.clone()
        for i, s in enumerate(seqs):
            if s.prompt == bad and len(s.output) == 3:
                logits[i, 5] = float("nan")
        return real(logits, seqs)

    monkeypatch.setattr("gpu_backend.executors.cpu.sample", poison)
    a, b = fe.submit(good, 10), fe.submit(bad, 10, temperature=0.8, seed=1)
    res = drain(engine, fe, [a, b])
    assert (res[b].finish, res[b].error) == (FinishReason.ERROR, ErrorCode.INTERNAL)
    assert len(res[b].tokens) == 3                                   # the tokens before the NaN went out
    assert res[a].tokens == greedy_generate(model, good, 10)
    assert engine.scheduler.allocator.free_count == engine.scheduler.allocator.num_blocks and not engine.owned


def test_sample_marks_a_nan_row_and_leaves_the_others():
    from gpu_backend.scheduler.sequence import SamplingParams, Sequence
    seqs = [Sequence(slot=i, seq=i + 1, epoch=1, prompt=[1, 2], max_tokens=4, params=SamplingParams(),
                     stop_ids=frozenset(), max_len=64) for i in range(3)]
    logits = torch.zeros(3, 16)
    logits[0, 4] = logits[2, 9] = 5.0
    logits[1, 3] = float("nan")
    assert sampling.sample(logits, seqs) == [4, -1, 9]
