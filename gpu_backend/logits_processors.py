"""Logits processors: the per-request rules that reshape a batch's logits before sampling.

    raw logits [N, vocab] float32 (one row per sequence sampling this step)
      -> structured output: the token automaton's current state (every token it does not
         allow -inf; at an accepting state the stop ids, EOS among them, are allowed too)
      -> allowed_token_ids (every other token -inf)
      -> bad words (a sequence's last token -inf where the output ends with its prefix)
      -> min_tokens (stop ids, EOS included unless ignore_eos, -inf while output < min_tokens)
      -> logit_bias (added)
      -> penalties: repetition on tokens of prompt or output (logit > 0: / p, else * p),
         frequency (- f * output count), presence (- p * [output count > 0])
      -> processed logits [N, vocab] (sampling.py: greedy argmax, or temperature, min_p,
         top-k, top-p and a draw)

vLLM v1's order and formulas (its sampler's apply_logits_processors and
apply_penalties). Each rule is one tensor op over the batch: the per-sequence
work is only collecting (row, token) index pairs from short lists (bias pairs,
bad words, stop ids) and, for penalties, each sequence's output-count vector
([vocab] int32, kept up to date incrementally in its PenaltyState) stacked into
[R, vocab]. A batch with no such request returns its logits untouched. An
automaton state's mask ([vocab] bool, from its token runs by a difference array)
is built once per sequence and state and reused; the sampler steps the state
(`advance`) after it draws the token.
"""
from __future__ import annotations

import dataclasses

import torch

from .scheduler.sequence import Sequence


@dataclasses.dataclass(eq=False)
class PenaltyState:
    """One sequence's token statistics for the penalties."""
    prompt_mask: torch.Tensor      # [vocab] bool: token occurs in the prompt
    output_counts: torch.Tensor    # [vocab] int32: occurrences in the output so far
    counted: int = 0               # output tokens already in output_counts

    @classmethod
    def create(cls, seq: Sequence, vocab: int) -> "PenaltyState":
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[torch.tensor(seq.prompt, dtype=torch.long)] = True
        return cls(mask, torch.zeros(vocab, dtype=torch.int32))

    def update(self, output: list[int]) -> None:
        new = output[self.counted:]
        if new:
            idx = torch.tensor(new, dtype=torch.long)
            self.output_counts.index_put_((idx,), torch.ones(len(new), dtype=torch.int32), accumulate=True)
            self.counted = len(output)


def apply(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: [N, vocab] float32, row i for seqs[i] -> processed logits (a new tensor when any
    rule applies, else `logits` itself)."""
    if not any(s.params.processed for s in seqs):
        return logits
    x = logits.clone()
    _automaton(x, seqs)
    _allowed(x, seqs)
    neg_rows, neg_cols = [], []       # (row, token) pairs set to -inf: bad words and min_tokens
    for i, s in enumerate(seqs):
        for t in _banned(s):
            neg_rows.append(i)
            neg_cols.append(t)
    if neg_rows:
        x.index_put_((torch.tensor(neg_rows), torch.tensor(neg_cols)), torch.tensor(float("-inf")))
    _bias(x, seqs)
    _penalties(x, seqs)
    return x


def _automaton(x: torch.Tensor, seqs: list[Sequence]) -> None:
    rows = [i for i, s in enumerate(seqs) if s.params.automaton is not None]
    if not rows:
        return
    blocked = torch.stack([_blocked(seqs[i], x.shape[1]) for i in rows])          # [R, vocab] bool
    if len(rows) == x.shape[0]:
        x.masked_fill_(blocked, float("-inf"))
    else:
        idx = torch.tensor(rows)
        x[idx] = x[idx].masked_fill(blocked, float("-inf"))


def automaton_mask(s: Sequence, vocab: int) -> torch.Tensor:
    """[vocab] bool: the tokens s's automaton allows in its current state (stop ids at an accepting
    state, or at a dead one, so a finished structure can only end). Kept on the automaton, so the
    requests sharing it (intake caches decoded automata by their words) build each state's once."""
    a = s.params.automaton
    state = _state(s)
    key = (state, s.stop_ids)
    mask = a.masks.get(key)
    if mask is None:
        allowed = a.allowed(state, vocab)
        if a.accepting(state) or not allowed.any():
            stops = [t for t in s.stop_ids if t < vocab]
            allowed[stops] = True
        mask = a.masks[key] = torch.from_numpy(allowed)
    return mask


def _state(s: Sequence) -> int:
    """s's automaton state (-1 before its first step: the automaton's initial state)."""
    return s.params.automaton.initial if s.automaton_state < 0 else s.automaton_state


def _blocked(s: Sequence, vocab: int) -> torch.Tensor:
    """~automaton_mask(s), kept beside it."""
    a = s.params.automaton
    key = ("blocked", _state(s), s.stop_ids)
    mask = a.masks.get(key)
    if mask is None:
        mask = a.masks[key] = ~automaton_mask(s, vocab)
    return mask


def advance(seqs: list[Sequence], tokens: list[int]) -> None:
    """Step each constrained sequence's automaton over the token it sampled (a stop token ends
    the request, so a token with no transition leaves the state as it is)."""
    for s, t in zip(seqs, tokens):
        a = s.params.automaton
        if a is not None:
            state = _state(s)
            nxt = a.next_state(state, t)
            s.automaton_state = state if nxt < 0 else nxt


def _allowed(x: torch.Tensor, seqs: list[Sequence]) -> None:
    rows = [i for i, s in enumerate(seqs) if s.params.allowed_token_ids]
    if not rows:
        return
    keep = torch.zeros(len(rows), x.shape[1], dtype=torch.bool)                 # [R, vocab]
    r = [j for j, i in enumerate(rows) for _ in seqs[i].params.allowed_token_ids]
    c = [t for i in rows for t in seqs[i].params.allowed_token_ids]
    keep[torch.tensor(r), torch.tensor(c)] = True
    idx = torch.tensor(rows)
    x[idx] = x[idx].masked_fill(~keep, float("-inf"))


def _banned(s: Sequence) -> list[int]:
    """Tokens this sequence may not sample now: bad-word completions and, before min_tokens,
    its stop ids."""
    p = s.params
    out = []
    if p.bad_words:
        past = s.output
        for w in p.bad_words:
            n = len(w) - 1
            if n > len(past):
                continue
            if n == 0 or past[-n:] == list(w[:-1]):
                out.append(w[-1])
    if p.min_tokens and len(s.output) < p.min_tokens:
        out.extend(s.stop_ids)
    return out


def _bias(x: torch.Tensor, seqs: list[Sequence]) -> None:
    r = [i for i, s in enumerate(seqs) for _ in s.params.logit_bias]
    if not r:
        return
    c = [t for s in seqs for t, _ in s.params.logit_bias]
    v = [b for s in seqs for _, b in s.params.logit_bias]
    x.index_put_((torch.tensor(r), torch.tensor(c)), torch.tensor(v, dtype=x.dtype), accumulate=True)


def _penalties(x: torch.Tensor, seqs: list[Sequence]) -> None:
    rows = [i for i, s in enumerate(seqs) if s.params.penalized]
    if not rows:
        return
    vocab = x.shape[1]
    states = []
    for i in rows:
        s = seqs[i]
        if s.penalty_state is None:
            s.penalty_state = PenaltyState.create(s, vocab)
        s.penalty_state.update(s.output)
        states.append(s.penalty_state)
    counts = torch.stack([st.output_counts for st in states]).to(x.dtype)        # [R, vocab]
    out_mask = counts > 0                                                          # [R, vocab]
    seen = out_mask | torch.stack([st.prompt_mask for st in states])               # [R, vocab]
    params = [seqs[i].params for i in rows]
    rep = torch.tensor([p.repetition_penalty or 1.0 for p in params], dtype=x.dtype)[:, None]   # [R, 1]
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=x.dtype)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], dtype=x.dtype)[:, None]
    idx = torch.tensor(rows)
    y = x[idx]                                                                     # [R, vocab]
    penalty = torch.where(seen, rep, torch.ones_like(y))
    y = y * torch.where(y > 0, 1.0 / penalty, penalty)
    y = y - freq * counts - pres * out_mask.to(x.dtype)
    x[idx] = y
