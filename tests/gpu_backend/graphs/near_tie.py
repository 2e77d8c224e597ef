"""The near-tie rule for greedy agreement between two numerical paths (GPU and
CPU, or two GPU executors), the rule tests/gpu_backend/executors/test_cpu_forward.py
applies between its two CPU layers: where two greedy sequences first part, the
reference's logits may rank the two picks apart by at most twice the two paths'
largest logit difference at that position. After that point the sequences run
free on different prefixes, so nothing later is compared.

    prefix = prompt + ref[:i]          (i: first index where ref and got differ)
    l_ref = ref_model(prefix)[-1], l_oth = other_model(prefix)[-1]      # [vocab] float32
    margin = |l_ref[ref[i]] - l_ref[got[i]]|,  noise = max |l_ref - l_oth|
    near tie  <=>  margin <= 2 * noise

A bug (a wrong token, a mixed-up batch row) gives a margin of the logits' own
scale, far above the noise of float arithmetic.
"""
from __future__ import annotations

import dataclasses

import torch

NOISE_FACTOR = 2.0


@dataclasses.dataclass(frozen=True)
class Divergence:
    index: int          # first position where the two sequences differ
    margin: float       # the reference's logit gap between the two picks there
    noise: float        # the largest logit difference between the two paths there

    @property
    def near_tie(self) -> bool:
        return self.margin <= NOISE_FACTOR * self.noise


def last_logits(model, ids: list[int]) -> torch.Tensor:
    """Float32 logits [vocab] of the last position of `ids`, on the model's own device and dtype."""
    from gpu_backend.model.attention import DenseCausalAttention
    device = next(model.parameters()).device
    with torch.inference_mode():
        t = torch.tensor(ids, device=device)
        hidden = model(t, torch.arange(len(ids), device=device), DenseCausalAttention(model.config))
        return model.compute_logits(hidden[-1:])[0].float().cpu()


def divergence(ref_model, other_model, prompt: list[int], ref: list[int], got: list[int]) -> Divergence | None:
    """None when `got` equals `ref`; else where and by how much they first part."""
    i = next((k for k, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    if i is None:
        assert len(ref) == len(got), (len(ref), len(got))
        return None
    prefix = list(prompt) + list(ref[:i])
    l_ref, l_oth = last_logits(ref_model, prefix), last_logits(other_model, prefix)
    return Divergence(i, abs(float(l_ref[ref[i]] - l_ref[got[i]])), float((l_ref - l_oth).abs().max()))


def assert_near_ties(ref_model, other_model, prompts, refs, gots, max_diverged: float = 0.25) -> list:
    """Every first divergence is a near tie, and at most `max_diverged` of the sequences part."""
    found = [divergence(ref_model, other_model, p, r, g) for p, r, g in zip(prompts, refs, gots)]
    parted = [d for d in found if d is not None]
    assert all(d.near_tie for d in parted), found
    assert len(parted) <= max_diverged * len(found), found
    return found
