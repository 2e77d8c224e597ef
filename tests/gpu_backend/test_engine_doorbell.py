"""The engine rings its ring's doorbell after a step that published tokens or ended a slot, and
stays quiet while nothing happens."""
import select
import threading
import time

import numpy as np
import pytest

from gpu_backend.engine import Engine, EngineConfig
from gpu_backend.scheduler.intake import IntakeConfig
from gpu_backend.scheduler.policy import PolicyConfig
from shared_layout import FrontendPort, Ring, RingGeometry, SlotRequest, SlotState, doorbell
from shared_layout.doorbell import BellListener

pytestmark = pytest.mark.skipif(not doorbell.supported(), reason="abstract unix sockets are Linux-only")


class ConstantRunner:
    def run(self, batch):
        return [7 for c in batch.chunks if c.sample]


def _engine(ring_name, bell=True):
    geom = RingGeometry(4, 64, 64)
    ring = Ring.create(bytearray(geom.total_size), geom)
    policy = PolicyConfig(max_batch_size=4, max_prefill_tokens=64, block_size=4)
    eng = Engine(ring, ConstantRunner(), EngineConfig(policy=policy, num_blocks=32,
                                                      doorbell=ring_name if bell else None),
                 IntakeConfig(vocab_size=100, max_model_len=32, eos_ids=()))
    return ring, eng


def _submit(ring, slot, seq, prompt, max_tokens):
    FrontendPort(ring).submit(slot, SlotRequest(seq=seq, prompt_offset=0, prompt_len=len(prompt), output_offset=0,
                                                max_tokens=max_tokens, ignore_eos=True),
                              np.asarray(prompt, np.int32))


def test_a_serving_engine_rings_once_a_step_that_wrote_and_never_when_idle(ring_name):
    listener = BellListener.create(ring_name)
    ring, eng = _engine(ring_name)
    stop = threading.Event()
    t = threading.Thread(target=eng.serve, args=(stop,), daemon=True)
    t.start()
    try:
        time.sleep(0.05)
        assert listener.drain() == 0                    # idle steps write nothing: no bell
        _submit(ring, 0, 1, [1, 2, 3], 5)
        deadline = time.monotonic() + 10
        while ring.state[0] != SlotState.DECODE_COMPLETED and time.monotonic() < deadline:
            time.sleep(0.001)
        assert int(ring.slots[0]["generated"]) == 5
        time.sleep(0.05)
        # 5 steps, each publishing a token (the last also completes the slot): one bell each
        assert listener.drain() == 5 == eng.bell.rung
        time.sleep(0.05)
        assert listener.drain() == 0
    finally:
        stop.set()
        t.join(10)
        listener.close()


def test_a_rejected_request_rings_too(ring_name):
    """Intake ends a request it cannot serve (a token outside the vocabulary) without a step:
    the frontend waiting for it is woken all the same."""
    listener = BellListener.create(ring_name)
    ring, eng = _engine(ring_name)
    try:
        _submit(ring, 0, 1, [1, 500], 4)
        eng.step()
        eng._ring_bell()
        assert ring.state[0] == SlotState.DECODE_COMPLETED
        assert select.select([listener.fileno()], [], [], 1.0)[0] and listener.drain() == 1
    finally:
        eng.bell.close()
        listener.close()


def test_no_doorbell_without_a_ring_name(ring_name):
    ring, eng = _engine(ring_name, bell=False)
    assert eng.bell is None
    eng._ring_bell()          # nothing to ring: a no-op
