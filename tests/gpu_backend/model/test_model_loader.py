"""Loaders: the same tiny weights as an HF folder and as a llama.cpp-style GGUF give identical logits."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gpu_backend.model.attention import DenseCausalAttention
from gpu_backend.model.config import tiny_config
from gpu_backend.model.gguf_weights import permute_rope_rows, unpermute_rope_rows, write_gguf
from gpu_backend.model.llama import LlamaModel
from gpu_backend.model.loader import ModelLoadError, hf_state_dict, load_model, save_hf_folder

VARIANTS = {
    "llama-gqa-untied": dict(),
    "llama-tied": dict(tie_word_embeddings=True, num_kv_heads=1),
    "qwen2-bias": dict(arch="qwen2", attention_bias=True),
    "qwen3-qknorm": dict(arch="qwen3", qk_norm=True, head_dim=32),
}
PROMPT = [1, 9, 200, 45, 3, 77, 501, 12]


@torch.inference_mode()
def logits_of(model: LlamaModel) -> torch.Tensor:
    ids = torch.tensor(PROMPT)
    return model.compute_logits(model(ids, torch.arange(len(PROMPT)), DenseCausalAttention(model.config)))


@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_folder_and_gguf_load_identically(tmp_path, variant):
    config = tiny_config(**VARIANTS[variant])
    source = LlamaModel.random(config, seed=11)
    folder = save_hf_folder(source, tmp_path / "hf")
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(gguf_path, config, hf_state_dict(source))

    from_hf, from_gguf = load_model(folder), load_model(gguf_path)
    assert from_hf.config == config
    assert from_gguf.config == config
    assert from_hf.path == folder.resolve() and from_gguf.path == gguf_path.resolve()
    expected = logits_of(source)
    torch.testing.assert_close(logits_of(from_hf.model), expected, rtol=0, atol=0)
    torch.testing.assert_close(logits_of(from_gguf.model), expected, rtol=0, atol=0)


def test_gguf_qk_rows_are_really_permuted_on_disk(tmp_path):
    """The written GGUF holds llama.cpp's order (not HF's), so the loader's un-permute is exercised."""
    import gguf

    config = tiny_config()
    source = LlamaModel.random(config, seed=2)
    write_gguf(tmp_path / "t.gguf", config, hf_state_dict(source))
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(tmp_path / "t.gguf").tensors}
    hf_q = source.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert stored["blk.0.attn_q.weight"].shape == hf_q.shape
    assert not np.array_equal(stored["blk.0.attn_q.weight"], hf_q)
    # convert_hf_to_gguf.py's LlamaModel.permute, written out independently:
    n_head = config.num_heads
    expected = hf_q.reshape(n_head, 2, hf_q.shape[0] // n_head // 2, *hf_q.shape[1:]).swapaxes(1, 2).reshape(hf_q.shape)
    np.testing.assert_array_equal(stored["blk.0.attn_q.weight"], expected)


def test_unpermute_turns_interleaved_rope_into_rotate_half():
    """llama.cpp's interleaved-pair RoPE on permuted rows == HF rotate_half RoPE on HF rows."""
    from gpu_backend.model.llama import apply_rope

    n_head, d, hidden, pos, theta = 3, 8, 12, 5, 10000.0
    g = torch.Generator().manual_seed(0)
    w_hf = torch.randn(n_head * d, hidden, generator=g)
    x = torch.randn(1, hidden, generator=g)
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)                  # [d/2]
    ang = torch.cat([pos * inv, pos * inv])[None]                             # [1, d]
    q_hf = apply_rope((x @ w_hf.T).view(1, n_head, d), ang.cos(), ang.sin())  # [1, H, d]

    q_gg = (x @ permute_rope_rows(w_hf, n_head).T).view(n_head, d // 2, 2)   # interleaved pairs
    c, s = (pos * inv).cos(), (pos * inv).sin()
    rot = torch.stack([q_gg[..., 0] * c - q_gg[..., 1] * s, q_gg[..., 0] * s + q_gg[..., 1] * c], -1)
    # llama.cpp's output, back in HF order, equals HF's
    back = unpermute_rope_rows(rot.reshape(n_head * d, 1), n_head).view(1, n_head, d)
    torch.testing.assert_close(back, q_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unpermute_rope_rows(permute_rope_rows(w_hf, 3), 3), w_hf)


def test_dtype_and_frozen_weights(tmp_path):
    folder = save_hf_folder(LlamaModel.random(tiny_config(), seed=1), tmp_path / "hf")
    loaded = load_model(str(folder), dtype=torch.bfloat16)
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.model.inv_freq.dtype == torch.float32
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert logits_of(loaded.model).dtype == torch.float32


def test_bad_specs_give_clear_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path / "empty")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model(tmp_path / "junk.gguf")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ModelLoadError, match="neither"):
        load_model(tmp_path / "x.txt")

    folder = save_hf_folder(LlamaModel.random(tiny_config(), seed=1), tmp_path / "hf")
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 3}))
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(folder)
    (folder / "config.json").write_text(json.dumps({**hf, "hidden_size": 32}))
    with pytest.raises(ModelLoadError, match="shape"):
        load_model(folder)
    (folder / "config.json").write_text("{")
    with pytest.raises(ModelLoadError, match="JSON"):
        load_model(folder)
