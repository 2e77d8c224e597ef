"""The frontend doorbell (csrc/sched_loop.h blink_scan_decide) on the CPU twin of the persistent
scheduler: with full_scan_us set, the loop scans the slots only when the header's
frontend_doorbell or frontend_epoch moved, or when the interval is due; with 0, every iteration.
A real shared-memory ring, the frontend's own writers (FrontendPort rings the bell after a
submission and a cancel), the twin's real loop."""
from __future__ import annotations

import pathlib
import sys
import time

import numpy as np

from gpu_backend.cuda import structs
from gpu_backend.cuda.config import SchedulerConfig
from shared_layout import ErrorCode, FinishReason, RingGeometry, SlotRequest, SlotState, fence, submit_writes

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from frontend_player import FrontendPlayer  # noqa: E402

GEOM = RingGeometry(64, 1 << 16, 1 << 16)
NEVER_US = 30_000_000     # a full-scan interval no test outlives: only the bell and the epoch start scans


def twin(ring, **cfg):
    from gpu_backend.cuda.twin import TwinScheduler
    base = dict(max_batch_size=8, max_model_len=512, idle_sleep_ns=50_000, beat_interval_s=0.005, grace_s=2.0)
    base.update(cfg)
    return TwinScheduler(ring, SchedulerConfig(**base), threads=4)


def stop(tw) -> int:
    tw.stop()
    assert tw.join(30), "twin scheduler did not exit"
    return tw.exit_code


def wait_until(cond, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.001)
    return time.monotonic() - t0


def echo(prompt, n):
    return [prompt[i % len(prompt)] for i in range(n)]


def write_without_bell(ring, slot: int, prompt: list[int], max_tokens: int, seq: int) -> None:
    """A submission as a writer that does not ring would make it: payload, fence, state word."""
    req = SlotRequest(seq=seq, prompt_offset=slot * 64, prompt_len=len(prompt), output_offset=slot * 64,
                      max_tokens=max_tokens, epoch=ring.get("frontend_epoch"))
    writes = submit_writes(ring.geom, slot, req, np.asarray(prompt, np.int32))
    mv = memoryview(ring.buf).cast("B")
    for off, data in writes[:-1]:
        mv[off:off + len(data)] = data
    fence()
    off, data = writes[-1]
    mv[off:off + len(data)] = data


def test_an_idle_loop_does_not_scan_and_a_rung_submission_is_served(twin_lib, shm_ring):
    ring = shm_ring(GEOM)
    tw = twin(ring, full_scan_us=NEVER_US).start()
    wait_until(lambda: tw.stats.iterations > 200, 10, "the loop iterating")
    idle = (int(tw.stats.iterations), int(tw.stats.scans))
    time.sleep(0.1)
    assert tw.stats.iterations > idle[0] + 100
    assert tw.stats.scans == idle[1] <= 1        # the first iteration's scan (no bell recorded yet), no more
    fp = FrontendPlayer(ring)
    bell = ring.get("frontend_doorbell")
    slots = [fp.submit([5, 6, 7], 20) for _ in range(3)]
    assert ring.get("frontend_doorbell") == bell + 3
    wait_until(lambda: all(fp.done(s) for s in slots), 10, "the rung submissions served")
    for s in slots:
        r = fp.collect(s)
        assert (r.finish, r.tokens) == (FinishReason.LENGTH, echo([5, 6, 7], 20))
    assert tw.stats.scans < tw.stats.iterations / 10
    assert stop(tw) == structs.EXIT_SHUTDOWN


def test_a_write_without_the_bell_waits_until_the_bell_rings(twin_lib, shm_ring):
    ring = shm_ring(GEOM)
    tw = twin(ring, full_scan_us=NEVER_US).start()
    wait_until(lambda: tw.stats.iterations > 50, 10, "the loop iterating")
    write_without_bell(ring, 5, [1, 2, 3], 4, seq=1)
    time.sleep(0.2)                              # hundreds of iterations, none of them a scan
    assert ring.state[5] == SlotState.PREFILL_PENDING
    fp = FrontendPlayer(ring)
    fp.port.ring_doorbell()
    wait_until(lambda: ring.state[5] == SlotState.DECODE_COMPLETED, 10, "served after the bell")
    assert ring.tokens(5, 0, 4).tolist() == [1, 2, 3, 1]
    assert stop(tw) == structs.EXIT_SHUTDOWN


def served_without_bell(ring, full_scan_us: int):
    """A twin with this interval serves a request written without the bell; the stopped twin."""
    tw = twin(ring, full_scan_us=full_scan_us).start()
    wait_until(lambda: tw.stats.iterations > 200, 10, "the loop iterating")
    write_without_bell(ring, 9, [4, 5], 3, seq=1)
    wait_until(lambda: ring.state[9] == SlotState.DECODE_COMPLETED, 5, "served without the bell")
    assert ring.tokens(9, 0, 3).tolist() == [4, 5, 4]
    assert stop(tw) == structs.EXIT_SHUTDOWN
    return tw


def test_the_full_scan_interval_catches_a_write_without_the_bell(twin_lib, shm_ring):
    tw = served_without_bell(shm_ring(GEOM), 20_000)
    assert 0 < tw.stats.scans < tw.stats.iterations


def test_cancels_and_a_new_frontend_epoch_start_scans_without_the_interval(twin_lib, shm_ring):
    """Long requests decoding under a slow step: a cancel (it rings) ends its request, and a new
    frontend epoch (no bell) turns the others stale, both found by scans the interval never starts."""
    ring = shm_ring(GEOM)
    tw = twin(ring, full_scan_us=NEVER_US, max_model_len=8192, idle_sleep_ns=1_000_000).start()
    fp = FrontendPlayer(ring)
    slots = [fp.submit([3, 4, 5], 4000) for _ in range(4)]
    wait_until(lambda: all(fp.port.poll(s)[2] > 0 for s in slots), 10, "every request decoding")
    fp.cancel(slots[0])
    wait_until(lambda: fp.done(slots[0]), 10, "the cancelled request ended")
    ring.set("frontend_epoch", ring.get("frontend_epoch") + 1)     # a restarted frontend: no bell
    wait_until(lambda: all(fp.done(s) for s in slots[1:]), 10, "the old epoch's requests ended")
    results = {s: fp.collect(s) for s in slots}
    assert (results[slots[0]].finish, results[slots[0]].error) == (FinishReason.ABORT, ErrorCode.NONE)
    for s in slots[1:]:
        assert (results[s].finish, results[s].error) == (FinishReason.ABORT, ErrorCode.STALE_EPOCH)
        assert 0 < len(results[s].tokens) < 4000
    assert stop(tw) == structs.EXIT_SHUTDOWN


def test_full_scan_us_0_scans_every_iteration(twin_lib, shm_ring):
    tw = served_without_bell(shm_ring(GEOM), 0)
    # every iteration scans but the last, which the stop ended in its control phase
    assert tw.stats.iterations - 1 <= tw.stats.scans <= tw.stats.iterations


def test_the_doorbell_interval_is_checked():
    import pytest
    for bad in (-1, 1 << 32, 1.5):
        with pytest.raises(ValueError, match="full_scan_us"):
            SchedulerConfig(full_scan_us=bad)
