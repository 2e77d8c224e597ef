"""A small synchronous frontend for daemon and engine tests, over shared_layout only:
picks a free slot, allocates arena ranges, submits through FrontendPort, collects
tokens below the published count, resets completed slots."""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from shared_layout import ErrorCode, FinishReason, FrontendPort, Ring, SlotRequest, SlotState
from shared_layout.arena import TokenArena
from shared_layout.extra import SamplingExtra
from shared_layout.layout import decode_logprob_records, extra_words


@dataclasses.dataclass
class Result:
    seq: int
    finish: FinishReason
    error: ErrorCode
    tokens: list[int]
    slot: int
    t_picked_ns: int = 0
    t_first_ns: int = 0


class FrontendPlayer:
    def __init__(self, ring: Ring):
        self.ring = ring
        self.port = FrontendPort(ring)
        self.prompts = TokenArena(ring.geom.prompt_arena_tokens)
        self.outputs = TokenArena(ring.geom.output_arena_tokens)
        self.logprob_words = TokenArena(ring.geom.logprob_arena_words)
        self.next_seq = 1
        self.inflight: dict[int, dict] = {}     # slot -> request info

    def submit(self, prompt: list[int], max_tokens: int, **params) -> int:
        """Submit into the lowest free slot; returns the slot."""
        slot = next(i for i in range(self.ring.geom.slot_count)
                    if i not in self.inflight and self.ring.state[i] == SlotState.EMPTY)
        extra = params.get("extra", SamplingExtra())
        poff, ooff = self.prompts.alloc(len(prompt) + extra.words), self.outputs.alloc(max_tokens)
        req = SlotRequest(seq=self.next_seq, prompt_offset=poff, prompt_len=len(prompt), output_offset=ooff,
                          max_tokens=max_tokens, epoch=self.ring.get("frontend_epoch"),
                          t_submit_ns=time.monotonic_ns(), extra_offset=poff + len(prompt), **params)
        gen_words, prompt_words = req.logprob_words()
        loff = self.logprob_words.alloc(gen_words + prompt_words) if gen_words + prompt_words else None
        if loff is not None:
            req = dataclasses.replace(req, logprobs_offset=loff, prompt_logprobs_offset=loff + gen_words)
        self.port.submit(slot, req, np.asarray(prompt, np.int32))
        self.inflight[slot] = dict(seq=self.next_seq, poff=poff, ooff=ooff, loff=loff, req=req)
        self.next_seq += 1
        return slot

    def submit_group(self, prompt: list[int], max_tokens: int, n: int, seeds=None, **params) -> list[int]:
        """n choices of one prompt as a slot group: the members first, the leader's state word last."""
        seq0 = self.next_seq
        slots = []
        for i in list(range(1, n)) + [0]:
            self.next_seq = seq0 + i
            seed = {} if seeds is None else {"seed": seeds[i]}
            slots.append((i, self.submit(prompt, max_tokens, group_size=n, group_index=i, group_seq=seq0,
                                         **seed, **params)))
        self.next_seq = seq0 + n
        return [slot for _, slot in sorted(slots)]

    def done(self, slot: int) -> bool:
        return self.port.poll(slot)[0] == SlotState.DECODE_COMPLETED

    def tokens_so_far(self, slot: int) -> list[int]:
        _, _, gen = self.port.poll(slot)
        return self.ring.tokens(slot, 0, gen).tolist()

    def logprobs(self, slot: int, prompt: bool = False):
        """(logprob, rank, top ids, top logprobs) arrays of a slot's published records: the
        generated tokens', or the prompt's (tokens 1..); call before `collect`."""
        req = self.inflight[slot]["req"]
        _, _, gen = self.port.poll(slot)
        k = req.prompt_logprobs if prompt else req.logprobs
        n = req.prompt_len - 1 if prompt else gen
        off = req.prompt_logprobs_offset if prompt else req.logprobs_offset
        return decode_logprob_records(self.ring.logprob_arena[off:off + n * (2 + 2 * k)], k)

    def cancel(self, slot: int) -> None:
        self.port.cancel(slot)

    def collect(self, slot: int) -> Result:
        """Result of a completed slot; the slot is reset and its arena ranges freed."""
        state, seq, gen = self.port.poll(slot)
        assert state == SlotState.DECODE_COMPLETED
        info = self.inflight.pop(slot)
        assert seq == info["seq"]
        r = self.ring.slots[slot]
        res = Result(seq, FinishReason(int(r["finish_reason"])), ErrorCode(int(r["error_code"])),
                     self.ring.tokens(slot, 0, gen).tolist(), slot, int(r["t_picked_ns"]), int(r["t_first_ns"]))
        self.ring.cancel_flags[slot] = 0
        self.port.reset(slot)
        self.prompts.free(info["poff"])
        self.outputs.free(info["ooff"])
        if info["loff"] is not None:
            self.logprob_words.free(info["loff"])
        return res

    def wait(self, slot: int, timeout_s: float = 30.0, pump=None) -> Result:
        """Wait for one slot; `pump` (e.g. engine.step) is called while waiting, else sleep."""
        deadline = time.monotonic() + timeout_s
        while not self.done(slot):
            assert time.monotonic() < deadline, f"slot {slot} did not complete in {timeout_s}s"
            if pump is not None:
                pump()
            else:
                time.sleep(0.0005)
        return self.collect(slot)
