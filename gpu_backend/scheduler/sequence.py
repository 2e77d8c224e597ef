"""Sequence: the engine's copy of one claimed request and its progress.

    ring slot (validated by intake.py) -> Sequence (prompt copied out of the
    arena, sampling parameters and data, stop ids, a structured output's token
    automaton and its current state) -> engine: num_computed, KV
    block table, output tokens -> published back into the slot (tokens, and the
    logprob records the sampler left in `step_logprobs` / `prompt_logprobs`).

The prefix cache's keys of its full blocks (`block_hashes`, a hash chain over
prompt + output) are computed once, as blocks fill or when it waits, and survive
preemption, so a recomputed request finds its own blocks again.

A group (n choices of one prompt) is its leader Sequence holding the others in
`forks`: the leader prefills the prompt but its last token (`hold_last`), then the
engine forks the others from it (shared KV blocks) and every choice computes that
last token and samples its own first token in the next step.

Everything here lives in host memory; the ring sees only what the engine
publishes (tokens, logprob records, counts, states).
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 = greedy
    top_p: float = 1.0         # (0, 1]
    top_k: int = 0             # 0 = off
    seed: int | None = None    # per-request generator seed; None = fresh entropy
    min_p: float = 0.0         # [0, 1], 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0        # stop ids (EOS included unless ignore_eos) masked until this many tokens
    logprobs: int | None = None          # top entries per generated token's record; None: no records
    prompt_logprobs: int | None = None   # top entries per prompt token's record; None: no records
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()          # empty: all
    bad_words: tuple[tuple[int, ...], ...] = ()      # token sequences never completed
    automaton: object = None   # shared_layout.automaton.TokenAutomaton: structured output; None = free text

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty not in (0.0, 1.0))

    @property
    def processed(self) -> bool:
        """Whether any logits processor (logits_processors.py) applies to this request."""
        return bool(self.penalized or self.min_tokens or self.logit_bias or self.allowed_token_ids
                    or self.bad_words or self.automaton is not None)


@dataclasses.dataclass(eq=False)
class Sequence:
    slot: int
    seq: int                          # the frontend's request sequence number
    epoch: int                        # frontend_epoch of the submitter
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    stop_ids: frozenset[int]          # stop token ids plus EOS unless ignore_eos
    max_len: int                      # prompt + output never exceed this (context)
    output_offset: int = 0            # first token of its output range in the ring's output arena (claimed)
    output: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0             # tokens whose K/V is in the cache
    blocks: list[int] = dataclasses.field(default_factory=list)   # block table
    generator: object = None          # per-request torch.Generator, made by the sampler on first use
    penalty_state: object = None      # logits_processors.PenaltyState, made on first use
    step_logprobs: np.ndarray | None = None     # [1, record words] for the token sampled this step
    prompt_logprobs: np.ndarray | None = None   # [prompt_len - 1, record words], filled during prefill
    forks: list["Sequence"] = dataclasses.field(default_factory=list)   # group members not yet forked
    hold_last: bool = False           # a group leader before its fork: the prompt's last token is held back
    automaton_state: int = -1         # params.automaton's current state (-1: its initial state, not yet stepped)
    block_hashes: list[int] = dataclasses.field(default_factory=list)   # prefix-cache keys of its first full blocks
    num_committed: int = 0            # leading blocks of `blocks` already offered to the prefix cache
    priority: int = 0                 # lower runs first (PRIORITY policy)
    ttft_slo_us: int = 0              # its TTFT / TBT targets (the request's or the daemon's default; LVF)
    tbt_slo_us: int = 0
    arrival_us: int = 0               # claimed at, on the scheduler's clock (time.monotonic_ns() // 1000)
    last_us: int = -1                 # its latest token's time; -1: none yet
    run_us: int = 0                   # when it last entered the running list

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output) - self.hold_last

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output."""
        p = len(self.prompt)
        if stop <= p:
            return self.prompt[start:stop]
        if start >= p:
            return self.output[start - p:stop - p]
        return self.prompt[start:] + self.output[:stop - p]
