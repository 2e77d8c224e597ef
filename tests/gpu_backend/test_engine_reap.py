"""Cancellation reaches the engine both ways it looks for it: the cancel flags of its own
few requests, and (above engine.REAP_SCAN_LIMIT owned requests) one scan of the whole
flag array. Either way exactly the cancelled requests end with ABORT, within one step."""
from __future__ import annotations

import pathlib
import sys

import pytest

from gpu_backend.engine import REAP_SCAN_LIMIT, Engine, EngineConfig
from gpu_backend.executors.null import EchoRunner
from gpu_backend.scheduler.intake import IntakeConfig
from gpu_backend.scheduler.policy import PolicyConfig
from shared_layout import FinishReason, Ring, RingGeometry

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from frontend_player import FrontendPlayer  # noqa: E402

GEOM = RingGeometry(256, 256 * 8, 256 * 64)


@pytest.mark.parametrize("requests", [3, REAP_SCAN_LIMIT + 40])
def test_cancelled_requests_and_only_those_end_with_abort(requests):
    ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    engine = Engine(ring, EchoRunner(), EngineConfig(PolicyConfig(256, 1 << 16, 16), 256 * 8),
                    IntakeConfig(1000, 128, ()))
    fe = FrontendPlayer(ring)
    slots = [fe.submit([5, 6, 7], 40) for _ in range(requests)]
    for _ in range(3):
        engine.step()
    assert len(engine.owned) == requests
    victims = set(slots[1::2])
    for s in victims:
        fe.cancel(s)
    engine.step()                                   # one step: every cancelled request is ended
    assert {s for s in slots if fe.done(s)} == victims
    for _ in range(60):
        engine.step()
    for s in slots:
        r = fe.collect(s)
        assert r.finish == (FinishReason.ABORT if s in victims else FinishReason.LENGTH)
        if s not in victims:
            assert r.tokens == [5, 6, 7] * 13 + [5]
    assert not engine.owned and engine.scheduler.allocator.free_count == 256 * 8
