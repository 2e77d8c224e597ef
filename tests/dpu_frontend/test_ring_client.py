"""RingClient end to end against real backend processes over a real shm ring.

Two backends, both real processes:
- "players": the protocol stand-in tests/shared_layout/ring_players.py (token i of a
  request = expected_token(seq, prompt_sum, i); pauses and resumes slots at random);
- "daemon": `blink gpu-daemon --model null` (token i = prompt[i % prompt_len]).
"""
from __future__ import annotations

import asyncio
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import pytest

from dpu_frontend.ring_client import (BackendUnavailable, InvalidRequest, PromptTooLong, QueueFull, RingClient,
                                      RingClientConfig, SamplingParams)
from dpu_frontend.transport import ShmTransport, shm_factory
from shared_layout import HEADER, Ring, RingGeometry, SlotState, doorbell_write
from shared_layout.shm import ShmRegion

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "shared_layout"))
from ring_players import expected_token  # noqa: E402

SLOTS = 64
GEOM = RingGeometry(SLOTS, 1 << 15, 1 << 18)
ENV = dict(os.environ, PYTHONPATH=str(REPO))


class PlayersBackend:
    kind = "players"

    def __init__(self, name: str):
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.region: ShmRegion | None = None

    def start(self) -> None:
        if not ShmRegion.exists(self.name):
            self.region = ShmRegion.create(self.name, GEOM.total_size)
            Ring.create(self.region.buf, GEOM)
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests/shared_layout/ring_players.py"), "backend",
                                      self.name], env=ENV)

    def expected(self, h, prompt, n):
        return [expected_token(h.seq, sum(prompt), i) for i in range(n)]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            ring_view(self.name).set("shutdown", 1)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class DaemonBackend:
    kind = "daemon"

    def __init__(self, name: str):
        self.name = name
        self.proc: subprocess.Popen | None = None

    def start(self, *extra: str) -> None:
        blink = REPO / ".venv/bin/blink"
        cmd = [str(blink)] if blink.exists() else [sys.executable, "-m", "dpu_frontend.cli"]
        self.proc = subprocess.Popen(cmd + ["gpu-daemon", "--model", "null", "--ring", self.name, *extra,
                                            "--slots", str(SLOTS), "--prompt-arena-tokens", str(GEOM.prompt_arena_tokens),
                                            "--output-arena-tokens", str(GEOM.output_arena_tokens),
                                            "--log-level", "warning"], env=ENV)

    def expected(self, h, prompt, n):
        return [prompt[i % len(prompt)] for i in range(n)]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def kill9(backend) -> None:
    backend.proc.send_signal(signal.SIGKILL)
    backend.proc.wait()


@pytest.fixture(params=["players", "daemon"])
def backend(request, ring_name):
    b = (PlayersBackend if request.param == "players" else DaemonBackend)(ring_name)
    b.start()
    yield b
    b.stop()


@pytest.fixture
def players(ring_name):
    b = PlayersBackend(ring_name)
    b.start()
    yield b
    b.stop()


async def started(name: str, **cfg) -> RingClient:
    client = RingClient(shm_factory(name), RingClientConfig(**cfg))
    await client.start()
    await wait_until(lambda: client.health().healthy, 30, lambda: client.health())
    return client


async def wait_until(cond, timeout_s: float, what=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s: {what()}")
        await asyncio.sleep(0.01)


def ring_view(name: str) -> Ring:
    return Ring.attach(ShmRegion.open(name).buf)


async def assert_ring_clean(client: RingClient, name: str, timeout_s: float = 20) -> None:
    """Every slot EMPTY, nothing held, both arenas whole."""
    ring = ring_view(name)
    await wait_until(lambda: client.stats()["held_slots"] == 0 and (ring.state == SlotState.EMPTY).all(), timeout_s,
                     lambda: (client.stats()["held_slots"], ring.counts_by_state()))
    st = client.stats()
    assert st["prompt_arena_free_tokens"] == ring.geom.prompt_arena_tokens
    assert st["output_arena_free_tokens"] == ring.geom.output_arena_tokens
    assert st["slots"]["EMPTY"] == ring.geom.slot_count and st["inflight"] == 0 and st["queue_depth"] == 0


async def test_sixteen_concurrent_requests_get_exactly_their_own_tokens(backend):
    client = await started(backend.name)
    rng = random.Random(0)

    async def one(i):
        prompt = [rng.randrange(1, 49152) for _ in range(rng.randint(1, 40))]
        n = rng.randint(20, 300)
        h = await client.submit(prompt, SamplingParams(max_tokens=n, temperature=0.0))
        got = []
        async for batch in h:
            assert batch
            got += batch
        assert (h.finish_reason, h.error) == ("length", None)
        assert got == backend.expected(h, prompt, n)
        assert h.completion_tokens == n and h.prompt_tokens == len(prompt)
        assert h.t_first_token_ns >= h.t_submit_ns and h.t_picked_ns and h.t_first_ns
        return h.seq

    seqs = await asyncio.gather(*[one(i) for i in range(16)])
    assert len(set(seqs)) == 16
    st = client.stats()
    assert st["submitted_total"] == 16 and st["finished_total"] == {"length": 16}
    assert len(st["recent_requests"]) == 16
    await assert_ring_clean(client, backend.name)
    await client.close()


async def test_hundred_cancels_mid_stream_free_every_slot_and_both_arenas(backend):
    client = await started(backend.name)
    n_tokens = 4000   # far more than arrive before the cancel

    async def one(i):
        prompt = [i + 1, 7, 9]
        h = await client.submit(prompt, SamplingParams(max_tokens=n_tokens), queue_timeout_s=60)
        got = []
        async for batch in h:
            got += batch
            if len(got) >= 3:
                h.cancel()
                h.cancel()      # idempotent
        assert got == backend.expected(h, prompt, len(got))
        return h.finish_reason

    reasons = await asyncio.gather(*[one(i) for i in range(100)])
    assert reasons.count("abort") >= 90, reasons
    await assert_ring_clean(client, backend.name)
    await client.close()


async def test_stop_ids_beyond_the_slot_and_backpressure(ring_name):
    b = DaemonBackend(ring_name)
    b.start()
    try:
        client = await started(ring_name, max_buffered_tokens=64)
        # 9 stop ids: eight ride in the slot, the ninth is caught by the reader
        prompt = [11, 12, 13, 14, 15]
        h = await client.submit(prompt, SamplingParams(max_tokens=100, stop_token_ids=tuple(range(100, 108)) + (14,)))
        assert await h.result() == [11, 12, 13, 14] and h.finish_reason == "stop"
        # a consumer that never reads: cancelled once 64 tokens pile up, slot comes back
        h = await client.submit([1, 2], SamplingParams(max_tokens=5000))
        await wait_until(lambda: h.finished, 20)
        assert h.finish_reason == "error" and "stopped reading" in h.error
        await assert_ring_clean(client, ring_name)
        await client.close()
    finally:
        b.stop()


async def test_backend_kill9_ends_every_handle_and_a_restarted_backend_serves(backend):
    client = await started(backend.name, health_window_s=0.5)
    handles = [await client.submit([i + 1, 2], SamplingParams(max_tokens=50_000 // 16)) for i in range(16)]
    got = {id(h): [] for h in handles}

    async def drain(h):
        async for batch in h:
            got[id(h)] += batch

    tasks = [asyncio.create_task(drain(h)) for h in handles]
    await wait_until(lambda: all(got[id(h)] for h in handles), 20)
    kill9(backend)
    t_kill = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    bounded_s = time.monotonic() - t_kill
    assert bounded_s < 0.5 + 3.0, bounded_s
    errors = [h for h in handles if h.finish_reason == "error"]
    assert errors and all("backend lost" in h.error for h in errors)
    assert all(h.finish_reason in ("error", "length") for h in handles)
    assert not client.health().healthy
    with pytest.raises(BackendUnavailable, match="backend lost"):
        await client.submit([1], SamplingParams(max_tokens=3))

    backend.start()   # same ring, no client restart
    await wait_until(lambda: client.health().healthy, 30, lambda: client.health())
    prompt = [5, 6, 7]
    h = await client.submit(prompt, SamplingParams(max_tokens=40))
    assert await h.result() == backend.expected(h, prompt, 40) and h.finish_reason == "length"
    if backend.kind == "daemon":
        # the new daemon aborts the dead one's slots; the client takes them back
        await assert_ring_clean(client, backend.name)
    await client.close()


async def test_reattaches_when_the_daemon_recreates_the_ring(ring_name):
    b = DaemonBackend(ring_name)
    b.start()
    try:
        client = await started(ring_name, health_window_s=0.5)
        h = await client.submit([1, 2, 3], SamplingParams(max_tokens=10))
        assert await h.result() == [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]
        kill9(b)
        # the file is left unusable (no magic): the next daemon must replace it
        region = ShmRegion.open(ring_name)
        region.buf[:8] = bytes(8)
        region.close()
        b.start()
        await wait_until(lambda: client.health().healthy and client.stats()["attach_total"] == 2, 30,
                         lambda: (client.health(), client.stats()["attach_total"]))
        h = await client.submit([4, 5], SamplingParams(max_tokens=5))
        assert await h.result() == [4, 5, 4, 5, 4]
        st = client.stats()
        assert st["backend"]["backend_epoch"] == 1 and st["frontend_epoch"] == 1   # a fresh ring
        await client.close()
    finally:
        b.stop()


async def test_client_started_before_the_backend_waits_for_it(ring_name):
    client = RingClient(shm_factory(ring_name), RingClientConfig(reattach_interval_s=0.05))
    await client.start()
    h = client.health()
    assert not h.healthy and "does not exist" in h.message
    with pytest.raises(BackendUnavailable, match="does not exist"):
        await client.submit([1], SamplingParams(max_tokens=1))
    b = DaemonBackend(ring_name)
    b.start()
    try:
        await wait_until(lambda: client.health().healthy, 30, lambda: client.health())
        assert client.model_max_len == 8192 and client.vocab_size == 49152
        h = await client.submit([9], SamplingParams(max_tokens=2))
        assert await h.result() == [9, 9]
        # bad input: clear errors before anything is written
        with pytest.raises(PromptTooLong):
            await client.submit([1] * 8192, SamplingParams(max_tokens=1))
        for prompt, params in (([], SamplingParams(max_tokens=1)), ([49152], SamplingParams(max_tokens=1)),
                               ([-1], SamplingParams(max_tokens=1)), ([1.5], SamplingParams(max_tokens=1)),
                               ([1], SamplingParams(max_tokens=0)), ([1], SamplingParams(max_tokens=1, top_p=0)),
                               ([1], SamplingParams(max_tokens=1, temperature=float("nan")))):
            with pytest.raises(InvalidRequest):
                await client.submit(prompt, params)
        # max_tokens beyond the context is clamped to what fits
        h = await client.submit([3] * 8190, SamplingParams(max_tokens=100))
        assert h.max_tokens == 2 and await h.result() == [3, 3] and h.finish_reason == "length"
        await assert_ring_clean(client, ring_name)
        await client.close()
        with pytest.raises(BackendUnavailable):
            await client.submit([1], SamplingParams(max_tokens=1))
    finally:
        b.stop()


async def test_full_ring_queues_then_raises_queue_full(players):
    client = await started(players.name, max_queue=4, health_window_s=10)
    os.kill(players.proc.pid, signal.SIGSTOP)     # nothing is claimed while stopped
    try:
        first = [await client.submit([i + 1], SamplingParams(max_tokens=5)) for i in range(SLOTS)]
        with pytest.raises(QueueFull) as e:
            await client.submit([1], SamplingParams(max_tokens=5), queue_timeout_s=0)
        assert e.value.retry_after_s > 0
        waiting = [asyncio.create_task(client.submit([100 + i], SamplingParams(max_tokens=5))) for i in range(4)]
        await asyncio.sleep(0.05)
        assert client.stats()["queue_depth"] == 4
        with pytest.raises(QueueFull, match="wait queue full") as e:
            await client.submit([1], SamplingParams(max_tokens=5))
        assert 0 < e.value.retry_after_s <= 30
        waiting[0].cancel()                        # a client that gave up leaves the queue
        await asyncio.sleep(0.01)
        assert client.stats()["queue_depth"] == 3
        with pytest.raises(QueueFull, match="within 0.1 s"):
            await client.submit([1], SamplingParams(max_tokens=5), queue_timeout_s=0.1)
        assert client.stats()["queue_depth"] == 3
    finally:
        os.kill(players.proc.pid, signal.SIGCONT)
    later = await asyncio.gather(*waiting[1:])
    for i, h in enumerate(first):
        assert await h.result() == players.expected(h, [i + 1], 5)
    for i, h in enumerate(later, start=1):
        assert await h.result() == players.expected(h, [100 + i], 5)
    await assert_ring_clean(client, players.name)
    await client.close()


async def test_close_cancels_what_is_in_flight(ring_name):
    b = DaemonBackend(ring_name)
    b.start()
    try:
        client = await started(ring_name)
        hs = [await client.submit([1, 2], SamplingParams(max_tokens=20_000)) for _ in range(4)]
        await client.close()
        assert all(h.finished and h.finish_reason == "abort" for h in hs)
        ring = ring_view(ring_name)
        await wait_until(lambda: (ring.state[ring.cancel_flags == 1] == SlotState.DECODE_COMPLETED).all(), 10)
        # a new frontend takes over: resets what the closed one left completed
        client2 = await started(ring_name)
        assert client2.stats()["frontend_epoch"] == 2
        await assert_ring_clean(client2, ring_name)
        await client2.close()
    finally:
        b.stop()


async def test_event_loop_keeps_running_while_tokens_stream(backend):
    client = await started(backend.name)
    gaps, stop = [], False

    async def ticker():
        last = time.monotonic()
        while not stop:
            await asyncio.sleep(0.001)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    t = asyncio.create_task(ticker())
    hs = [await client.submit([i + 1], SamplingParams(max_tokens=2000)) for i in range(32)]
    outs = await asyncio.gather(*[h.result() for h in hs])
    stop = True
    await t
    assert all(len(o) == 2000 for o in outs)
    assert len(gaps) > 10   # the loop kept turning while the reader polled
    await client.close()


async def test_a_second_frontend_displaces_the_first(players):
    a = await started(players.name)
    h = await a.submit([1, 2], SamplingParams(max_tokens=20_000))
    b = await started(players.name)
    await wait_until(lambda: h.finished, 10)
    assert h.finish_reason == "error" and "another frontend" in h.error
    assert not a.health().healthy and "another frontend" in a.health().message
    with pytest.raises(BackendUnavailable, match="another frontend"):
        await a.submit([1], SamplingParams(max_tokens=1))
    h2 = await b.submit([3], SamplingParams(max_tokens=4))
    assert await h2.result() == players.expected(h2, [3], 4)
    await a.close()
    await b.close()


class CountingShm(ShmTransport):
    """The real shm transport, recording every write batch."""
    batches: list[list[tuple[int, bytes]]] = []

    def write_batch(self, writes):
        CountingShm.batches.append(list(writes))
        super().write_batch(writes)


async def test_a_burst_of_submissions_goes_out_as_one_batch_of_writes(players):
    CountingShm.batches = []
    client = RingClient(lambda: CountingShm.open(players.name), RingClientConfig())
    await client.start()
    await wait_until(lambda: client.health().healthy, 30)
    ring = ring_view(players.name)
    bell = ring.get("frontend_doorbell")
    before = len(CountingShm.batches)
    hs = await asyncio.gather(*[client.submit([i + 1, 2], SamplingParams(max_tokens=3)) for i in range(16)])
    # 16 submissions of one event-loop turn: prompt, body and state word each, in one batch, then
    # one ring of the frontend doorbell (the device scheduler scans the slots when it moved)
    burst = CountingShm.batches[before]
    assert len(burst) == 16 * 3 + 1
    assert burst[-1] == doorbell_write(bell + 1) and ring.get("frontend_doorbell") == bell + 1
    assert all(off != HEADER.offset("frontend_doorbell") for off, _ in burst[:-1])
    for i, h in enumerate(hs):
        assert await h.result() == players.expected(h, [i + 1, 2], 3)
    # a cancel rings too, after its flag
    h = await client.submit([9, 9], SamplingParams(max_tokens=100_000))
    async for _ in h:
        break
    n = len(CountingShm.batches)
    h.cancel()
    cancels = [b for b in CountingShm.batches[n:] if any(off == HEADER.offset("frontend_doorbell") for off, _ in b)]
    assert cancels and cancels[0][-1] == doorbell_write(bell + 3)
    assert cancels[0][0][0] == ring.geom.slot_field_offset(h.slot, "cancel")
    await client.close()


async def test_fine_wait_blocks_only_after_an_idle_yield(monkeypatch):
    """A fine wait (the reader expects tokens any moment) pauses the thread only when the previous
    yield ran nothing else; with other work on the loop it just yields, like a plain spin."""
    from dpu_frontend import ring_client
    client = RingClient(lambda: None, RingClientConfig())
    pauses = []
    monkeypatch.setattr(client, "_block", pauses.append)
    await client._sleep(0.0, fine=True)             # first yield: nothing known about the loop yet
    assert pauses == []
    monkeypatch.setattr(ring_client, "IDLE_YIELD_S", 1.0)   # any plain yield counts as idle here
    await client._sleep(0.0, fine=False)
    assert client._loop_idle and pauses == []       # not fine: never blocks
    await client._sleep(0.0, fine=True)             # the previous yield came straight back
    assert pauses == [client.config.reader.fine_sleep_s]
    monkeypatch.setattr(ring_client, "IDLE_YIELD_S", 0.001)

    async def busy():
        time.sleep(0.002)                           # another task holds the loop during our yield
    task = asyncio.ensure_future(busy())
    await client._sleep(0.0, fine=True)
    await task
    assert not client._loop_idle
    pauses.clear()
    await client._sleep(0.0, fine=True)
    assert pauses == []


async def test_timed_waits_use_the_wakeup_timer_and_end_early_on_wake():
    """With the timerfd watched by the loop, a timed wait ends at its time, a submission's wake ends
    it at once, and the expiry it leaves behind does not cut the next wait short."""
    from shared_layout.errors import TransportError

    def no_ring():
        raise TransportError("no ring here")
    client = RingClient(no_ring, RingClientConfig(reattach_interval_s=3600))
    client._run = lambda: asyncio.sleep(0)             # the test does the waiting, not the poll loop
    await client.start()
    assert client._timer is not None
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    await asyncio.wait_for(client._sleep(0.003), 5.0)
    assert time.monotonic() - t0 >= 0.003
    loop.call_later(0.01, client._wake)                # e.g. a submission landed
    t0 = time.monotonic()
    await asyncio.wait_for(client._sleep(60.0), 5.0)
    assert time.monotonic() - t0 < 30.0
    client._timer.arm(0.0)                             # an expiry left over from an earlier wait ...
    await asyncio.sleep(0.01)                          # ... already taken off the fd: ends no wait
    ended = asyncio.ensure_future(client._sleep(1.0))
    await asyncio.sleep(0.05)
    assert not ended.done()
    await asyncio.wait_for(ended, 5.0)
    await client.close()
    assert client._timer is None


async def test_a_failing_wakeup_timer_falls_back_to_loop_timers():
    from shared_layout.errors import TransportError

    def no_ring():
        raise TransportError("no ring here")
    client = RingClient(no_ring, RingClientConfig(reattach_interval_s=3600))
    client._run = lambda: asyncio.sleep(0)
    await client.start()

    def broken(seconds):
        raise OSError(22, "timerfd_settime: Invalid argument")
    client._timer.arm = broken
    await asyncio.wait_for(client._sleep(0.003), 5.0)   # the wait still ends, on a loop timer
    assert client._timer is None
    await asyncio.wait_for(client._sleep(0.003), 5.0)
    await client.close()


async def test_a_slow_transport_open_does_not_block_the_event_loop(players):
    """Opening a transport can take seconds (verbs bootstrap to a daemon that is slow to
    answer); the loop must keep running other tasks (HTTP /health, refusals) meanwhile."""
    opened = shm_factory(players.name)

    def slow_factory():
        time.sleep(1.0)   # the blocking part of a real connect
        return opened()

    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    tick_task = asyncio.get_running_loop().create_task(ticker())
    client = RingClient(slow_factory, RingClientConfig())
    t0 = time.monotonic()
    await client.start()
    waited = time.monotonic() - t0
    tick_task.cancel()
    try:
        assert waited >= 1.0
        assert ticks >= 20, f"the loop ran other tasks only {ticks} times during a {waited:.2f} s attach"
        await wait_until(lambda: client.health().healthy, 30, lambda: client.health())
        prompt = [1, 2, 3]
        h = await client.submit(prompt, SamplingParams(max_tokens=4, temperature=0.0))
        assert await h.result() == players.expected(h, prompt, 4)
    finally:
        await client.close()


@pytest.fixture
def bell_daemon(ring_name):
    """`blink gpu-daemon --model null --step-ms 5`, which rings the ring's doorbell after each step."""
    from shared_layout import doorbell
    if not doorbell.supported():
        pytest.skip("abstract unix sockets are Linux-only")
    b = DaemonBackend(ring_name)
    b.start("--step-ms", "5")
    yield b
    b.stop()


async def test_the_daemons_doorbell_wakes_the_reader_once_a_step(ring_name, bell_daemon):
    """A daemon on this host rings the ring's doorbell after each step: the frontend binds it on
    attach and polls about once a step (a 5 ms null step), where waking around predicted
    steps polled several times; a daemon killed and restarted rings the same bell again."""
    b = bell_daemon
    client = await started(ring_name)
    assert client._bell is not None
    for round_ in range(2):
        prompt = [5, 6, 7]
        h = await client.submit(prompt, SamplingParams(max_tokens=100))
        got = await asyncio.wait_for(h.__anext__(), 30)     # the first token: the bell has rung
        polls0 = client._reader.polls
        assert client._reader._bell_s > 0
        async for batch in h:
            got += batch
        assert got == b.expected(h, prompt, 100)
        polls = client._reader.polls - polls0
        # About one poll a step (and the 10 ms fallback's): waking around predicted steps, ~4 a step.
        assert polls <= 150, f"{polls} polls for the last 99 tokens (99 steps)"
        if round_ == 0:
            kill9(b)
            b.start("--step-ms", "5")
            await wait_until(lambda: client.health().healthy and client._bell is not None, 30,
                             lambda: client.health())
    await client.close()
    assert client._bell is None


async def test_a_frontend_that_displaces_another_takes_its_doorbell_over(ring_name, bell_daemon):
    """The bell's address is held by the first frontend when a second one attaches: the second polls
    without it until the first, displaced, lets it go, then binds it at its next stale check."""
    b = bell_daemon
    first = await started(ring_name)
    assert first._bell is not None
    second = await started(ring_name)
    await wait_until(lambda: second._bell is not None, 10, lambda: "the second frontend never bound the bell")
    assert first._bell is None and not first.health().healthy
    h = await second.submit([4, 5], SamplingParams(max_tokens=50))
    assert await asyncio.wait_for(h.result(), 30) == b.expected(h, [4, 5], 50)
    assert second._reader._bell_s > 0
    await first.close()
    await second.close()
