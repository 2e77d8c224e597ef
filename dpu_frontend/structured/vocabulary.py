"""The model's vocabulary as the bytes each token stands for, for outlines-core.

    tokenizers.Tokenizer -> token_bytes() -> {bytes: [ids]} (special / added tokens left out:
    a structure never contains them; EOS is handed to the automaton separately)
    -> outlines_core.Vocabulary(eos id, that map)

Byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen): each character of a token's string is one
byte through GPT-2's byte <-> unicode table. SentencePiece-style vocabularies: '▁' is a
space and <0xNN> is byte NN. Anything else: the token decoded alone, as UTF-8.
"""
from __future__ import annotations

import functools
import re

from tokenizers import Tokenizer

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's table: the printable characters byte-level BPE writes for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tok: Tokenizer) -> dict[bytes, list[int]]:
    """{the bytes a token decodes to: its ids} for every ordinary token of `tok`."""
    special = set(tok.get_added_tokens_decoder())
    vocab = tok.get_vocab(with_added_tokens=False)
    kind = type(tok.decoder).__name__ if tok.decoder is not None else ""
    out: dict[bytes, list[int]] = {}
    table = _unicode_to_byte()
    for text, i in vocab.items():
        if i in special:
            continue
        if kind == "ByteLevel" and all(c in table for c in text):
            b = bytes(table[c] for c in text)
        elif (m := _BYTE_TOKEN.match(text)) is not None:
            b = bytes([int(m.group(1), 16)])
        elif kind in ("Metaspace", "Sequence"):
            b = text.replace("\u2581", " ").encode()
        else:
            b = tok.decode([i], skip_special_tokens=False).encode()
        if b:
            out.setdefault(b, []).append(i)
    return out
