"""The engine publishes its KV pool's size and free blocks in the ring header."""
import numpy as np

from gpu_backend.engine import Engine, EngineConfig
from gpu_backend.scheduler.intake import IntakeConfig
from gpu_backend.scheduler.policy import PolicyConfig
from shared_layout import FrontendPort, Ring, RingGeometry, SlotRequest, SlotState


class ConstantRunner:
    """No model: token 7 for every chunk that samples."""

    def run(self, batch):
        return [7 for c in batch.chunks if c.sample]


def test_kv_blocks_in_the_header_track_the_pool():
    geom = RingGeometry(4, 64, 64)
    ring = Ring.create(bytearray(geom.total_size), geom)
    policy = PolicyConfig(max_batch_size=4, max_prefill_tokens=64, block_size=4)
    eng = Engine(ring, ConstantRunner(), EngineConfig(policy=policy, num_blocks=32),
                 IntakeConfig(vocab_size=100, max_model_len=32, eos_ids=()))
    assert ring.get("kv_blocks_total") == 32 and ring.get("kv_blocks_free") == 32
    fe = FrontendPort(ring)
    fe.submit(0, SlotRequest(seq=1, prompt_offset=0, prompt_len=9, output_offset=0, max_tokens=8,
                             ignore_eos=True), np.arange(1, 10, dtype=np.int32))
    eng.step()                                            # prefill: 9 tokens hold 3 blocks of 4
    assert ring.get("kv_blocks_free") == 32 - 3
    while ring.state[0] != SlotState.DECODE_COMPLETED:
        eng.step()
    eng.step()
    assert ring.get("kv_blocks_free") == 32
