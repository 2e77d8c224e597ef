"""Faults with real processes over a real ring: `kill -9` of the daemon mid-stream (every stream
ends with an error event and [DONE], /health 503, new requests 503, a restarted daemon is
picked up without restarting the frontend), and `kill -9` of the frontend (the daemon frees
the stale epoch's slots; a new frontend starts clean)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import aiohttp
import numpy as np
import pytest

from rel_procs import Frontend, post, sse_events, start_daemon, wait_for
from bench.reliability import http_get
from shared_layout import ErrorCode, Ring, SlotState
from shared_layout.shm import ShmRegion

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PROMPT = [1000, 1001, 1002, 1003]


async def open_streams(base: str, n: int, max_tokens: int = 8000):
    """n streaming requests; returns (session, tasks, first_chunk events)."""
    session = aiohttp.ClientSession()
    firsts = [asyncio.Event() for _ in range(n)]

    async def one(i: int):
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        async with session.post(base + "/v1/completions", json=body) as r:
            assert r.status == 200
            text = b""
            async for chunk in r.content.iter_any():
                text += chunk
                firsts[i].set()
            return text.decode(), time.monotonic()

    tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
    return session, tasks, firsts


async def test_daemon_kill9_mid_stream_then_restart_is_picked_up(ring_name, tmp_path):
    daemon = start_daemon(ring_name, tmp_path, "--max-batch-size", "4")
    fe = Frontend(ring_name, tmp_path, "--heartbeat-timeout-s", "1")
    daemon2 = None
    try:
        await asyncio.to_thread(wait_for, fe.healthy, 30, "a healthy backend")
        session, tasks, firsts = await open_streams(fe.base, 8)
        async with session:
            # Four streams decode (batch 4), four wait in the ring; the first chunks are out.
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts[:1])), 20)
            daemon.kill9()
            t_kill = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        for text, t_end in results:
            events = sse_events(text)
            assert events[-1] == "[DONE]", events[-3:]
            err = json.loads(events[-2])
            assert err["error"]["code"] == 503, err              # an error event, not a silent end
            assert t_end - t_kill < 6.0                          # bounded: heartbeat window + a poll
        status, _ = http_get(fe.base + "/health")
        assert status == 503
        status, err, headers = post(fe.base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
        assert status == 503 and "Retry-After" in headers and err["error"]["type"] == "ServiceUnavailableError"

        # The same ring, a new daemon: the frontend (not restarted) sees the new backend epoch.
        daemon2 = start_daemon(ring_name, tmp_path, name="daemon2")
        await asyncio.to_thread(wait_for, fe.healthy, 30, "the restarted backend")
        status, reply, _ = post(fe.base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True})
        assert status == 200, reply
        assert reply["usage"]["completion_tokens"] == 6
        assert fe.alive()
        assert fe.metrics()["blink_backend_epoch"] == 2
        await asyncio.to_thread(wait_for, fe.settled, 10, "every slot and arena token back")
    finally:
        assert fe.stop() == 0, fe.log()
        for d in (daemon, daemon2):
            if d is not None:
                d.stop()


class CompletionWatcher(threading.Thread):
    """Reads the ring every ~0.5 ms and records the error code of every completed slot it sees
    (the new frontend resets them as soon as it reads them: the test holds it stopped until then)."""

    def __init__(self, ring_name: str):
        super().__init__(daemon=True)
        self.ring = Ring.attach(ShmRegion.open(ring_name).buf)
        self.seen: dict[tuple[int, int], int] = {}   # (slot, seq) -> error code
        self.halt = threading.Event()

    def run(self):
        slots = self.ring.slots
        while not self.halt.is_set():
            done = np.flatnonzero(slots["state"] == SlotState.DECODE_COMPLETED)
            for s in done.tolist():
                self.seen.setdefault((s, int(slots["seq"][s])), int(slots["error_code"][s]))
            time.sleep(0.0005)


def in_ring(ring: Ring) -> int:
    """Slots holding a live request (written, decoding or pending, not yet completed)."""
    states = ring.state
    return int(np.count_nonzero((states != SlotState.EMPTY) & (states != SlotState.DECODE_COMPLETED)))


async def until_in_ring(ring: Ring, n: int):
    while in_ring(ring) < n:
        await asyncio.sleep(0.005)


async def test_frontend_kill9_stale_epoch_slots_freed_and_new_frontend_starts_clean(ring_name, tmp_path):
    daemon = start_daemon(ring_name, tmp_path, "--max-batch-size", "2")
    fe1 = Frontend(ring_name, tmp_path, name="frontend1")
    fe2 = None
    watcher = None
    try:
        await asyncio.to_thread(wait_for, fe1.healthy, 30, "a healthy backend")
        watcher = CompletionWatcher(ring_name)
        session, tasks, firsts = await open_streams(fe1.base, 6)
        async with session:
            await asyncio.wait_for(firsts[0].wait(), 20)
            # All six must be in the ring before the freeze: on a loaded machine the first chunk
            # can come back before the frontend has written the last prompt.
            await asyncio.wait_for(until_in_ring(watcher.ring, 6), 20)
            # Freeze the daemon so the echo model cannot finish the requests before the new frontend
            # comes: they are still decoding (2) or pending (4) when it attaches.
            os.kill(daemon.pid, signal.SIGSTOP)
            watcher.start()
            fe1.kill9()
            await asyncio.gather(*tasks, return_exceptions=True)
        assert in_ring(watcher.ring) == 6

        fe2 = Frontend(ring_name, tmp_path, name="frontend2")   # listening: it has attached (epoch 2)
        # Hold the new frontend until the watcher has seen the six aborted: woken by the daemon's
        # doorbell, it resets a completed slot within a step, faster than the watcher's reads.
        os.kill(fe2.pid, signal.SIGSTOP)
        os.kill(daemon.pid, signal.SIGCONT)
        try:
            await asyncio.to_thread(wait_for, lambda: len(watcher.seen) >= 6, 20, "the stale epoch's six to end")
        finally:
            os.kill(fe2.pid, signal.SIGCONT)
        await asyncio.to_thread(wait_for, fe2.healthy, 30, "the new frontend to be healthy")
        await asyncio.to_thread(wait_for, fe2.settled, 10, "the stale epoch's slots to be freed")
        watcher.halt.set()
        watcher.join()
        # All six aborted as the stale epoch's, none run to the end.
        assert sorted(watcher.seen.values()) == [ErrorCode.STALE_EPOCH] * 6, watcher.seen
        assert fe2.metrics()["blink_backend_epoch"] == 1                      # the daemon never restarted
        assert daemon.alive()
        prompt = [7, 8, 9]
        status, reply, _ = post(fe2.base, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "ignore_eos": True})
        assert status == 200 and reply["usage"]["completion_tokens"] == 5
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
        if watcher is not None:
            watcher.halt.set()
        if fe2 is not None:
            assert fe2.stop() == 0, fe2.log()
        if fe1.alive():
            fe1.stop()
        assert daemon.stop() == 0, daemon.log()
