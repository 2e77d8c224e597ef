"""Two real processes over a shared-memory ring: 10,000 requests through 64 slots."""
import os
import pathlib
import random
import subprocess
import sys
import time

import numpy as np
import pytest

from shared_layout import FinishReason, FrontendPort, Ring, RingGeometry, SlotRequest, SlotState
from shared_layout.arena import ArenaFull, TokenArena
from shared_layout.shm import ShmRegion

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from ring_players import expected_token  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_ten_thousand_requests_through_64_slots(ring_name):
    n_requests, geom = 10_000, RingGeometry(64, 64 * 16, 64 * 24)
    region = ShmRegion.create(ring_name, geom.total_size)
    ring = Ring.create(region.buf, geom)
    assert oct(os.stat(region.path).st_mode & 0o777) == "0o600"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    backend = subprocess.Popen([sys.executable, str(pathlib.Path(__file__).parent / "ring_players.py"),
                                "backend", ring_name], env=env)
    fe = FrontendPort(ring)
    rng = random.Random(0)
    prompts, outputs = TokenArena(geom.prompt_arena_tokens), TokenArena(geom.output_arena_tokens)
    inflight: dict[int, dict] = {}
    results: dict[int, tuple[FinishReason, list[int]]] = {}
    next_seq, deadline = 1, time.monotonic() + 240
    try:
        while len(results) < n_requests:
            assert time.monotonic() < deadline, f"stalled at {len(results)} results"
            assert backend.poll() is None, "backend process died"
            # submit into every free slot
            for slot in range(geom.slot_count):
                if next_seq > n_requests:
                    break
                if slot in inflight or ring.state[slot] != SlotState.EMPTY:
                    continue
                plen, mt = rng.randint(1, 16), rng.randint(1, 24)
                try:
                    poff = prompts.alloc(plen)
                except ArenaFull:
                    break
                try:
                    ooff = outputs.alloc(mt)
                except ArenaFull:
                    prompts.free(poff)
                    break
                prompt = np.array([rng.randrange(49152) for _ in range(plen)], np.int32)
                expect = [expected_token(next_seq, int(prompt.sum()), i) for i in range(mt)]
                stop = (expect[rng.randrange(mt)],) if rng.random() < 0.2 else ()
                req = SlotRequest(seq=next_seq, prompt_offset=poff, prompt_len=plen, output_offset=ooff,
                                  max_tokens=mt, stop_ids=stop, t_submit_ns=time.monotonic_ns())
                fe.submit(slot, req, prompt)
                inflight[slot] = dict(seq=next_seq, expect=expect, stop=stop, got=[], poff=poff, ooff=ooff,
                                      cancel=rng.random() < 0.1, cancel_after=rng.randint(0, mt))
                next_seq += 1
            # poll every in-flight slot: tokens below the count, then completion
            for slot, rq in list(inflight.items()):
                state, seq, gen = fe.poll(slot)
                assert seq == rq["seq"], "slot shows another request's sequence number"
                if gen > len(rq["got"]):
                    new = ring.tokens(slot, len(rq["got"]), gen).tolist()
                    assert new == rq["expect"][len(rq["got"]):gen], "tokens mixed up"
                    rq["got"] += new
                if rq["cancel"] and len(rq["got"]) >= rq["cancel_after"]:
                    fe.cancel(slot)
                if state == SlotState.DECODE_COMPLETED:
                    finish = FinishReason(int(ring.slots[slot]["finish_reason"]))
                    _, _, gen = fe.poll(slot)
                    assert gen == len(rq["got"])
                    results[rq["seq"]] = (finish, rq["got"])
                    if finish == FinishReason.ABORT:
                        assert rq["cancel"], "abort without a cancel"
                    elif finish == FinishReason.STOP:
                        assert rq["got"][-1] in rq["stop"]
                        assert rq["expect"].index(rq["got"][-1]) == len(rq["got"]) - 1
                    else:
                        assert finish == FinishReason.LENGTH and rq["got"] == rq["expect"]
                    fe.reset(slot)
                    prompts.free(rq["poff"])
                    outputs.free(rq["ooff"])
                    del inflight[slot]
    finally:
        ring.set("shutdown", 1)
        backend.wait(timeout=30)
        region.close()
    assert sorted(results) == list(range(1, n_requests + 1))
    aborted = sum(1 for f, _ in results.values() if f == FinishReason.ABORT)
    assert 0 < aborted < n_requests * 0.2
    assert prompts.free_tokens == geom.prompt_arena_tokens and outputs.free_tokens == geom.output_arena_tokens
