"""Intake: pending ring slots -> validated, claimed Sequences (or slots ended with an error).

    ring: PREFILL_PENDING slots, lowest seq first (BackendPort.pending)
      -> claim (PREFILL_PROCESSING, t_picked_ns stamped)
      -> checks: frontend epoch, cancel flag, shared_layout.request_error
         (offsets, lengths, parameters), prompt_len < max_model_len, every
         prompt token id < vocab, the sampling data (logit_bias, allowed ids,
         bad words, the structured-output automaton: shared_layout.extra.decode_extra)
         well formed and in the vocabulary, its output range clear of every live
         request's (a frontend that allocated it twice would have one overwrite the other)
      -> Sequence with the prompt and the sampling data copied out of the arena,
         or the slot completed at once (ABORT / ERROR with its ErrorCode).

Groups (n choices of one prompt): the members are pending before their leader
(the frontend writes the leader's state word last). A member is claimed with its
leader, checked like any slot plus "same prompt as the leader", and handed over in
the leader's `forks` (the engine forks it after the prefill); a member whose leader
does not arrive within ORPHAN_TIMEOUT_S is ended INVALID_REQUEST.

Every number read from a slot is range-checked before it indexes anything, so
a corrupted slot ends with an error and never touches memory outside the ring.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import time
from collections.abc import Callable, Iterable

import numpy as np

from shared_layout import BackendPort, ErrorCode, FinishReason, IllegalTransition, Ring, request_error
from shared_layout.extra import decode_automaton, decode_extra
from shared_layout.layout import (FLAG_HAS_SEED, FLAG_IGNORE_EOS, FLAG_LOGPROBS, FLAG_PROMPT_LOGPROBS, MAX_STOP_IDS,
                                  extra_words)

from .sequence import SamplingParams, Sequence


AUTOMATON_CACHE = 64     # decoded structured-output automata kept (LRU), shared by requests with the same words
ORPHAN_TIMEOUT_S = 1.0   # a group member pending this long without its leader ends INVALID_REQUEST


@dataclasses.dataclass(frozen=True)
class IntakeConfig:
    vocab_size: int
    max_model_len: int             # prompt + output tokens at most
    eos_ids: tuple[int, ...] = ()
    # What the runner behind this intake applies; a request asking for more is refused
    # (INVALID_REQUEST) at its claim rather than served without it (the CUDA host loop
    # samples in its graphs, which step no token automaton and keep no prompt logits).
    structured_outputs: bool = True
    prompt_logprobs: bool = True
    ttft_slo_ms: int = 5000        # a request's targets when its slot says 0 (SuperInfer's defaults)
    tbt_slo_ms: int = 100


class Intake:
    def __init__(self, ring: Ring, port: BackendPort, config: IntakeConfig,
                 owned: Callable[[], Iterable[Sequence]] = tuple):
        self.ring, self.port, self.config = ring, port, config
        self._owned = owned    # the requests the engine still holds (their output ranges are written)
        self._taken: list[tuple[int, int]] = []   # output ranges [start, end) of this frontend's live requests
        self._orphans: dict[tuple[int, int], float] = {}   # (slot, seq) of a waiting member -> first seen (s)
        self._automata: collections.OrderedDict[bytes, object] = collections.OrderedDict()   # words' hash -> decoded

    def scan(self) -> list[Sequence]:
        """Claim every pending slot; return the valid ones as Sequences, in FCFS order (a group's
        members inside their leader's `forks`)."""
        pending = self.port.pending()
        if pending.size == 0:
            return []
        frontend_epoch = self.ring.get("frontend_epoch")
        self._taken = [(s.output_offset, s.output_offset + s.max_tokens) for s in self._owned()
                       if s.epoch == frontend_epoch and s.max_tokens]
        slots = self.ring.slots
        members: dict[int, list[int]] = {}    # group seq -> member slots pending
        firsts = []
        for slot in pending.tolist():
            if int(slots[slot]["group_size"]) > 1 and int(slots[slot]["group_index"]) > 0:
                members.setdefault(int(slots[slot]["group_seq"]), []).append(slot)
            else:
                firsts.append(slot)
        out = []
        for slot in firsts:
            seq = self._take(slot, frontend_epoch)
            if seq is None:
                continue
            out.append(seq)
            if int(slots[slot]["group_size"]) > 1:
                for m in members.pop(seq.seq, []):
                    fork = self._take(m, frontend_epoch, leader=seq)
                    if fork is not None:
                        seq.forks.append(fork)
                seq.hold_last = bool(seq.forks) and len(seq.prompt) > 1
        self._reap_orphans([m for ms in members.values() for m in ms])
        return out

    def _take(self, slot: int, frontend_epoch: int, leader: Sequence | None = None) -> Sequence | None:
        """Claim and read one slot; None when it was ended at once (or was not ours to claim)."""
        try:
            self.port.claim(slot)
        except IllegalTransition:   # the frontend rewrote the state word since the scan
            return None
        seq, finish, error = self._read(slot, frontend_epoch)
        if seq is not None and leader is not None and (seq.prompt != leader.prompt or seq.epoch != leader.epoch):
            seq, finish, error = None, FinishReason.ERROR, ErrorCode.INVALID_REQUEST   # cannot share its prefill
        if seq is None:
            self.port.complete(slot, finish, error)
        elif seq.max_tokens:
            self._taken.append((seq.output_offset, seq.output_offset + seq.max_tokens))
        return seq

    def _automaton(self, extra):
        """The request's decoded automaton; requests with the same words share one (and its masks)."""
        if not extra.automaton:
            return None
        key = hashlib.blake2b(extra.automaton, digest_size=16).digest()
        a = self._automata.get(key)
        if a is None:
            a = self._automata[key] = decode_automaton(extra, self.config.vocab_size)
            while len(self._automata) > AUTOMATON_CACHE:
                self._automata.popitem(last=False)
        else:
            self._automata.move_to_end(key)
        return a

    def _reap_orphans(self, waiting: list[int]) -> None:
        """Members pending without their leader: wait for it a while, then end them."""
        now = time.monotonic()
        seen = {}
        for slot in waiting:
            key = (slot, int(self.ring.seq[slot]))
            seen[key] = t0 = self._orphans.get(key, now)
            if now - t0 > ORPHAN_TIMEOUT_S:
                try:
                    self.port.claim(slot)
                except IllegalTransition:
                    continue
                self.port.complete(slot, FinishReason.ERROR, ErrorCode.INVALID_REQUEST)
                del seen[key]
        self._orphans = seen

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
        ooff, mt = int(r["output_offset"]), int(r["max_tokens"])
        if mt and any(ooff < end and start < ooff + mt for start, end in self._taken):
            # Another live request's tokens are written there: a buggy frontend's double
            # allocation; serving it would overwrite that request's output.
            return None, FinishReason.ERROR, ErrorCode.INVALID_REQUEST
        plen, poff = int(r["prompt_len"]), int(r["prompt_offset"])
        if plen >= self.config.max_model_len:
            return None, FinishReason.ERROR, ErrorCode.PROMPT_TOO_LONG
        prompt = self.ring.prompt_arena[poff:poff + plen].copy()      # bounds checked by request_error
        if int(prompt.min()) < 0 or int(prompt.max()) >= self.config.vocab_size:
            return None, FinishReason.ERROR, ErrorCode.INVALID_TOKEN
        counts = (int(r["n_logit_bias"]), int(r["n_allowed_ids"]), int(r["bad_words_words"]),
                  int(r["automaton_words"]))
        flags = int(r["flags"])
        if (counts[3] and not self.config.structured_outputs) or \
                (flags & FLAG_PROMPT_LOGPROBS and not self.config.prompt_logprobs):
            return None, FinishReason.ERROR, ErrorCode.INVALID_REQUEST
        eoff = int(r["extra_offset"])
        try:   # bounds checked by request_error
            extra = decode_extra(self.ring.prompt_arena[eoff:eoff + extra_words(*counts)].copy(), *counts[:3],
                                 vocab_size=self.config.vocab_size, automaton_words=counts[3])
            automaton = self._automaton(extra)
        except ValueError:
            return None, FinishReason.ERROR, ErrorCode.INVALID_REQUEST
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
                                bad_words=extra.bad_words, automaton=automaton)
        stop = {int(t) for t in r["stop_ids"][:min(int(r["n_stop_ids"]), MAX_STOP_IDS)]}
        if not flags & FLAG_IGNORE_EOS or automaton is not None:   # a finished structure ends with EOS
            stop.update(self.config.eos_ids)
        return Sequence(slot=slot, seq=int(r["seq"]), epoch=int(r["epoch"]),
                        prompt=np.asarray(prompt, np.int64).tolist(), max_tokens=mt, output_offset=ooff,
                        params=params, stop_ids=frozenset(stop),
                        max_len=self.config.max_model_len, priority=int(r["priority"]),
                        ttft_slo_us=1000 * (int(r["ttft_slo_ms"]) or self.config.ttft_slo_ms),
                        tbt_slo_us=1000 * (int(r["tbt_slo_ms"]) or self.config.tbt_slo_ms),
                        arrival_us=time.monotonic_ns() // 1000), FinishReason.NONE, ErrorCode.NONE
