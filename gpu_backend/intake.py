"""Intake: pending ring slots -> validated, claimed Sequences (or slots ended with an error).

    ring: PREFILL_PENDING slots, lowest seq first (BackendPort.pending)
      -> claim (PREFILL_PROCESSING, t_picked_ns stamped)
      -> checks: frontend epoch, cancel flag, shared_layout.request_error
         (offsets, lengths, parameters), prompt_len < max_model_len, every
         prompt token id < vocab, the sampling data (logit_bias, allowed ids,
         bad words: shared_layout.extra.decode_extra) well formed and in the vocabulary
      -> Sequence with the prompt and the sampling data copied out of the arena,
         or the slot completed at once (ABORT / ERROR with its ErrorCode).

Every number read from a slot is range-checked before it indexes anything, so
a corrupted slot ends with an error and never touches memory outside the ring.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from shared_layout import BackendPort, ErrorCode, FinishReason, IllegalTransition, Ring, request_error
from shared_layout.extra import decode_extra
from shared_layout.layout import (FLAG_HAS_SEED, FLAG_IGNORE_EOS, FLAG_LOGPROBS, FLAG_PROMPT_LOGPROBS, MAX_STOP_IDS,
                                  extra_words)

from .sequence import SamplingParams, Sequence


@dataclasses.dataclass(frozen=True)
class IntakeConfig:
    vocab_size: int
    max_model_len: int             # prompt + output tokens at most
    eos_ids: tuple[int, ...] = ()


class Intake:
    def __init__(self, ring: Ring, port: BackendPort, config: IntakeConfig):
        self.ring, self.port, self.config = ring, port, config

    def scan(self) -> list[Sequence]:
        """Claim every pending slot; return the valid ones as Sequences, in FCFS order."""
        pending = self.port.pending()
        if pending.size == 0:
            return []
        frontend_epoch = self.ring.get("frontend_epoch")
        out = []
        for slot in pending.tolist():
            try:
                self.port.claim(slot)
            except IllegalTransition:   # the frontend rewrote the state word since the scan
                continue
            seq, finish, error = self._read(slot, frontend_epoch)
            if seq is None:
                self.port.complete(slot, finish, error)
            else:
                out.append(seq)
        return out

    def _read(self, slot: int, frontend_epoch: int) -> tuple[Sequence | None, FinishReason, ErrorCode]:
        # A copy of the record and of the prompt: a hostile frontend rewriting them after
        # the checks below cannot change what was checked.
        r = self.ring.slots[slot].copy()
        if int(r["epoch"]) != frontend_epoch:
            return None, FinishReason.ABORT, ErrorCode.STALE_EPOCH
        if int(r["cancel"]):
            return None, FinishReason.ABORT, ErrorCode.NONE
        err = request_error(self.ring.geom, r)
        if err != ErrorCode.NONE:
            return None, FinishReason.ERROR, err
        plen, poff = int(r["prompt_len"]), int(r["prompt_offset"])
        if plen >= self.config.max_model_len:
            return None, FinishReason.ERROR, ErrorCode.PROMPT_TOO_LONG
        prompt = self.ring.prompt_arena[poff:poff + plen].copy()      # bounds checked by request_error
        if int(prompt.min()) < 0 or int(prompt.max()) >= self.config.vocab_size:
            return None, FinishReason.ERROR, ErrorCode.INVALID_TOKEN
        counts = int(r["n_logit_bias"]), int(r["n_allowed_ids"]), int(r["bad_words_words"])
        eoff = int(r["extra_offset"])
        try:   # bounds checked by request_error
            extra = decode_extra(self.ring.prompt_arena[eoff:eoff + extra_words(*counts)].copy(), *counts,
                                 vocab_size=self.config.vocab_size)
        except ValueError:
            return None, FinishReason.ERROR, ErrorCode.INVALID_REQUEST
        flags = int(r["flags"])
        params = SamplingParams(temperature=float(r["temperature"]), top_p=float(r["top_p"]),
                                top_k=int(r["top_k"]),
                                seed=int(r["seed"]) if flags & FLAG_HAS_SEED else None,
                                min_p=float(r["min_p"]), presence_penalty=float(r["presence_penalty"]),
                                frequency_penalty=float(r["frequency_penalty"]),
                                repetition_penalty=float(r["repetition_penalty"]) or 1.0,
                                min_tokens=int(r["min_tokens"]),
                                logprobs=int(r["logprobs"]) if flags & FLAG_LOGPROBS else None,
                                prompt_logprobs=int(r["prompt_logprobs"]) if flags & FLAG_PROMPT_LOGPROBS else None,
                                logit_bias=extra.logit_bias, allowed_token_ids=extra.allowed_token_ids,
                                bad_words=extra.bad_words)
        stop = {int(t) for t in r["stop_ids"][:min(int(r["n_stop_ids"]), MAX_STOP_IDS)]}
        if not flags & FLAG_IGNORE_EOS:
            stop.update(self.config.eos_ids)
        return Sequence(slot=slot, seq=int(r["seq"]), epoch=int(r["epoch"]),
                        prompt=np.asarray(prompt, np.int64).tolist(), max_tokens=int(r["max_tokens"]),
                        params=params, stop_ids=frozenset(stop),
                        max_len=self.config.max_model_len), FinishReason.NONE, ErrorCode.NONE
