"""EngineConfig.period_log: one `engine period` line per busy period (steps until the ring is
quiet), the wall time split between the engine's own Python and the runner, with the runner's
own parts (Runner.timing) as deltas over the period; nothing logged without it."""
import json
import logging
import threading
import time

import numpy as np

from gpu_backend.engine import Engine, EngineConfig
from gpu_backend.scheduler.intake import IntakeConfig
from gpu_backend.scheduler.policy import PolicyConfig
from shared_layout import FrontendPort, Ring, RingGeometry, SlotRequest, SlotState


class TimedRunner:
    """Each step waits 2 ms, counted as its `wait` (as the host loop's launcher counts the stream sync)."""

    def __init__(self):
        self.wait_ns = 10**9          # cumulative from before the periods: the log gives deltas

    def run(self, batch):
        t = time.perf_counter_ns()
        time.sleep(0.002)
        self.wait_ns += time.perf_counter_ns() - t
        return [7 for c in batch.chunks if c.sample]

    def timing(self):
        return {"wait_ns": self.wait_ns}


def _serve_two_bursts(period_log: bool, caplog) -> list[dict]:
    geom = RingGeometry(4, 64, 64)
    ring = Ring.create(bytearray(geom.total_size), geom)
    policy = PolicyConfig(max_batch_size=4, max_prefill_tokens=64, block_size=4)
    eng = Engine(ring, TimedRunner(), EngineConfig(policy=policy, num_blocks=32, period_log=period_log),
                 IntakeConfig(vocab_size=100, max_model_len=32, eos_ids=()))
    stop = threading.Event()
    t = threading.Thread(target=eng.serve, args=(stop,), daemon=True)
    caplog.set_level(logging.INFO, logger="blink.gpu_daemon")
    t.start()
    try:
        for seq in (1, 2):            # two bursts, the ring quiet between them
            FrontendPort(ring).submit(0, SlotRequest(seq=seq, prompt_offset=0, prompt_len=3, output_offset=0,
                                                     max_tokens=5, ignore_eos=True), np.asarray([1, 2, 3], np.int32))
            deadline = time.monotonic() + 10
            while ring.state[0] != SlotState.DECODE_COMPLETED and time.monotonic() < deadline:
                time.sleep(0.001)
            assert int(ring.slots[0]["generated"]) == 5
            time.sleep(0.05)
            ring.state[0] = SlotState.EMPTY
    finally:
        stop.set()
        t.join(10)
    return [json.loads(r.getMessage().split("engine period ", 1)[1])
            for r in caplog.records if r.getMessage().startswith("engine period ")]


def test_each_busy_period_is_logged_in_parts(caplog):
    periods = _serve_two_bursts(True, caplog)
    assert len(periods) == 2
    for p in periods:
        assert p["steps"] == 5                       # one prefill, four decode steps
        assert 5 * 2.0 <= p["wait_ms"] <= p["runner_ms"] <= p["wall_ms"]     # the delta, not the runner's total
        assert abs(p["engine_ms"] + p["runner_ms"] - p["wall_ms"]) < 0.01 and p["engine_ms"] > 0


def test_nothing_is_logged_by_default(caplog, monkeypatch):
    monkeypatch.delenv("BLINK_ENGINE_PERIODS", raising=False)
    assert EngineConfig(policy=PolicyConfig(), num_blocks=8).period_log is False
    assert _serve_two_bursts(False, caplog) == []
