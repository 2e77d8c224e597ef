"""Incremental detokenization of one request's output, with stop strings and stop tokens.

    token ids (batches from the ring) -> ending tokens cut (EOS unless ignore_eos,
    stop_token_ids: end the request, not rendered) -> DecodeStream (prefix/read
    offsets in Rust, the algorithm vLLM uses: a token whose bytes end mid UTF-8
    sequence yields nothing until the sequence completes, so no U+FFFD ever leaks)
    -> stop-string matcher (holds back the longest tail that could still start a
    stop string; a match truncates the output and ends the request)
    -> text deltas for SSE chunks.

One `Detokenizer` per request; not thread-safe, never blocks (a step is a few
microseconds of Rust per token).
"""
from __future__ import annotations

import dataclasses

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


@dataclasses.dataclass
class Delta:
    """What one batch of tokens adds to the reply."""
    text: str
    finished: bool = False                 # the request ended in this batch (stop string or stop token)
    stop_reason: int | str | None = None   # the matched stop string or stop token id (vLLM's stop_reason)


class StopMatcher:
    """Finds the first stop string in streamed text without ever emitting a partial match.

    Invariant: `held` is the longest tail of the unsent text that is a proper
    prefix of some stop string, so a match can only start inside `held` or in
    text not yet seen; everything before it has been emitted and is final.
    """

    def __init__(self, stops: tuple[str, ...], include_stop: bool = False):
        self.stops = tuple(s for s in stops if s)
        self.include_stop = include_stop
        self.held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Text safe to emit now; sets `matched` when a stop string completes."""
        if not self.stops:
            return text
        pending = self.held + text
        best, best_at = None, len(pending)
        for s in self.stops:
            at = pending.find(s, 0, best_at + len(s))
            if at != -1 and at < best_at:
                best, best_at = s, at
        if best is not None:
            self.matched, self.held = best, ""
            return pending[:best_at + (len(best) if self.include_stop else 0)]
        keep = self._tail_len(pending)
        self.held = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep]

    def flush(self) -> str:
        """At the end of the request: the held tail was never a stop string."""
        held, self.held = self.held, ""
        return held

    def _tail_len(self, text: str) -> int:
        longest = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest


class Detokenizer:
    """Turns a request's output token ids into text deltas (see module docstring)."""

    def __init__(self, tokenizer: Tokenizer, *, eos_ids=frozenset(), stop_token_ids=(),
                 stop: tuple[str, ...] = (), include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True):
        """eos_ids: pass none when the request sets ignore_eos. stop_token_ids: vLLM's, reported
        as stop_reason when they end the request (EOS reports None)."""
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop_ids = frozenset(int(t) for t in stop_token_ids)
        self._end_ids = frozenset(int(t) for t in eos_ids) | self._stop_ids
        self._stops = StopMatcher(stop, include_stop_str_in_output)
        self.tokens_seen = 0       # tokens consumed, the ending one included (usage counts it)
        self.finished = False
        self.stop_reason: int | str | None = None
        self._emitted: list[str] = []

    def feed(self, token_ids) -> Delta:
        """Consume a batch of new token ids; tokens after the end are ignored."""
        if self.finished:
            return Delta("", True, self.stop_reason)
        out = []
        step, tok, end_ids = self._stream.step, self._tokenizer, self._end_ids
        for t in token_ids:
            t = int(t)
            self.tokens_seen += 1
            if t in end_ids:
                self.finished = True
                self.stop_reason = t if t in self._stop_ids else None
                out.append(self._stops.flush())
                break
            piece = step(tok, t)
            if piece:
                safe = self._stops.feed(piece)
                if safe:
                    out.append(safe)
                if self._stops.matched is not None:
                    self.finished, self.stop_reason = True, self._stops.matched
                    break
        text = "".join(out)
        self._emitted.append(text)
        return Delta(text, self.finished, self.stop_reason)

    def flush(self) -> str:
        """The request ended without a stop: emit the text held back for stop matching.

        Bytes of an incomplete UTF-8 sequence at the very end (max_tokens cut a
        character in half) are dropped, never rendered as U+FFFD.
        """
        if self.finished:
            return ""
        text = self._stops.flush()
        self._emitted.append(text)
        return text

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)
