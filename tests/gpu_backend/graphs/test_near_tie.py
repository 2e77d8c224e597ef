"""The near-tie rule the GPU agreement tests use (near_tie.py), on the CPU: a
random model and a copy with its weights perturbed by 0.3% of their spread
(a second numerical path, noisier than a GPU's float32) part only at near
ties, and a planted wrong token is no near tie."""
from __future__ import annotations

import copy
import pathlib
import random
import sys

import torch

from gpu_backend.model import LlamaModel, greedy_generate, tiny_config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from near_tie import assert_near_ties, divergence, last_logits  # noqa: E402


def _models():
    ref = LlamaModel.random(tiny_config(), seed=5)
    noisy = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in noisy.parameters():
            w.add_(torch.randn(w.shape, generator=g) * 3e-3 * w.std())
    return ref, noisy


def test_two_numerical_paths_part_only_at_near_ties():
    ref, noisy = _models()
    rng = random.Random(1)
    prompts = [[rng.randrange(ref.config.vocab_size) for _ in range(rng.randint(3, 20))] for _ in range(16)]
    want = [greedy_generate(ref, p, 24) for p in prompts]
    got = [greedy_generate(noisy, p, 24) for p in prompts]
    found = assert_near_ties(ref, noisy, prompts, want, got)
    parted = [d for d in found if d is not None]
    assert parted, "the perturbation parted no sequence: the test shows nothing"
    assert all(d.noise > 0 for d in parted)
    assert divergence(ref, noisy, prompts[0], want[0], want[0]) is None


def test_a_wrong_token_is_no_near_tie():
    ref, noisy = _models()
    prompt = [5, 9, 2, 7]
    want = greedy_generate(ref, prompt, 6)
    worst = int(last_logits(ref, prompt + want[:3]).argmin())
    bad = want[:3] + [worst] + want[4:]
    d = divergence(ref, noisy, prompt, want, bad)
    assert d is not None and d.index == 3 and not d.near_tie
