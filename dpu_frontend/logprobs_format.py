"""Logprob records from the ring -> the OpenAI response shapes. No I/O.

    handle.batch_logprobs / handle.prompt_logprobs ([n, 2 + 2k] int32 words, the daemon's
    records: shared_layout.layout.decode_logprob_records) + the tokens they score
      -> completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
         (top_logprobs: {token text: logprob} of the scored token, then the k most likely;
         an echoed prompt's first token has null logprob and null top_logprobs)
      -> chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [k most likely]}]}
      -> prompt_logprobs (vLLM's extension): [null, {id: {"logprob", "rank", "decoded_token"}}, ...]

Token text is each id decoded alone, special tokens kept (vLLM's decoded_token), cached
per tokenizer. Logprobs below -9999 (and -inf) are written as -9999.0 as vLLM does; a
record the daemon could not fill (NaN) is written as null.
"""
from __future__ import annotations

import math

import numpy as np

from shared_layout.layout import decode_logprob_records, logprob_record_words

FLOOR = -9999.0


class TokenText:
    """id -> the token's text alone (cached: at most one entry per vocabulary id)."""

    def __init__(self, decode):
        self._decode = decode
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self._decode([token_id], skip_special_tokens=False)
        return s


def _value(v: float) -> float | None:
    if math.isnan(v):
        return None
    return max(float(v), FLOOR)


def _decoded(records: np.ndarray, k: int):
    return decode_logprob_records(records.reshape(-1), k)


def record_k(records: np.ndarray) -> int:
    """The top count k of [n, 2 + 2k] records."""
    k = (records.shape[1] - 2) // 2
    assert logprob_record_words(k) == records.shape[1]
    return k


class CompletionLogprobs:
    """Accumulates the completions `logprobs` object over a reply (streamed: one piece per chunk)."""

    def __init__(self, text: TokenText, text_offset: int = 0):
        self.text = text
        self.offset = text_offset       # text_offset of the next token

    def piece(self, tokens: list[int], records: np.ndarray | None, first_is_null: bool = False) -> dict:
        """The object for `tokens` (records [len(tokens), words], or [len - 1] with first_is_null:
        an echoed prompt, whose first token has none)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if not tokens:
            return out
        k = record_k(records) if records is not None and records.size else 0
        lp, _, ids, tops = _decoded(records, k) if records is not None and records.size else ((), (), (), ())
        j = 0
        for i, t in enumerate(tokens):
            s = self.text(t)
            out["tokens"].append(s)
            out["text_offset"].append(self.offset)
            self.offset += len(s)
            if first_is_null and i == 0:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            v = _value(lp[j])
            out["token_logprobs"].append(v)
            top = {s: v}
            for tid, tv in zip(ids[j].tolist(), tops[j].tolist()):
                top.setdefault(self.text(tid), _value(tv))
            out["top_logprobs"].append(top if v is not None else None)
            j += 1
        return out


def merge_completion(a: dict | None, b: dict) -> dict:
    """Two pieces of one reply, in order."""
    if a is None:
        return b
    return {key: a[key] + b[key] for key in a}


def chat_content(text: TokenText, tokens: list[int], records: np.ndarray, top_n: int) -> list[dict]:
    """The chat `logprobs.content` entries of `tokens` (top_logprobs: the top_n most likely)."""
    k = record_k(records)
    lp, _, ids, tops = _decoded(records, k)
    out = []
    for i, t in enumerate(tokens):
        s = text(t)
        out.append({"token": s, "logprob": _value(lp[i]), "bytes": list(s.encode("utf-8", "replace")),
                    "top_logprobs": [{"token": text(tid), "logprob": _value(tv),
                                      "bytes": list(text(tid).encode("utf-8", "replace"))}
                                     for tid, tv in zip(ids[i, :top_n].tolist(), tops[i, :top_n].tolist())]})
    return out


def prompt_logprobs(text: TokenText, prompt: list[int], records: np.ndarray) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: null for the first token, then {id: {logprob, rank, decoded_token}}
    with the prompt token first and the k most likely after it."""
    k = record_k(records)
    lp, rank, ids, tops = _decoded(records, k)
    out: list[dict | None] = [None]
    for j, t in enumerate(prompt[1:]):
        entry = {str(t): {"logprob": _value(lp[j]), "rank": int(rank[j]), "decoded_token": text(t)}}
        for r, (tid, tv) in enumerate(zip(ids[j].tolist(), tops[j].tolist()), 1):
            entry.setdefault(str(tid), {"logprob": _value(tv), "rank": r, "decoded_token": text(tid)})
        out.append(entry)
    return out


class ReplyLogprobs:
    """One reply's logprobs as its batches arrive: each `add` returns the piece for one chunk
    (completions: the object; chat: {"content": [...]}) and extends `total` (the whole reply's)."""

    def __init__(self, text: TokenText, chat: bool, top_n: int):
        self.text = text
        self.chat = chat
        self.top_n = top_n
        self.completion = None if chat else CompletionLogprobs(text)
        self.total: dict | None = None

    def add(self, tokens: list[int], records: np.ndarray | None, first_is_null: bool = False) -> dict:
        if self.chat:
            content = chat_content(self.text, tokens, records, self.top_n) if tokens and records is not None else []
            piece = {"content": content}
            self.total = piece if self.total is None else {"content": self.total["content"] + content}
        else:
            piece = self.completion.piece(tokens, records, first_is_null)
            self.total = merge_completion(self.total, piece)
        return piece
