"""Incremental detokenization of one request's output, with stop strings and stop tokens.

    token ids (one batch per ring read) -> ending tokens cut (EOS unless ignore_eos,
    stop_token_ids: they end the request and are not rendered) -> prefix/read
    offsets (vLLM's algorithm: decode the window [prefix_offset:] and the part
    [prefix_offset:read_offset] already shown; the difference is new text, held
    back while it ends in U+FFFD, i.e. mid UTF-8 sequence) -> stop-string matcher
    (holds back the longest tail that could still start a stop string; a match
    truncates the output and ends the request) -> text deltas for SSE chunks.

A batch is decoded with one `Tokenizer.decode` call over its own tokens (plus a
prefix window and a second call for decoders that are not byte-level), so the cost per token falls as the frontend falls behind and batches grow. When a stop
string completes inside a batch, the batch is replayed token by token so the
usage count stops at the token that completed it. One `Detokenizer` per
request; not thread-safe, never blocks.
"""
from __future__ import annotations

import dataclasses

from tokenizers import Tokenizer, decoders

REPLACEMENT = "\ufffd"   # what decode() renders for bytes of an incomplete UTF-8 sequence


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

    def would_match(self, text: str) -> bool:
        """Whether feeding `text` would complete a stop string (nothing changes)."""
        pending = self.held + text
        return any(s in pending for s in self.stops)

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
        self._decode = tokenizer.decode
        # Byte-level BPE decodes by concatenation at character boundaries: once text is shown,
        # the next decode needs no prefix. Other decoders (Metaspace strips a leading space)
        # keep vLLM's prefix window for context.
        self._concatenative = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._skip = skip_special_tokens
        self._stop_ids = frozenset(int(t) for t in stop_token_ids)
        self._end_ids = frozenset(int(t) for t in eos_ids) | self._stop_ids
        self._stops = StopMatcher(stop, include_stop_str_in_output)
        self._window: list[int] = []   # ids[prefix_offset:]
        self._read = 0                 # read_offset - prefix_offset: window tokens already shown
        self._prefix_text = ""         # decode(window[:read]), cached
        self.tokens_seen = 0           # tokens consumed, the ending one included (usage counts it)
        self.finished = False
        self.stop_reason: int | str | None = None
        self._emitted: list[str] = []

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stops.stops)

    def ends_in(self, ids: list[int]) -> bool:
        """Whether a batch holds an id that ends the request (EOS unless ignored, a stop token id)."""
        return bool(self._end_ids) and not self._end_ids.isdisjoint(ids)

    # -- offsets ------------------------------------------------------------------
    def _advance(self, ids: list[int]) -> str:
        """Append ids; the new text, or "" while the window ends mid-character."""
        w = self._window
        w.extend(ids)
        text = self._decode(w, skip_special_tokens=self._skip)
        if len(text) > len(self._prefix_text) and not text.endswith(REPLACEMENT):
            new = text[len(self._prefix_text):]
            if self._concatenative:
                # Shown text ends on a character boundary and needs no context: start afresh.
                self._window, self._read, self._prefix_text = [], 0, ""
            else:
                # prefix_offset <- read_offset, read_offset <- end
                self._window = w[self._read:]
                self._read = len(self._window)
                self._prefix_text = self._decode(self._window, skip_special_tokens=self._skip)
            return new
        return ""

    def _held_text(self) -> str:
        """Text decoded past read_offset but held because the window ends mid-character."""
        if len(self._window) == self._read:
            return ""
        text = self._decode(self._window, skip_special_tokens=self._skip).rstrip(REPLACEMENT)
        return text[len(self._prefix_text):]

    # -- feeding ------------------------------------------------------------------
    def feed(self, token_ids) -> Delta:
        """Consume a batch of new token ids; tokens after the end are ignored."""
        if self.finished:
            return Delta("", True, self.stop_reason)
        ids = token_ids if isinstance(token_ids, list) else [int(t) for t in token_ids]
        cut = None
        if self._end_ids and not self._end_ids.isdisjoint(ids):
            cut = next(i for i, t in enumerate(ids) if t in self._end_ids)
        body = ids if cut is None else ids[:cut]
        if self._stops.stops:
            saved = (list(self._window), self._read, self._prefix_text)
            text = self._advance(body) if body else ""
            # Text held for an incomplete character at the end may already hold a match.
            seen = text or self._held_text()
            if self._stops.would_match(seen):
                self._window, self._read, self._prefix_text = saved
                return self._feed_each(ids)
            out = self._stops.feed(text)
        else:
            out = self._advance(body) if body else ""
        self.tokens_seen += len(body)
        if cut is not None:
            out += self._end(ids[cut])
        return self._delta(out)

    def _feed_each(self, ids: list[int]) -> Delta:
        """Token by token: exact accounting when a stop string completes inside the batch."""
        out = []
        for t in ids:
            if t in self._end_ids:
                out.append(self._end(t))
                break
            self.tokens_seen += 1
            out.append(self._stops.feed(self._advance([t])))
            if self._stops.matched is not None:
                self.finished, self.stop_reason = True, self._stops.matched
                break
        return self._delta("".join(out))

    def _end(self, token: int) -> str:
        """An ending token: counted, not rendered; what was held back goes out."""
        self.tokens_seen += 1
        out = self._finish_text()
        if not self.finished:
            self.finished = True
            self.stop_reason = token if token in self._stop_ids else None
        return out

    def _finish_text(self) -> str:
        """Held text at the end of the request: the incomplete-character tail minus its broken bytes
        (a stop string may still complete in it), then what the stop matcher held back."""
        text = self._decode(self._window, skip_special_tokens=self._skip).rstrip(REPLACEMENT)
        rest = text[len(self._prefix_text):] if len(text) > len(self._prefix_text) else ""
        self._window, self._read, self._prefix_text = [], 0, ""
        out = self._stops.feed(rest) if rest else ""
        if self._stops.matched is not None:
            self.finished, self.stop_reason = True, self._stops.matched
            return out
        return out + self._stops.flush()

    def _delta(self, text: str) -> Delta:
        if text:
            self._emitted.append(text)
        return Delta(text, self.finished, self.stop_reason)

    def flush(self) -> str:
        """The request ended without a stop: emit what was held back.

        Bytes of an incomplete UTF-8 sequence at the very end (max_tokens cut a
        character in half) are dropped, never rendered as U+FFFD.
        """
        if self.finished:
            return ""
        text = self._finish_text()
        if text:
            self._emitted.append(text)
        return text

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)
