"""A structured-output constraint as a token automaton: its words in the ring, and the checks on them.

    frontend (dpu_frontend/structured): constraint -> regex -> outlines-core Index (a DFA over
        the model's token ids) -> TokenAutomaton -> encode() -> int32 words after the slot's
        other sampling data in the prompt arena (the slot's `automaton_words` counts them)
    daemon (gpu_backend): words copied out of the arena -> decode(words, vocab) -> TokenAutomaton
        (or ValueError: the slot ends INVALID_REQUEST) -> per step, the sampler masks a row to
        `allowed(state)` and moves to `next_state(state, token)`

Layout (docs/structured_outputs.md draws it), all int32 words:

    header   [4]            n_states | initial state | run words | transition words
    states   [n_states, 6]  flags (bit 0: accepting) | default next state (-1: none)
                            | first run | runs | first transition | transitions
    runs     [run words]    (first token, end token) pairs: the allowed ids [first, end), sorted,
                            disjoint; states with the same allowed set share their runs
    trans    [trans words]  (token, next state) pairs, sorted by token: the allowed tokens whose
                            next state is not the state's default

An allowed token's next state is its transition's, else the state's default. At an
accepting state the end-of-sequence tokens are allowed too (the daemon adds them); an
accepting state with no runs allows only them. Everything here is numpy; no torch.
"""
from __future__ import annotations

import dataclasses

import numpy as np

HEADER_WORDS = 4
STATE_WORDS = 6
FLAG_ACCEPTING = 1
MAX_AUTOMATON_WORDS = 1 << 21     # 8 MiB of the prompt arena at most (the backend checks it too)


@dataclasses.dataclass(eq=False)
class TokenAutomaton:
    """A DFA over token ids in the ring's encoding (arrays are views of `words`)."""
    words: np.ndarray            # [n] int32: the encoding itself
    initial: int
    states: np.ndarray           # [n_states, 6] int32
    runs: np.ndarray             # [n_runs, 2] int32
    trans: np.ndarray            # [n_trans, 2] int32
    masks: dict = dataclasses.field(default_factory=dict)   # the daemon's per-state token masks, made on use

    @property
    def n_states(self) -> int:
        return int(self.states.shape[0])

    def accepting(self, state: int) -> bool:
        return bool(self.states[state, 0] & FLAG_ACCEPTING)

    def allowed_runs(self, state: int) -> np.ndarray:
        """[k, 2] (first, end) ranges of the tokens allowed in `state` (EOS not included)."""
        r0, rn = int(self.states[state, 2]), int(self.states[state, 3])
        return self.runs[r0:r0 + rn]

    def allowed(self, state: int, vocab: int) -> np.ndarray:
        """[vocab] bool: tokens allowed in `state` (a difference array over its runs, no per-token loop)."""
        runs = self.allowed_runs(state)
        delta = np.zeros(vocab + 1, np.int32)
        np.add.at(delta, runs[:, 0], 1)
        np.add.at(delta, runs[:, 1], -1)
        return np.cumsum(delta[:vocab]) > 0

    def next_state(self, state: int, token: int) -> int:
        """The state after `token` (-1: the token is not allowed there)."""
        s = self.states[state]
        t0, tn = int(s[4]), int(s[5])
        toks = self.trans[t0:t0 + tn, 0]
        i = int(np.searchsorted(toks, token))
        if i < tn and int(toks[i]) == token:
            return int(self.trans[t0 + i, 1])
        runs = self.allowed_runs(state)
        j = int(np.searchsorted(runs[:, 0], token, side="right")) - 1
        if j >= 0 and token < int(runs[j, 1]):
            return int(s[1])
        return -1


def from_transitions(transitions: dict[int, dict[int, int]], initial: int, accepting: set[int] | frozenset[int],
                     drop_tokens: frozenset[int] = frozenset()) -> np.ndarray:
    """Encode a DFA given as {state: {token: next state}} (any state ids) into ring words.
    Tokens in `drop_tokens` (EOS: the accepting flag stands for it) are left out."""
    ids = sorted(set(transitions) | set(accepting) | {initial})
    id_array = np.array(ids, np.int64)
    index = {s: i for i, s in enumerate(ids)}
    states = np.zeros((len(ids), STATE_WORDS), np.int64)
    run_chunks, trans_chunks = [], []
    shared: dict[bytes, tuple[int, int]] = {}      # allowed set (as its runs' bytes) -> (first run, runs)
    n_runs = n_trans = 0
    dropped = np.array(sorted(drop_tokens), np.int64)
    for i, s in enumerate(ids):
        d = transitions.get(s, {})
        states[i, 0] = FLAG_ACCEPTING if s in accepting else 0
        states[i, 1] = -1
        keys = np.fromiter(d.keys(), np.int64, len(d))
        order = np.argsort(keys)
        toks = keys[order]
        nxt = np.searchsorted(id_array, np.fromiter(d.values(), np.int64, len(d))[order])
        if dropped.size:
            keep = ~np.isin(toks, dropped)
            toks, nxt = toks[keep], nxt[keep]
        if not toks.size:
            continue
        breaks = np.flatnonzero(np.diff(toks) != 1) + 1
        firsts = toks[np.concatenate(([0], breaks))]
        ends = toks[np.concatenate((breaks - 1, [len(toks) - 1]))] + 1
        runs = np.stack([firsts, ends], 1)
        key = runs.tobytes()
        if key not in shared:
            shared[key] = (n_runs, len(runs))
            run_chunks.append(runs)
            n_runs += len(runs)
        default = int(np.bincount(nxt).argmax())
        other = nxt != default
        states[i, 1] = default
        states[i, 2:4] = shared[key]
        states[i, 4:6] = (n_trans, int(other.sum()))
        trans_chunks.append(np.stack([toks[other], nxt[other]], 1))
        n_trans += int(other.sum())
    runs = np.concatenate(run_chunks) if run_chunks else np.zeros((0, 2), np.int64)
    trans = np.concatenate(trans_chunks) if trans_chunks else np.zeros((0, 2), np.int64)
    head = np.array([len(ids), index[initial], runs.size, trans.size], np.int64)
    return np.concatenate([head, states.ravel(), runs.ravel(), trans.ravel()]).astype("<i4")


def decode(words: np.ndarray, vocab: int) -> TokenAutomaton:
    """Parse and check ring words; ValueError names what is wrong (every index is range-checked,
    with array operations, before anything uses it)."""
    w = np.asarray(words, "<i4")
    if w.size > MAX_AUTOMATON_WORDS:
        raise ValueError("automaton larger than a slot may carry")
    if w.size < HEADER_WORDS:
        raise ValueError("automaton shorter than its header")
    n_states, initial, n_run_words, n_trans_words = (int(x) for x in w[:HEADER_WORDS])
    if (n_states <= 0 or n_run_words < 0 or n_trans_words < 0 or n_run_words % 2 or n_trans_words % 2
            or HEADER_WORDS + n_states * STATE_WORDS + n_run_words + n_trans_words != w.size):
        raise ValueError("automaton header does not match its length")
    if not 0 <= initial < n_states:
        raise ValueError("automaton initial state out of range")
    at = HEADER_WORDS + n_states * STATE_WORDS
    states = w[HEADER_WORDS:at].reshape(n_states, STATE_WORDS)
    runs = w[at:at + n_run_words].reshape(-1, 2)
    trans = w[at + n_run_words:].reshape(-1, 2)
    n_runs, n_trans = runs.shape[0], trans.shape[0]
    s = states.astype(np.int64)
    has_runs = s[:, 3] > 0
    if ((s[:, 1] < -1) | (s[:, 1] >= n_states) | (has_runs & (s[:, 1] < 0))).any():
        raise ValueError("automaton default state out of range")
    if ((s[:, 2] < 0) | (s[:, 3] < 0) | (s[:, 2] + s[:, 3] > n_runs)
            | (s[:, 4] < 0) | (s[:, 5] < 0) | (s[:, 4] + s[:, 5] > n_trans)).any():
        raise ValueError("automaton state points outside its runs or transitions")
    if runs.size and ((runs[:, 0] < 0) | (runs[:, 1] > vocab) | (runs[:, 0] >= runs[:, 1])).any():
        raise ValueError("automaton run outside the vocabulary")
    if trans.size and ((trans[:, 0] < 0) | (trans[:, 0] >= vocab) | (trans[:, 1] < 0)
                       | (trans[:, 1] >= n_states)).any():
        raise ValueError("automaton transition out of range")
    # runs sorted and disjoint within each state's range; transitions sorted within theirs
    if n_runs > 1:
        ok = runs[1:, 0] >= runs[:-1, 1]
        starts = np.zeros(n_runs, bool)
        starts[s[has_runs, 2]] = True
        if not (ok | starts[1:]).all():
            raise ValueError("automaton runs not sorted")
    if n_trans > 1:
        ok = trans[1:, 0] > trans[:-1, 0]
        starts = np.zeros(n_trans, bool)
        starts[s[s[:, 5] > 0, 4]] = True
        if not (ok | starts[1:]).all():
            raise ValueError("automaton transitions not sorted")
    return TokenAutomaton(w, initial, states, runs, trans)
