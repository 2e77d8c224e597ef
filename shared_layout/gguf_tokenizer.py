"""Build a HuggingFace `tokenizers.Tokenizer` from the vocabulary a GGUF file carries.

GGUF metadata (tokenizer.ggml.tokens / merges / token_type / pre, bos/eos ids,
chat_template) -> byte-level BPE model + the pre-tokenizer llama.cpp uses for
`tokenizer.ggml.pre` + control tokens as special added tokens -> Tokenizer,
the same one the model's tokenizer.json describes. No torch: the frontend (a
DPU) imports this. Only GPT-2-style byte-level BPE vocabularies
(tokenizer.ggml.model == "gpt2": SmolLM2, Llama 3, Qwen2) are supported.
"""
from __future__ import annotations

import mmap
import os
import struct
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp token types (llama_token_type; gguf.TokenType).
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


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (v2/v3, little-endian); tensors are not touched.

    A plain sequential parse, far faster than gguf.GGUFReader, which also indexes
    every element of the ~100k vocabulary strings (a DPU's ARM cores feel that).
    """
    if not os.path.isfile(path):
        raise GGUFTokenizerError(f"GGUF file not found: {path}")
    try:
        with open(path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise GGUFTokenizerError(f"{path}: unreadable ({e})") from None
    try:
        return _parse_metadata(data)
    except (struct.error, ValueError, KeyError, UnicodeDecodeError, IndexError) as e:
        raise GGUFTokenizerError(f"{path}: not a readable GGUF file ({e})") from None
    finally:
        data.close()


def _parse_metadata(data: mmap.mmap) -> dict[str, Any]:
    if data[:4] != b"GGUF":
        raise ValueError("bad magic")
    version, _tensor_count, kv_count = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (only little-endian v2/v3 are supported)")
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
        if pos > len(data):
            raise ValueError("a string runs past the end of the file")
        return data[pos - n:pos].decode("utf-8")

    def value(kind: int) -> Any:
        nonlocal pos
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            elem, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            if elem == _STRING:
                return [string() for _ in range(count)]
            if elem == _ARRAY:
                return [value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_NUMPY[elem])
            out = np.frombuffer(data, dtype=dtype, count=count, offset=pos).tolist()
            pos += count * dtype.itemsize
            return out
        fmt = _SCALARS[kind]
        (v,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return v

    meta: dict[str, Any] = {}
    for _ in range(kv_count):
        key = string()
        (kind,) = struct.unpack_from("<I", data, pos)
        pos += 4
        meta[key] = value(kind)
    return meta


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


def _meta(kv: dict[str, Any]) -> dict[str, Any]:
    tokens = kv.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFTokenizerError("GGUF file carries no tokenizer (tokenizer.ggml.tokens missing)")

    def token_id(key: str) -> int | None:
        value = kv.get(key)
        return None if value is None or not 0 <= int(value) < len(tokens) else int(value)

    arch = kv.get("general.architecture", "llama")
    ids = {k: token_id(f"tokenizer.ggml.{k}") for k in
           ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "eot_token_id")}
    return {
        "model": kv.get("tokenizer.ggml.model"),
        "pre": kv.get("tokenizer.ggml.pre", "default"),
        "vocab_size": len(tokens),
        **ids,
        "bos_token": None if ids["bos_token_id"] is None else tokens[ids["bos_token_id"]],
        "eos_token": None if ids["eos_token_id"] is None else tokens[ids["eos_token_id"]],
        "unk_token": None if ids["unknown_token_id"] is None else tokens[ids["unknown_token_id"]],
        "pad_token": None if ids["padding_token_id"] is None else tokens[ids["padding_token_id"]],
        "add_bos_token": bool(kv.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(kv.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": kv.get("tokenizer.chat_template"),
        "context_length": kv.get(f"{arch}.context_length"),
        "name": kv.get("general.name"),
    }


def gguf_tokenizer_meta(path: str | os.PathLike) -> dict[str, Any]:
    """Special token ids and strings, chat_template, add_bos_token, context_length, ... of a GGUF.

    Keys: model, pre, vocab_size, bos_token_id, eos_token_id, unknown_token_id,
    padding_token_id, eot_token_id, bos_token, eos_token, unk_token, pad_token,
    add_bos_token, add_eos_token, chat_template, context_length, name (None when absent).
    """
    return _meta(read_gguf_metadata(path))


def tokenizer_from_metadata(kv: dict[str, Any]) -> Tokenizer:
    """As tokenizer_from_gguf, from what read_gguf_metadata returned."""
    meta = _meta(kv)
    if meta["model"] != "gpt2":
        raise GGUFTokenizerError(f"unsupported tokenizer.ggml.model {meta['model']!r}: "
                                 "only byte-level BPE ('gpt2') vocabularies are supported")
    tokens: list[str] = kv.get("tokenizer.ggml.tokens")
    token_types: list[int] = kv.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    merges: list[str] = kv.get("tokenizer.ggml.merges") or []
    if len(token_types) != len(tokens):
        raise GGUFTokenizerError("tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length")
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise GGUFTokenizerError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((left, right))

    vocab = {token: i for i, token in enumerate(tokens)}
    # Llama 3 looks a whole pre-token up in the vocabulary before merging (llama.cpp's
    # ignore_merges; HF's tokenizer.json says the same).
    ignore_merges = meta["pre"] in ("llama-bpe", "llama3")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                                     ignore_merges=ignore_merges))
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
    return tokenizer_from_metadata(read_gguf_metadata(path))
