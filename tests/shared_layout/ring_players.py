"""A stand-in backend for protocol tests, run as its own process:

    python ring_players.py backend RING_NAME

Claims pending slots FCFS, emits `expected_token(seq, prompt_sum, i)` one token
per active slot per step, pauses and resumes slots now and then, honours the
cancel flag and stop ids, completes, and exits when the header's shutdown word
is set. Knows only shared_layout.
"""
from __future__ import annotations

import random
import sys
import time


def expected_token(seq: int, prompt_sum: int, i: int) -> int:
    return (seq * 1000003 + prompt_sum * 31 + i * 7919) % 49152


def run_backend(name: str) -> int:
    from shared_layout import BackendPort, ErrorCode, FinishReason, Ring, SlotState, request_error
    from shared_layout.shm import ShmRegion

    region = ShmRegion.open(name)
    ring = Ring.attach(region.buf)
    be = BackendPort(ring)
    rng = random.Random(1)
    active: dict[int, tuple[int, int]] = {}   # slot -> (seq, prompt_sum)
    paused: set[int] = set()
    ring.set("backend_status", 2)
    while not ring.get("shutdown"):
        be.beat()
        for slot in be.pending():
            slot = int(slot)
            err = request_error(ring.geom, ring.slots[slot])
            be.claim(slot)
            if err != ErrorCode.NONE:
                be.complete(slot, FinishReason.ERROR, err)
                continue
            req = ring.slot_request(slot)
            psum = int(ring.prompt_arena[req.prompt_offset:req.prompt_offset + req.prompt_len].sum())
            active[slot] = (req.seq, psum)
        if not active:
            time.sleep(0.0002)
            continue
        for slot, (seq, psum) in list(active.items()):
            state = int(ring.state[slot])
            if ring.cancel_flags[slot]:
                be.complete(slot, FinishReason.ABORT)
                del active[slot]
                paused.discard(slot)
                continue
            if slot in paused:
                if rng.random() < 0.5:
                    be.move(slot, SlotState.DECODE_PROCESSING)
                    paused.discard(slot)
                continue
            if state == SlotState.DECODE_PROCESSING and rng.random() < 0.02:
                be.move(slot, SlotState.DECODE_PAUSED)
                paused.add(slot)
                continue
            r = ring.slots[slot]
            i = int(r["generated"])
            tok = expected_token(seq, psum, i)
            be.publish(slot, [tok])
            stops = [int(t) for t in r["stop_ids"][:int(r["n_stop_ids"])]]
            if tok in stops:
                be.complete(slot, FinishReason.STOP)
            elif i + 1 >= int(r["max_tokens"]):
                be.complete(slot, FinishReason.LENGTH)
            else:
                if state == SlotState.PREFILL_PROCESSING:
                    be.move(slot, SlotState.DECODE_PROCESSING)
                continue
            del active[slot]
    ring.set("backend_status", 0)
    return 0


if __name__ == "__main__":
    role, name = sys.argv[1], sys.argv[2]
    assert role == "backend"
    sys.exit(run_backend(name))
