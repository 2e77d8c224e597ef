"""Tokenizer loading (embedded GGUF, HF folder), chat template rendering, encoding off the loop."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

from dpu_frontend.tokenizer import (ChatTemplateError, TokenizerError, embedded_gguf_path, load_tokenizer,
                                    resolve_model_path)

from frontend_procs import smollm2

SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def test_embedded_default_is_chatml_with_eos_2():
    tok = smollm2()
    assert tok.vocab_size == 49152 and 2 in tok.eos_ids
    text = tok.render_chat([{"role": "user", "content": "Hi 😀"}])
    assert text == SMOL_SYSTEM + "<|im_start|>user\nHi 😀<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 2   # <|im_start|> and <|im_end|> are single special tokens


def test_chat_template_variants():
    tok = smollm2()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A"}, {"role": "user", "content": "Q2"}]
    text = tok.render_chat(msgs, add_generation_prompt=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
                    "<|im_start|>assistant\nA<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n")
    cont = tok.render_chat([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "The answer is"}],
                           add_generation_prompt=False, continue_final_message=True)
    assert cont.endswith("<|im_start|>assistant\nThe answer is")


def _hf_folder(tmp_path, template, **extra):
    tok = smollm2()
    (tmp_path / "tokenizer.json").write_text(tok.tokenizer.to_str())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": {"content": "<|endoftext|>"}, "eos_token": "<|im_end|>", **extra}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return tmp_path


def test_hf_folder_with_named_templates(tmp_path):
    folder = _hf_folder(tmp_path, [{"name": "tool_use", "template": "TOOLS"},
                                   {"name": "default", "template": "{{ bos_token }}{% for m in messages %}"
                                                                   "[{{ m.role }}]{{ m.content }}{% endfor %}"}])
    tok = load_tokenizer(str(folder))
    assert tok.eos_ids == {0, 2} and tok.bos_token == "<|endoftext|>"
    assert tok.render_chat([{"role": "user", "content": "x"}]) == "<|endoftext|>[user]x"
    assert tok.encode("hello") == smollm2().encode("hello")


def test_template_raise_exception_and_broken_templates(tmp_path):
    folder = _hf_folder(tmp_path, "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}"
                                  "{% endif %}ok")
    tok = load_tokenizer(str(folder))
    with pytest.raises(ChatTemplateError, match="user first"):
        tok.render_chat([{"role": "system", "content": "x"}])
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(TokenizerError, match="does not compile"):
        load_tokenizer(str(folder))


def test_template_sandbox_blocks_attribute_escape(tmp_path):
    folder = _hf_folder(tmp_path, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        load_tokenizer(str(folder)).render_chat([{"role": "user", "content": "x"}])


def test_bad_model_specs(tmp_path):
    with pytest.raises(TokenizerError, match="no such"):
        load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(TokenizerError, match="expected an HF model folder"):
        load_tokenizer(str(tmp_path / "x.txt"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(TokenizerError):
        load_tokenizer(str(tmp_path / "junk.gguf"))


def test_default_resolves_to_prepared_folder_else_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("BLINK_CACHE_DIR", str(tmp_path))
    assert resolve_model_path("default") == embedded_gguf_path()
    folder = tmp_path / "models" / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text(smollm2().tokenizer.to_str())
    assert resolve_model_path("default") == folder == resolve_model_path("null")


async def test_long_prompts_are_encoded_off_the_event_loop():
    tok = smollm2()
    long_text = "word " * 50_000
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    seen = []
    orig = tok.tokenizer.encode

    class Spy:   # records which thread ran the encoder
        def encode(self, *a, **kw):
            seen.append(threading.current_thread() is threading.main_thread())
            return orig(*a, **kw)

    t = asyncio.ensure_future(ticker())
    spy_tok = type(tok)(Spy(), tok.eos_ids, tok.chat_template, encode_in_thread_chars=1000)
    ids = await spy_tok.encode_async(long_text)
    short = await spy_tok.encode_async("short")
    t.cancel()
    assert ids == tok.encode(long_text) and short == tok.encode("short")
    assert seen == [False, True]   # long: worker thread; short: inline
    assert ticks > 1               # the loop kept running while the long prompt was encoded
