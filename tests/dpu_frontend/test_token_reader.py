"""RingSession + TokenReader over a real shm ring; this test plays the backend with BackendPort."""

import numpy as np
import pytest

from dpu_frontend.backend_health import HealthMonitor
from dpu_frontend.request_handle import RequestHandle
from dpu_frontend.ring_session import RingSession
from dpu_frontend.token_reader import ReaderConfig, TokenReader, finish_of
from dpu_frontend.transport import ShmTransport
from shared_layout import (BackendPort, BackendStatus, ErrorCode, FinishReason, FrontendPort, Ring,
                           RingGeometry, SlotRequest, SlotState)
from shared_layout.shm import ShmRegion

GEOM = RingGeometry(8, 512, 512)


class Rig:
    """A ring in /dev/shm, the backend's port on it, and the frontend's session and reader."""

    def __init__(self, ring_name, config=ReaderConfig(), prepare=None):
        self.region = ShmRegion.create(ring_name, GEOM.total_size)
        self.ring = Ring.create(self.region.buf, GEOM)
        self.be = BackendPort(self.ring)
        self.ring.set("backend_status", BackendStatus.READY)
        self.be.beat()
        if prepare:
            prepare(self)
        self.session = RingSession.attach(ShmTransport.open(ring_name))
        self.health = HealthMonitor(2.0, True)
        self.reader = TokenReader(self.session, self.health, config)
        self.cancels = []

    def submit(self, prompt, max_tokens, stops=(), extra_stops=(), max_buffered=1000):
        s = self.session
        f = s.reserve(len(prompt), max_tokens)
        writes = s.submission(f, np.array(prompt, np.int32), temperature=0.0, top_p=1.0, top_k=0, seed=None,
                              ignore_eos=False, stop_ids=tuple(stops), t_submit_ns=1)
        s.transport.write_batch(writes)
        f.handle = RequestHandle(seq=f.seq, slot=f.slot, prompt_tokens=len(prompt), max_tokens=max_tokens,
                                 t_submit_ns=1, max_buffered_tokens=max_buffered, on_cancel=self._cancel)
        f.extra_stops = frozenset(extra_stops)
        self.reader.track(f)
        return f, f.handle

    def _cancel(self, h, reason, err):
        f = self.session.flights[h.slot]
        f.handle = None
        self.session.write_cancels([h.slot])
        self.cancels.append(h.slot)
        h._end(reason, err)

    def claim(self, slot):
        assert self.ring.state[slot] == SlotState.PREFILL_PENDING
        self.be.claim(slot)
        self.be.move(slot, SlotState.DECODE_PROCESSING)

    def drained(self, h):
        out = list(h._pending)
        h._pending.clear()
        return out


@pytest.fixture(params=["scalar", "vector"])
def rig(ring_name, request):
    """Every reader test runs both ways of finding moved slots (one by one, and numpy)."""
    return Rig(ring_name, ReaderConfig(scalar_max_flights=0) if request.param == "vector" else ReaderConfig())


def test_submit_writes_a_request_the_backend_can_read(rig):
    f, h = rig.submit([5, 6, 7], 4, stops=(9,))
    req = rig.ring.slot_request(f.slot)
    assert rig.ring.state[f.slot] == SlotState.PREFILL_PENDING
    assert (req.seq, req.epoch, req.prompt_len, req.max_tokens, req.stop_ids) == (f.seq, rig.session.epoch, 3, 4, (9,))
    assert rig.ring.prompt_arena[req.prompt_offset:req.prompt_offset + 3].tolist() == [5, 6, 7]
    assert rig.ring.get("frontend_epoch") == rig.session.epoch == 1


def test_tokens_flow_in_order_then_the_slot_comes_back(rig):
    f, h = rig.submit([1, 2], 5)
    assert not rig.reader.poll().progress
    rig.claim(f.slot)
    rig.be.publish(f.slot, [10, 11])
    assert rig.reader.poll().progress and rig.drained(h) == [10, 11]
    rig.be.publish(f.slot, [12])
    rig.reader.poll()
    assert rig.drained(h) == [12] and not h.finished
    rig.be.publish(f.slot, [13, 14])
    rig.be.complete(f.slot, FinishReason.LENGTH)
    res = rig.reader.poll()
    assert res.freed == 1 and rig.drained(h) == [13, 14]
    assert (h.finish_reason, h.error, h.completion_tokens) == ("length", None, 5)
    assert h.t_picked_ns and h.t_first_ns and h.t_last_ns >= h.t_first_ns
    assert rig.ring.state[f.slot] == SlotState.EMPTY
    s = rig.session
    assert not s.flights and s.tracker.n_free == GEOM.slot_count
    assert s.prompts.free_tokens == GEOM.prompt_arena_tokens and s.outputs.free_tokens == GEOM.output_arena_tokens


def test_the_last_token_waits_for_the_completion(rig):
    f, h = rig.submit([1], 3)
    rig.claim(f.slot)
    rig.be.publish(f.slot, [20])
    rig.reader.poll()
    assert rig.drained(h) == [20]
    rig.be.publish(f.slot, [21, 22])               # max_tokens reached; the slot not yet complete
    assert not rig.reader.poll().progress and rig.drained(h) == [] and not h.finished
    rig.be.complete(f.slot, FinishReason.LENGTH)
    assert rig.reader.poll().freed == 1
    assert rig.drained(h) == [21, 22] and h.finish_reason == "length" and h.completion_tokens == 3


def test_a_request_finished_between_polls_is_read_whole(rig):
    f, h = rig.submit([1], 3, stops=(22,))
    rig.claim(f.slot)
    rig.be.publish(f.slot, [20, 21, 22])
    rig.be.complete(f.slot, FinishReason.STOP)
    rig.reader.poll()
    assert rig.drained(h) == [20, 21, 22] and h.finish_reason == "stop"


def test_never_hands_over_tokens_of_another_seq(rig):
    f, h = rig.submit([1], 4)
    rig.claim(f.slot)
    # Another writer puts a different request in the slot (only a second frontend could).
    rig.ring.slots[f.slot]["seq"] = f.seq + 100
    rig.be.publish(f.slot, [66, 67])
    rig.reader.poll()
    assert rig.drained(h) == [] and h.finish_reason == "error" and "taken over" in h.error
    rig.be.complete(f.slot, FinishReason.LENGTH)
    rig.reader.poll()
    assert rig.ring.state[f.slot] == SlotState.DECODE_COMPLETED   # not ours: never touched again


def test_attach_takes_over_the_ring_from_an_earlier_frontend(ring_name):
    old = {}

    def earlier_frontend(rig):
        rig.ring.set("frontend_epoch", 6)
        fe = FrontendPort(rig.ring)
        for slot, st in ((1, SlotState.DECODE_COMPLETED), (2, SlotState.DECODE_PROCESSING),
                         (3, SlotState.PREFILL_PENDING)):
            fe.submit(slot, SlotRequest(seq=slot, prompt_offset=0, prompt_len=1, output_offset=0, max_tokens=4,
                                        epoch=6), np.array([1], np.int32))
            if st != SlotState.PREFILL_PENDING:
                rig.be.claim(slot)
                rig.be.move(slot, SlotState.DECODE_PROCESSING)
            if st == SlotState.DECODE_COMPLETED:
                rig.be.complete(slot, FinishReason.LENGTH)
        old["bytes"] = rig.ring.slots[[2, 3]].tobytes()

    rig = Rig(ring_name, prepare=earlier_frontend)
    assert rig.ring.get("frontend_epoch") == 7 == rig.session.epoch
    assert rig.ring.state[1] == SlotState.EMPTY                      # completed leftover reset
    assert rig.ring.slots[[2, 3]].tobytes() == old["bytes"]          # backend-owned: untouched
    taken = [rig.session.tracker.take() for _ in range(GEOM.slot_count - 2)]
    assert 2 not in taken and 3 not in taken and rig.session.tracker.take() is None
    for t in taken:
        rig.session.tracker.release(t)
    # the daemon aborts the stale ones; the reader resets them and they become free
    rig.be.complete(2, FinishReason.ABORT, ErrorCode.STALE_EPOCH)
    rig.be.claim(3)
    rig.be.complete(3, FinishReason.ABORT, ErrorCode.STALE_EPOCH)
    assert rig.reader.poll().freed == 2
    assert rig.ring.state[2] == rig.ring.state[3] == SlotState.EMPTY
    assert rig.session.tracker.n_free == GEOM.slot_count


def test_stop_ids_beyond_the_slot_are_cut_by_the_reader(rig):
    f, h = rig.submit([1], 10, stops=tuple(range(100, 108)), extra_stops=(55,))
    rig.claim(f.slot)
    rig.be.publish(f.slot, [1, 2, 55, 3])
    rig.reader.poll()
    assert rig.drained(h) == [1, 2, 55] and h.finish_reason == "stop" and h.completion_tokens == 3
    assert rig.ring.cancel_flags[f.slot] == 1
    assert rig.session.flights[f.slot].handle is None     # slot held until the daemon completes it
    rig.be.complete(f.slot, FinishReason.ABORT)
    rig.reader.poll()
    assert rig.ring.state[f.slot] == SlotState.EMPTY and not rig.session.flights


def test_a_consumer_that_stops_reading_gets_cancelled(rig):
    f, h = rig.submit([1], 100, max_buffered=8)
    rig.claim(f.slot)
    rig.be.publish(f.slot, list(range(6)))
    rig.reader.poll()
    assert not h.finished
    rig.be.publish(f.slot, list(range(6)))
    rig.reader.poll()
    assert h.finish_reason == "error" and "stopped reading" in h.error
    assert rig.cancels == [f.slot] and rig.ring.cancel_flags[f.slot] == 1


@pytest.mark.parametrize("finish,code,want", [
    (FinishReason.ERROR, ErrorCode.INVALID_TOKEN, ("error", "vocabulary")),
    (FinishReason.ABORT, ErrorCode.BACKEND_SHUTDOWN, ("error", "shut down")),
    (FinishReason.ABORT, ErrorCode.NONE, ("abort", None)),
])
def test_completion_words_map_to_finish_reasons(rig, finish, code, want):
    f, h = rig.submit([1], 4)
    rig.be.claim(f.slot)
    rig.be.complete(f.slot, finish, code)
    rig.reader.poll()
    assert h.finish_reason == want[0]
    assert (h.error is None) if want[1] is None else (want[1] in h.error)
    assert finish_of(99, 0)[0] == "error"


@pytest.mark.parametrize("scalar_max", [0, 128])
def test_new_slots_are_read_first_under_a_per_poll_cap(ring_name, scalar_max):
    rig = Rig(ring_name, config=ReaderConfig(max_slots_per_poll=1, scalar_max_flights=scalar_max))
    old, ho = rig.submit([1], 50)
    rig.claim(old.slot)
    rig.be.publish(old.slot, [1])
    rig.reader.poll()
    assert rig.drained(ho) == [1]
    new, hn = rig.submit([2], 50)
    rig.claim(new.slot)
    rig.be.publish(old.slot, [2])
    rig.be.publish(new.slot, [9])
    res = rig.reader.poll()
    assert res.backlog and rig.drained(hn) == [9] and rig.drained(ho) == []
    rig.reader.poll()
    assert rig.drained(ho) == [2]


def test_pacing(rig):
    cfg = rig.reader.config
    rig.reader._last_progress_s = 0.0
    assert rig.reader.next_interval_s(None) == cfg.idle_interval_s
    f, h = rig.submit([1], 4)                  # a submission spins the reader for its first token
    assert rig.reader.next_interval_s(None) == 0.0
    rig.reader._last_progress_s = 0.0          # past spin_s: still fine polls while the first token is due
    assert rig.reader.next_interval_s(None) == 0.0 and rig.reader.fine
    rig.reader._last_submit_s -= cfg.first_token_spin_s   # past first_token_spin_s: busy polling
    assert rig.reader.next_interval_s(None) == cfg.busy_interval_s and not rig.reader.fine
    rig.reader._last_submit_s += cfg.first_token_spin_s
    rig.claim(f.slot)
    rig.be.publish(f.slot, [7])
    rig.reader.poll()                          # the first token is in: no first-token spin any more
    rig.reader._last_progress_s = 0.0
    assert rig.reader.next_interval_s(None) == cfg.busy_interval_s


def test_health_monitor_window_and_shared_clock():
    hm = HealthMonitor(window_s=2.0, shares_clock=False)
    hdr = {"backend_heartbeat": 5, "backend_heartbeat_ns": 1, "backend_epoch": 1,
           "backend_status": BackendStatus.READY, "backend_pid": 42, "model_max_len": 100, "model_vocab_size": 7,
           "kv_blocks_total": 64, "kv_blocks_free": 60, "prefix_caching": 1, "kv_blocks_cached": 3,
           **{f"prefix_{k}": 0 for k in hm.prefix_counters}}
    assert not hm.health(0.0).healthy and hm.heartbeat_age_s() is None
    hm.observe(hdr, 10.0)
    assert hm.health(11.0).healthy and hm.model_max_len == 100 and hm.vocab_size == 7
    assert (hm.kv_blocks_total, hm.kv_blocks_free) == (64, 60)
    assert not hm.lost(11.9) and hm.lost(12.5)
    h = hm.health(12.5)
    assert not h.healthy and "no heartbeat" in h.message and "pid 42" in h.message
    hm.observe(dict(hdr, backend_heartbeat=6), 12.6)
    assert hm.health(12.7).healthy
    hm.observe(dict(hdr, backend_heartbeat=6, backend_status=BackendStatus.STARTING), 12.8)
    assert hm.health(12.8).message == "backend starting"
    # one machine: a heartbeat stamped long ago is judged at once
    hm2 = HealthMonitor(window_s=2.0, shares_clock=True)
    hm2.observe(dict(hdr, backend_heartbeat_ns=int(1e9)), 100.0)
    assert hm2.lost(100.0)


def test_scalar_and_vector_polls_see_the_same_moves(ring_name):
    """Many slots in several states: both ways of finding moved slots hand over the same tokens."""
    rig = Rig(ring_name)
    fs = [rig.submit([1], 20) for _ in range(6)]
    for f, _ in fs[:5]:
        rig.claim(f.slot)
    rig.be.publish(fs[0][0].slot, [1, 2])
    rig.be.publish(fs[2][0].slot, [3])
    rig.be.publish(fs[3][0].slot, [4, 5, 6])
    rig.be.complete(fs[3][0].slot, FinishReason.LENGTH)
    rig.be.complete(fs[4][0].slot, FinishReason.STOP)
    rig.session.snapshot.refresh_full(rig.session.tracker.held)
    scalar = rig.reader._moved_scalar()
    vector = rig.reader._moved_vector()
    assert scalar == vector
    assert [slot for slot, _ in scalar] == sorted(fs[i][0].slot for i in (0, 2, 3, 4))
    assert all(isinstance(w, int) for _, words in scalar for w in words)
    rig.reader.poll()
    assert [rig.drained(h) for _, h in fs] == [[1, 2], [], [3], [4, 5, 6], [], []]
    assert fs[3][1].finish_reason == "length" and fs[4][1].finish_reason == "stop"
    rig.session.snapshot.refresh_full(rig.session.tracker.held)
    assert rig.reader._moved_scalar() == rig.reader._moved_vector() == []


def test_an_unchanged_header_is_not_decoded_again(rig):
    seen = []
    observe = rig.health.observe
    rig.health.observe = lambda header, now_s=None: (seen.append(int(header["backend_heartbeat"])),
                                                     observe(header, now_s))
    rig.reader.poll()
    rig.reader.poll()
    assert len(seen) == 1
    rig.be.beat()
    rig.reader.poll()
    assert len(seen) == 2 and seen[1] > seen[0] and rig.health.health().healthy


def test_step_prediction_sleeps_until_just_before_the_next_step(ring_name):
    """Two requests decoding in 20 ms steps: after a complete step the reader sleeps until
    predict_lead_s before the next one is due, polls finely around it, and falls back to busy
    polling when it is late; a step with part of its tokens still missing is polled finely."""
    import time

    from shared_layout import now_ns
    rig = Rig(ring_name)
    r, cfg = rig.reader, rig.reader.config
    (f1, h1), (f2, h2) = rig.submit([1], 100), rig.submit([2], 100)
    rig.claim(f1.slot)
    rig.claim(f2.slot)
    step = 20_000_000
    t_last = now_ns()
    for k in (3, 2, 1, 0):                    # four steps, the newest one just now
        t = t_last - k * step
        rig.be.publish(f1.slot, [1], now=t)
        rig.be.publish(f2.slot, [2], now=t + 100_000)   # a step's publishes are spread a little
        r.poll()
    assert r.step_period_s() == pytest.approx(0.02)
    r._last_progress_s = 0.0                  # past the spin after progress
    wait = r.next_interval_s(None)
    assert 0.02 - cfg.predict_lead_s - 0.005 < wait <= 0.02 - cfg.predict_lead_s and not r.fine
    # Around the due time: fine polls; well past it (a late step): busy polling.
    r._step_local_s = time.monotonic() - 0.02 + cfg.predict_lead_s / 2
    assert r.next_interval_s(None) == 0.0 and r.fine
    r._step_local_s = time.monotonic() - 0.02 - cfg.predict_window_s - 0.001
    assert r.next_interval_s(None) == cfg.busy_interval_s and not r.fine
    # The next step reaches only the first request so far: keep polling finely for the rest.
    rig.be.publish(f1.slot, [1], now=t_last + step)
    r.poll()
    r._last_progress_s = 0.0
    assert r.next_interval_s(None) == 0.0 and r.fine
    rig.be.publish(f2.slot, [2], now=t_last + step + 100_000)
    r.poll()
    r._last_progress_s = 0.0
    assert r.next_interval_s(None) > 0.01 and not r.fine   # complete: asleep until the next one
    assert rig.drained(h1) == [1] * 5 and rig.drained(h2) == [2] * 5


def test_no_prediction_for_short_or_irregular_steps(ring_name):
    from shared_layout import now_ns
    rig = Rig(ring_name)
    r, cfg = rig.reader, rig.reader.config
    f, h = rig.submit([1], 100)
    rig.claim(f.slot)
    t0 = now_ns()
    for k in range(4):                        # 3 ms steps: below predict_min_step_s
        rig.be.publish(f.slot, [1], now=t0 - (3 - k) * 3_000_000)
        r.poll()
    assert r.step_period_s() is None
    r._last_progress_s = 0.0
    assert r.next_interval_s(None) == cfg.busy_interval_s
    off = TokenReader(rig.session, rig.health, ReaderConfig(predict_min_step_s=0))   # prediction off
    off._step_gaps.extend([20_000_000] * 3)
    assert off.step_period_s() is None


def _steady_steps(rig, step_ns=20_000_000):
    """Two requests, four 20 ms steps read, the newest one just now."""
    from shared_layout import now_ns
    (f1, h1), (f2, h2) = rig.submit([1], 100), rig.submit([2], 100)
    rig.claim(f1.slot)
    rig.claim(f2.slot)
    t_last = now_ns()
    for k in (3, 2, 1, 0):
        rig.be.publish(f1.slot, [1], now=t_last - k * step_ns)
        rig.be.publish(f2.slot, [2], now=t_last - k * step_ns + 100_000)
        rig.reader.poll()
    return (f1, h1), (f2, h2)


def test_precise_wakeups_wake_closer_to_the_step_and_poll_by_its_jitter(ring_name):
    """A caller whose sleeps are precise (RingClient's timerfd): the reader wakes
    predict_lead_precise_s before the due step; around it, steady steps get fine polls, steps
    that jitter get polls a tenth of the jitter apart, predict_poll_s at most; a late step
    still falls back to busy polling."""
    import time
    rig = Rig(ring_name)
    r = rig.reader = TokenReader(rig.session, rig.health, ReaderConfig(), precise_wake=True)
    cfg = r.config
    _steady_steps(rig)
    assert r.lead_s == cfg.predict_lead_precise_s < cfg.predict_lead_s
    r._last_progress_s = 0.0
    wait = r.next_interval_s(None)
    assert 0.02 - cfg.predict_lead_precise_s - 0.005 < wait <= 0.02 - cfg.predict_lead_precise_s
    assert r.step_spread_s() == 0.0
    r._step_local_s = time.monotonic() - 0.02 + cfg.predict_lead_precise_s / 2
    assert r.next_interval_s(None) == 0.0 and r.fine                  # steady: fine polls
    r._step_gaps.extend([20_000_000, 21_000_000])                     # 1 ms of jitter: every 0.1 ms
    assert r.step_spread_s() == pytest.approx(0.001)
    assert r.next_interval_s(None) == pytest.approx(0.0001) and not r.fine
    r._step_gaps.append(24_000_000)                                   # 4 ms: capped at predict_poll_s
    assert r.next_interval_s(None) == cfg.predict_poll_s and not r.fine
    r._step_local_s = time.monotonic() - 0.02 - cfg.predict_window_s - 0.001
    assert r.next_interval_s(None) == cfg.busy_interval_s
    coarse = TokenReader(rig.session, rig.health, ReaderConfig())   # loop timers: the coarse lead
    assert coarse.lead_s == cfg.predict_lead_s and not coarse.precise_wake


def test_no_spin_after_a_complete_step_unless_a_first_token_is_due(ring_name):
    """Right after a step's tokens were handed over, a known-complete step sends the reader to
    sleep until the next one; a request waiting for its first token keeps the spin."""
    rig = Rig(ring_name)
    r = rig.reader
    _steady_steps(rig)
    res = r.poll()                               # nothing new, just after the progress
    assert r.next_interval_s(res) > 0.01 and not r.fine
    f3, _ = rig.submit([3], 100)                 # waits for its first token: urgent
    assert f3.slot in r.urgent
    assert r.next_interval_s(res) == 0.0


def test_a_heard_doorbell_sleeps_until_the_next_one(ring_name):
    """While the daemon's doorbell rings (a daemon on this host), the reader neither spins after
    progress nor wakes around the predicted step: it waits for the bell, polling every
    bell_fallback_s at most; a bell not heard for bell_trust_s hands back to step prediction."""
    import time
    rig = Rig(ring_name)
    r = rig.reader = TokenReader(rig.session, rig.health, ReaderConfig(), precise_wake=True)
    cfg = r.config
    _steady_steps(rig)
    res = r.poll()
    r.heard_bell(time.monotonic())
    assert r.next_interval_s(res) == cfg.bell_fallback_s and not r.fine
    rig.submit([3], 100)                         # a first token due: the bell brings it too
    assert r.next_interval_s(res) == cfg.bell_fallback_s
    r._last_progress_s = 0.0
    r.heard_bell(time.monotonic() - cfg.bell_trust_s - 0.01)   # the bell went quiet
    assert r.next_interval_s(None) != cfg.bell_fallback_s
    for f in list(rig.session.flights.values()):   # nothing in flight: the idle interval, bell or not
        rig.session.retire(f.slot)
    r.heard_bell(time.monotonic())
    assert r.next_interval_s(None) == cfg.idle_interval_s
