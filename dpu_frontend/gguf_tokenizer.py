"""Build a HuggingFace `tokenizers.Tokenizer` from the vocabulary a GGUF file carries.

GGUF metadata (tokenizer.ggml.tokens / merges / token_type / pre, bos/eos ids,
chat_template) -> byte-level BPE model + the pre-tokenizer llama.cpp uses for
`tokenizer.ggml.pre` + control tokens as special added tokens -> Tokenizer,
the same one the model's tokenizer.json describes. No torch: the frontend (a
DPU) imports this. Only GPT-2-style byte-level BPE vocabularies
(tokenizer.ggml.model == "gpt2": SmolLM2, Llama 3, Qwen2) are supported.
"""
from __future__ import annotations

import os
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp token types (llama_token_type / gguf.TokenType).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Split regexes llama.cpp's llama-vocab.cpp applies per tokenizer.ggml.pre, ahead of
# the byte-level mapping; same patterns as the models' own tokenizer.json files.
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# "\p{N}" then the GPT-2 regex in llama.cpp == HF's Digits(individual) + ByteLevel(use_regex).
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")
_GPT2 = ("default", "gpt-2", "gpt2", "mpt", "olmo", "jais")
_REGEX_THEN_BYTES = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX}
SUPPORTED_PRE = _DIGITS_THEN_GPT2 + _GPT2 + tuple(_REGEX_THEN_BYTES)


class GGUFTokenizerError(ValueError):
    """The file is not a GGUF, or its vocabulary is of a kind this builder does not handle."""


def _reader(path: str | os.PathLike) -> gguf.GGUFReader:
    if not os.path.isfile(path):
        raise GGUFTokenizerError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises ValueError/struct.error/... on junk
        raise GGUFTokenizerError(f"{path}: not a readable GGUF file ({e})") from None


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = dict(add_prefix_space=False, trim_offsets=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(use_regex=True, **byte_level)])
    if pre in _GPT2:
        return pre_tokenizers.ByteLevel(use_regex=True, **byte_level)
    if pre in _REGEX_THEN_BYTES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_THEN_BYTES[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(use_regex=False, **byte_level)])
    raise GGUFTokenizerError(f"unsupported tokenizer.ggml.pre {pre!r} "
                             f"(supported: {', '.join(SUPPORTED_PRE)})")


def _meta(reader: gguf.GGUFReader) -> dict[str, Any]:
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFTokenizerError("GGUF file carries no tokenizer (tokenizer.ggml.tokens missing)")

    def token_id(key: str) -> int | None:
        value = _field(reader, key)
        return None if value is None or not 0 <= int(value) < len(tokens) else int(value)

    arch = _field(reader, "general.architecture", "llama")
    ids = {k: token_id(f"tokenizer.ggml.{k}") for k in
           ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "eot_token_id")}
    return {
        "model": _field(reader, "tokenizer.ggml.model"),
        "pre": _field(reader, "tokenizer.ggml.pre", "default"),
        "vocab_size": len(tokens),
        **ids,
        "bos_token": None if ids["bos_token_id"] is None else tokens[ids["bos_token_id"]],
        "eos_token": None if ids["eos_token_id"] is None else tokens[ids["eos_token_id"]],
        "unk_token": None if ids["unknown_token_id"] is None else tokens[ids["unknown_token_id"]],
        "pad_token": None if ids["padding_token_id"] is None else tokens[ids["padding_token_id"]],
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "context_length": _field(reader, f"{arch}.context_length"),
        "name": _field(reader, "general.name"),
    }


def gguf_tokenizer_meta(path: str | os.PathLike) -> dict[str, Any]:
    """Special token ids and strings, chat_template, add_bos_token, context_length, ... of a GGUF.

    Keys: model, pre, vocab_size, bos_token_id, eos_token_id, unknown_token_id,
    padding_token_id, eot_token_id, bos_token, eos_token, unk_token, pad_token,
    add_bos_token, add_eos_token, chat_template, context_length, name (None when absent).
    """
    return _meta(_reader(path))


def tokenizer_from_reader(reader: gguf.GGUFReader) -> Tokenizer:
    """As tokenizer_from_gguf, from an already opened reader (the model loader shares one)."""
    meta = _meta(reader)
    if meta["model"] != "gpt2":
        raise GGUFTokenizerError(f"unsupported tokenizer.ggml.model {meta['model']!r}: "
                                 "only byte-level BPE ('gpt2') vocabularies are supported")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = _field(reader, "tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    merges: list[str] = _field(reader, "tokenizer.ggml.merges") or []
    if len(token_types) != len(tokens):
        raise GGUFTokenizerError("tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length")
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise GGUFTokenizerError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((left, right))

    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(meta["pre"])
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, <|im_end|>, ...) match verbatim in text and are
    # skipped by decode(skip_special_tokens=True); user-defined ones match but are text.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, token_types) if kind == TOKEN_CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, token_types) if kind == TOKEN_USER_DEFINED])
    if meta["add_bos_token"] and meta["bos_token"] is not None:
        bos = (meta["bos_token"], meta["bos_token_id"])
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B", special_tokens=[bos])
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def tokenizer_from_gguf(path: str | os.PathLike) -> Tokenizer:
    """The byte-level BPE tokenizer a GGUF file carries, as a `tokenizers.Tokenizer`."""
    return tokenizer_from_reader(_reader(path))
