"""Sequence: the engine's copy of one claimed request and its progress.

    ring slot (validated by intake.py) -> Sequence (prompt copied out of the
    arena, sampling parameters, stop ids) -> engine: num_computed, KV block
    table, output tokens -> published back into the slot.

Everything here lives in host memory; the ring sees only what the engine
publishes (tokens, counts, states).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 = greedy
    top_p: float = 1.0         # (0, 1]
    top_k: int = 0             # 0 = off
    seed: int | None = None    # per-request generator seed; None = fresh entropy

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
    output: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0             # tokens whose K/V is in the cache
    blocks: list[int] = dataclasses.field(default_factory=list)   # block table
    generator: object = None          # per-request torch.Generator, made by the sampler on first use

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output."""
        p = len(self.prompt)
        if stop <= p:
            return self.prompt[start:stop]
        if start >= p:
            return self.output[start - p:stop - p]
        return self.prompt[start:] + self.output[:stop - p]
