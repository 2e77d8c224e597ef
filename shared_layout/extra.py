"""The variable-size sampling data of a request, as int32 words in the prompt arena.

    frontend: logit_bias {id: bias}, allowed ids, bad-word token sequences, the structured-output
        token automaton (already encoded: automaton.py) -> encode_extra -> words written at the slot's extra_offset (before the state word)
    daemon: words copied out of the arena -> decode_extra -> SamplingExtra (or ValueError:
        the slot ends INVALID_REQUEST)

Layout (layout.py's docstring): logit_bias ids [n] | logit_bias values as float32 bits [n]
| allowed ids [m] | bad words as (length, ids...) sequences | automaton words. The counts travel
in the slot (n_logit_bias, n_allowed_ids, bad_words_words, automaton_words).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .automaton import MAX_AUTOMATON_WORDS, TokenAutomaton, decode

MAX_BAD_WORD_TOKENS = 64    # tokens of one bad-word sequence at most
MAX_LOGIT_BIAS = 1024       # logit_bias pairs at most
MAX_ALLOWED_IDS = 1 << 18   # allowed token ids at most
MAX_BAD_WORDS_WORDS = 1 << 14   # words of the bad-word sequences at most (the backend checks all three)


@dataclasses.dataclass(frozen=True)
class SamplingExtra:
    logit_bias: tuple[tuple[int, float], ...] = ()     # (token id, bias) pairs
    allowed_token_ids: tuple[int, ...] = ()            # empty: every token allowed
    bad_words: tuple[tuple[int, ...], ...] = ()        # token sequences never to complete
    automaton: bytes = b""                             # automaton.py's words as little-endian int32 bytes

    @property
    def counts(self) -> tuple[int, int, int]:
        """(n_logit_bias, n_allowed_ids, bad_words_words) as the slot carries them."""
        return len(self.logit_bias), len(self.allowed_token_ids), sum(1 + len(w) for w in self.bad_words)

    @property
    def automaton_words(self) -> int:
        return len(self.automaton) // 4

    @property
    def words(self) -> int:
        """Words of the whole encoding (what the prompt arena must hold after the prompt)."""
        n_lb, n_al, n_bw = self.counts
        return 2 * n_lb + n_al + n_bw + self.automaton_words

    def __bool__(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words or self.automaton)


def encode_extra(extra: SamplingExtra) -> np.ndarray:
    """The words to write at extra_offset ([extra_words] int32)."""
    n_lb, n_al, n_bw = extra.counts
    out = np.empty(extra.words, "<i4")
    if n_lb:
        out[:n_lb] = [t for t, _ in extra.logit_bias]
        out[n_lb:2 * n_lb] = np.array([b for _, b in extra.logit_bias], "<f4").view("<i4")
    out[2 * n_lb:2 * n_lb + n_al] = extra.allowed_token_ids
    at = 2 * n_lb + n_al
    for w in extra.bad_words:
        out[at] = len(w)
        out[at + 1:at + 1 + len(w)] = w
        at += 1 + len(w)
    out[at:] = np.frombuffer(extra.automaton, "<i4")
    return out


def decode_extra(words: np.ndarray, n_logit_bias: int, n_allowed_ids: int, bad_words_words: int,
                 vocab_size: int, automaton_words: int = 0) -> SamplingExtra:
    """Parse and check the words a slot points at; ValueError names what is wrong (the automaton's
    words are checked by automaton.decode too; `decode_automaton` gives them back decoded)."""
    words = np.asarray(words, "<i4")
    if words.size != 2 * n_logit_bias + n_allowed_ids + bad_words_words + automaton_words:
        raise ValueError("sampling data length does not match its counts")
    if (n_logit_bias > MAX_LOGIT_BIAS or n_allowed_ids > MAX_ALLOWED_IDS or bad_words_words > MAX_BAD_WORDS_WORDS
            or automaton_words > MAX_AUTOMATON_WORDS):
        raise ValueError("sampling data larger than a slot may carry")
    automaton = b""
    if automaton_words:
        tail = np.ascontiguousarray(words[words.size - automaton_words:])
        decode(tail, vocab_size)
        automaton = tail.tobytes()
        words = words[:words.size - automaton_words]
    ids = words[:n_logit_bias]
    biases = words[n_logit_bias:2 * n_logit_bias].view("<f4")
    allowed = words[2 * n_logit_bias:2 * n_logit_bias + n_allowed_ids]
    for name, arr in (("logit_bias", ids), ("allowed_token_ids", allowed)):
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab_size):
            raise ValueError(f"{name} holds a token id outside the vocabulary")
    if biases.size and not bool((np.abs(biases) <= 100.0).all()):    # NaN fails the comparison too
        raise ValueError("logit_bias values must be finite, in [-100, 100]")
    bad, rest = [], words[2 * n_logit_bias + n_allowed_ids:].tolist()
    i = 0
    while i < len(rest):
        n = rest[i]
        if not 1 <= n <= MAX_BAD_WORD_TOKENS or i + 1 + n > len(rest):
            raise ValueError("malformed bad_words sequence")
        w = tuple(rest[i + 1:i + 1 + n])
        if min(w) < 0 or max(w) >= vocab_size:
            raise ValueError("bad_words holds a token id outside the vocabulary")
        bad.append(w)
        i += 1 + n
    return SamplingExtra(tuple(zip(ids.tolist(), biases.tolist())), tuple(allowed.tolist()), tuple(bad), automaton)


def decode_automaton(extra: SamplingExtra, vocab_size: int) -> TokenAutomaton | None:
    """The request's token automaton (already checked by decode_extra), or None."""
    if not extra.automaton:
        return None
    return decode(np.frombuffer(extra.automaton, "<i4"), vocab_size)
