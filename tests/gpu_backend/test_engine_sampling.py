"""The sampling surface through the engine and a real ring: logprob records (generated and
prompt) against a full-attention float32 reference, and the processors' effect on greedy runs."""
from __future__ import annotations

import pathlib
import random
import sys

import pytest
import torch

from gpu_backend import cpu_kernels
from gpu_backend.engine import Engine, EngineConfig
from gpu_backend.executors.cpu import CpuRunner
from gpu_backend.intake import IntakeConfig
from gpu_backend.kv_cache import KVCacheConfig, KVPool
from gpu_backend.model import LlamaModel, greedy_generate, tiny_config
from gpu_backend.model.attention import DenseCausalAttention
from gpu_backend.policy import PolicyConfig
from shared_layout import ErrorCode, FinishReason, Ring, RingGeometry
from shared_layout.extra import SamplingExtra

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from frontend_player import FrontendPlayer  # noqa: E402

GEOM = RingGeometry(16, 4096, 4096, 1 << 16)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model():
    return LlamaModel.random(tiny_config(), seed=5)


def make_engine(model, max_prefill_tokens=16, eos=()):
    ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    cfg = model.config
    pool = KVPool(KVCacheConfig(128, 4, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim))
    engine = Engine(ring, CpuRunner(model, pool, cpu_kernels.load()),
                    EngineConfig(PolicyConfig(8, max_prefill_tokens, 4), 128),
                    IntakeConfig(cfg.vocab_size, cfg.max_position_embeddings, eos))
    return engine, FrontendPlayer(ring)


def run(engine, fe, slot):
    for _ in range(2000):
        if fe.done(slot):
            return
        engine.step()
    raise AssertionError("no completion")


@torch.inference_mode()
def reference_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log_softmax of the full-attention logits at every position: [T, vocab] float32."""
    ids = torch.tensor(tokens)
    hidden = model(ids, torch.arange(len(tokens)), DenseCausalAttention(model.config))
    return torch.log_softmax(model.compute_logits(hidden).float(), -1)


def test_logprob_records_equal_a_full_forward(model):
    rng = random.Random(0)
    prompt = [rng.randrange(3, 500) for _ in range(37)]
    engine, fe = make_engine(model)            # 16-token prefill chunks: the prompt's records span 3 steps
    slot = fe.submit(prompt, 6, logprobs=3, prompt_logprobs=2)
    run(engine, fe, slot)
    lp, rank, ids, top = fe.logprobs(slot)
    plp, prank, pids, ptop = fe.logprobs(slot, prompt=True)
    out = fe.collect(slot).tokens
    ref = reference_logprobs(model, prompt + out)                               # [T, vocab]
    want = ref[len(prompt) - 1:-1].gather(1, torch.tensor(out)[:, None])[:, 0]
    torch.testing.assert_close(torch.from_numpy(lp), want, atol=2e-4, rtol=0)
    assert rank.tolist() == [1] * len(out)                                        # greedy
    refk = ref[len(prompt) - 1:-1].topk(3)
    assert ids.tolist() == refk.indices.tolist()
    torch.testing.assert_close(torch.from_numpy(top), refk.values, atol=2e-4, rtol=0)
    pwant = ref[:len(prompt) - 1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.from_numpy(plp), pwant, atol=2e-4, rtol=0)
    assert pids.tolist() == ref[:len(prompt) - 1].topk(2).indices.tolist()
    assert (prank >= 1).all() and (prank == 1).tolist() == (torch.tensor(prompt[1:]) == pids[:, 0]).tolist()


def test_processors_change_greedy_runs_as_asked(model):
    rng = random.Random(1)
    prompt = [rng.randrange(3, 500) for _ in range(9)]
    ref = greedy_generate(model, prompt, 8)
    engine, fe = make_engine(model, eos=(ref[0],))
    plain = fe.submit(prompt, 8)
    late = fe.submit(prompt, 8, min_tokens=3)                                   # EOS masked for 3 tokens
    banned = fe.submit(prompt, 8, ignore_eos=True, extra=SamplingExtra(bad_words=((ref[0],),)))
    boosted = fe.submit(prompt, 8, ignore_eos=True, extra=SamplingExtra(logit_bias=((7, 100.0),)))
    allowed = fe.submit(prompt, 8, ignore_eos=True, extra=SamplingExtra(allowed_token_ids=(11, 12)))
    pen = fe.submit(prompt, 8, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0,
                    repetition_penalty=2.0)
    slots = [plain, late, banned, boosted, allowed, pen]
    for s in slots:
        run(engine, fe, s)
    res = {s: fe.collect(s) for s in slots}
    assert (res[plain].finish, res[plain].tokens) == (FinishReason.STOP, ref[:1])
    assert len(res[late].tokens) >= 4 and ref[0] not in res[late].tokens[:3]
    assert ref[0] not in res[banned].tokens and len(res[banned].tokens) == 8
    assert res[boosted].tokens == [7] * 8
    assert set(res[allowed].tokens) <= {11, 12}
    assert len(set(res[pen].tokens)) >= 6                                      # penalties spread the picks


def test_bad_sampling_data_ends_only_that_request(model):
    engine, fe = make_engine(model)
    bad = fe.submit([5, 6], 4, extra=SamplingExtra(allowed_token_ids=(model.config.vocab_size + 3,)))
    good = fe.submit([5, 6], 4)
    run(engine, fe, bad)
    run(engine, fe, good)
    r = fe.collect(bad)
    assert (r.finish, r.error) == (FinishReason.ERROR, ErrorCode.INVALID_REQUEST)
    assert fe.collect(good).finish == FinishReason.LENGTH
