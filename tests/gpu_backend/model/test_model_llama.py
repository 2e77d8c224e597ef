"""LlamaModel over DenseCausalAttention: incremental decode equals full recompute."""
from __future__ import annotations

import pytest
import torch

from gpu_backend.model.attention import DenseCausalAttention, causal_attention
from gpu_backend.model.config import ModelConfig, tiny_config
from gpu_backend.model.llama import LlamaModel
from gpu_backend.model.reference import greedy_generate

VARIANTS = {
    "gqa-untied": dict(),
    "mha-tied": dict(num_kv_heads=4, tie_word_embeddings=True),
    "mqa": dict(num_kv_heads=1),
    "qwen2-bias": dict(arch="qwen2", attention_bias=True),
    "llama-bias": dict(attention_bias=True),
    "qwen3-qknorm": dict(arch="qwen3", qk_norm=True, head_dim=32),
    "llama3-rope": dict(rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0),
                                      ("low_freq_factor", 1.0),
                                      ("original_max_position_embeddings", 32),
                                      ("rope_type", "llama3"))),
}


def full_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    attn = DenseCausalAttention(model.config)
    t = torch.tensor(ids)
    return model.compute_logits(model(t, torch.arange(len(ids)), attn))   # [T, V]


@pytest.mark.parametrize("variant", VARIANTS)
@torch.inference_mode()
def test_prefill_then_decode_matches_full_recompute(variant):
    config = tiny_config(**VARIANTS[variant])
    model = LlamaModel.random(config, seed=3)
    ids = torch.randint(0, config.vocab_size, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = full_logits(model, ids)                                  # [23, V]

    attn = DenseCausalAttention(config)
    prefill = 9
    chunks = [model.compute_logits(model(torch.tensor(ids[:prefill]), torch.arange(prefill), attn))]
    # one chunk of 4 (chunked prefill), then single-token decode steps
    chunks.append(model.compute_logits(model(torch.tensor(ids[9:13]), torch.arange(9, 13), attn)))
    for i in range(13, len(ids)):
        chunks.append(model.compute_logits(model(torch.tensor([ids[i]]), torch.tensor([i]), attn)))
    assert attn.seq_len == len(ids)
    incremental = torch.cat(chunks)
    assert incremental.dtype == torch.float32
    torch.testing.assert_close(incremental, reference, rtol=1e-4, atol=1e-4)


def test_variants_have_their_parameters():
    names = lambda **kw: {n for n, _ in LlamaModel(tiny_config(**kw)).named_parameters()}  # noqa: E731
    base = names()
    assert "lm_head.weight" in base and "layers.0.self_attn.q_proj.bias" not in base
    assert "lm_head.weight" not in names(tie_word_embeddings=True)
    qwen2 = names(arch="qwen2", attention_bias=True)
    assert {"layers.1.self_attn.k_proj.bias", "layers.1.self_attn.v_proj.bias"} <= qwen2
    assert "layers.1.self_attn.o_proj.bias" not in qwen2
    assert "layers.1.self_attn.o_proj.bias" in names(attention_bias=True)
    assert "layers.0.self_attn.q_norm.weight" in names(arch="qwen3", qk_norm=True)


@torch.inference_mode()
def test_positions_drive_rope_not_call_order():
    """The same token at a different position gives different hidden states; same position same."""
    model = LlamaModel.random(tiny_config(), seed=0)
    one = lambda pos: model(torch.tensor([7]), torch.tensor([pos]), DenseCausalAttention(model.config))  # noqa: E731
    torch.testing.assert_close(one(5), one(5))
    # a lone token attends only to itself (softmax of one score = 1) and V is not rotated
    torch.testing.assert_close(one(0), one(40))
    two = lambda p: model(torch.tensor([7, 9]), torch.tensor(p), DenseCausalAttention(model.config))  # noqa: E731
    assert not torch.allclose(two([0, 1]), two([0, 5]))


def test_causal_attention_matches_naive_softmax():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 4, 8, generator=g), torch.randn(7, 2, 8, generator=g),
               torch.randn(7, 2, 8, generator=g))
    out = causal_attention(q, k, v)
    for i in range(3):
        pos = 7 - 3 + i
        for h in range(4):
            kv = h // 2
            w = torch.softmax(k[: pos + 1, kv] @ q[i, h] / 8 ** 0.5, dim=0)
            torch.testing.assert_close(out[i, h], w @ v[: pos + 1, kv], rtol=1e-5, atol=1e-5)


def test_greedy_generate_is_consistent_with_full_argmax():
    model = LlamaModel.random(tiny_config(), seed=5)
    prompt = [1, 17, 33, 250, 4]
    out = greedy_generate(model, prompt, 12)
    assert len(out) == 12
    with torch.inference_mode():
        logits = full_logits(model, prompt + out)
    assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == out


def test_greedy_generate_stops_at_eos_and_context():
    model = LlamaModel.random(tiny_config(), seed=5)
    out = greedy_generate(model, [1, 17, 33], 12)
    stopped = greedy_generate(model, [1, 17, 33], 12, eos_ids=[out[3]])
    assert stopped == out[: out.index(out[3]) + 1]
    small = LlamaModel.random(tiny_config(max_position_embeddings=8), seed=5)
    assert len(greedy_generate(small, [1, 2, 3], 100)) == 5
    assert greedy_generate(model, [1], 0) == []


@pytest.mark.parametrize("bad", [[], [512], [-1]])
def test_greedy_generate_rejects_bad_prompts(bad):
    with pytest.raises(ValueError):
        greedy_generate(LlamaModel.random(tiny_config()), bad, 3)


def test_config_roundtrip_and_validation():
    for kw in VARIANTS.values():
        config = tiny_config(**kw)
        assert ModelConfig.from_hf(config.to_hf()) == config
    with pytest.raises(ValueError, match="multiple"):
        tiny_config(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="lacks"):
        ModelConfig.from_hf({"model_type": "llama"})
    with pytest.raises(ValueError, match="unsupported model_type"):
        ModelConfig.from_hf({**tiny_config().to_hf(), "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_scaling"):
        ModelConfig.from_hf({**tiny_config().to_hf(), "rope_scaling": {"rope_type": "yarn", "factor": 4}})
    hf = {**tiny_config().to_hf(), "eos_token_id": [2, 7]}
    del hf["head_dim"], hf["num_key_value_heads"]
    config = ModelConfig.from_hf(hf)
    assert config.eos_token_ids == (2, 7) and config.head_dim == 16 and config.num_kv_heads == 4
