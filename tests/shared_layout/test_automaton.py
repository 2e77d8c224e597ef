"""The token automaton's ring encoding: a DFA round-trips, and hostile words are refused."""
import numpy as np
import pytest

from shared_layout.automaton import HEADER_WORDS, STATE_WORDS, decode, from_transitions
from shared_layout.extra import SamplingExtra, decode_automaton, decode_extra, encode_extra

V = 40
EOS = 39
# states 10 -> 20 on tokens 1..5 (and 7 -> 30), 20 -> 20 on 1..3, 20 -> 30 on 9, 30 accepting (EOS dropped)
DFA = {10: {1: 20, 2: 20, 3: 20, 4: 20, 5: 20, 7: 30}, 20: {1: 20, 2: 20, 3: 20, 9: 30}, 30: {EOS: 30}}


def test_round_trip_allowed_and_next():
    words = from_transitions(DFA, 10, {30}, drop_tokens=frozenset({EOS}))
    a = decode(words, V)
    s0 = a.initial
    assert np.flatnonzero(a.allowed(s0, V)).tolist() == [1, 2, 3, 4, 5, 7]
    s1 = a.next_state(s0, 4)
    assert np.flatnonzero(a.allowed(s1, V)).tolist() == [1, 2, 3, 9]
    assert a.next_state(s1, 2) == s1 and a.next_state(s0, 6) == -1
    s2 = a.next_state(s1, 9)
    assert a.accepting(s2) and not a.allowed(s2, V).any() and not a.accepting(s1)
    assert a.next_state(s0, 7) == s2


def test_rides_in_the_sampling_data():
    words = from_transitions(DFA, 10, {30})
    extra = SamplingExtra(logit_bias=((3, 1.5),), bad_words=((1, 2),), automaton=words.tobytes())
    enc = encode_extra(extra)
    assert enc.size == extra.words == 2 + 3 + words.size
    back = decode_extra(enc, *extra.counts, vocab_size=V, automaton_words=extra.automaton_words)
    assert back == extra
    assert decode_automaton(back, V).n_states == 3


@pytest.mark.parametrize("corrupt", [
    lambda w: w[:-1],                                                  # length does not match the header
    lambda w: _set(w, 1, 99),                                          # initial state out of range
    lambda w: _set(w, HEADER_WORDS + 1, 7),                            # default next state out of range
    lambda w: _set(w, HEADER_WORDS + 3, 1000),                         # runs past the run table
    lambda w: _set(w, HEADER_WORDS + 3 * STATE_WORDS + 1, V + 5),      # a run past the vocabulary
    lambda w: _set(w, w.size - 1, 50),                                 # a transition to no state
])
def test_hostile_words_are_refused(corrupt):
    words = from_transitions({0: {1: 1, 2: 0, 5: 1}, 1: {3: 0}}, 0, {1})
    decode(words, V)
    with pytest.raises(ValueError):
        decode(corrupt(words.copy()), V)


def _set(w, i, v):
    w[i] = v
    return w


def test_the_documented_example():
    """docs/structured_outputs.md draws these words; keep the two in step."""
    w = from_transitions({0: {10: 3, 11: 3, 20: 1, 22: 2}, 1: {21: 3}, 2: {23: 3}, 3: {}}, 0, {3})
    assert w.tolist() == [4, 0, 10, 4,
                          0, 3, 0, 3, 0, 2, 0, 3, 3, 1, 2, 0, 0, 3, 4, 1, 2, 0, 1, -1, 0, 0, 0, 0,
                          10, 12, 20, 21, 22, 23, 21, 22, 23, 24,
                          20, 1, 22, 2]
