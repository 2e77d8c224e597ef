"""The null executor: the full engine (intake, policy, KV bookkeeping, ring
publishing) with no model. Output token i of a request is prompt[i % prompt_len]
(an echo), so the control plane and the frontend can be measured and tested
without compute.

    ring -> Engine (engine.py) -> EchoRunner.run (no tensors; with --step-ms it
        returns no sooner than step_ms after it was called, like a model's step) -> tokens -> ring

step_ms = 0 (the default) publishes as fast as the engine loop goes: the frontend's
throughput at saturation. step_ms = 20 is a realistic decode cadence (50 tokens/s per
stream, SmolLM2-135M on a small CPU), at which per-token latency means something.
"""
from __future__ import annotations

import threading
import time

from shared_layout import Ring

from ..engine import Engine, EngineConfig
from ..scheduler import StepBatch
from ..scheduler.intake import IntakeConfig
from ..scheduler.policy import PolicyConfig, blocks_needed
from . import ExecutorOptions

NULL_VOCAB_SIZE = 49152
NULL_MAX_MODEL_LEN = 8192
DEFAULT_MAX_BATCH_SIZE = 256
DEFAULT_MAX_PREFILL_TOKENS = 1 << 20


class EchoRunner:
    """Runner with no compute: the next token echoes the prompt. `step_s` > 0: each step
    (prefill or decode, any batch size) takes at least that long, slept off after the echo."""

    def __init__(self, step_s: float = 0.0):
        if not step_s >= 0:
            raise ValueError(f"step time must be >= 0, got {step_s}")
        self.step_s = step_s

    def run(self, batch: StepBatch) -> list[int]:
        t0 = time.perf_counter() if self.step_s else 0.0
        tokens = [c.seq.prompt[len(c.seq.output) % len(c.seq.prompt)] for c in batch.chunks if c.sample]
        if self.step_s:
            _sleep_until(t0 + self.step_s)
        return tokens


def _sleep_until(t_end: float) -> None:
    """Sleep until perf_counter() >= t_end: time.sleep for the bulk, then a short spin for the
    last ~0.2 ms (a sleep overshoots by tens of microseconds)."""
    while True:
        left = t_end - time.perf_counter()
        if left <= 0:
            return
        if left > 300e-6:
            time.sleep(left - 200e-6)


class NullExecutor:
    name = "null"

    def __init__(self, options: ExecutorOptions):
        self.vocab_size = NULL_VOCAB_SIZE
        self.max_model_len = min(options.max_model_len or NULL_MAX_MODEL_LEN, NULL_MAX_MODEL_LEN)
        self.options = options
        bs = options.block_size
        max_batch = options.max_batch_size or DEFAULT_MAX_BATCH_SIZE
        self.policy = options.sched(PolicyConfig(
            max_batch_size=max_batch, max_prefill_tokens=options.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS,
            block_size=bs))
        # Bookkeeping only (no tensors): room for a full context in every seat.
        self.num_blocks = max_batch * blocks_needed(self.max_model_len, bs)

    def serve(self, ring: Ring, stop: threading.Event) -> None:
        engine = Engine(ring, EchoRunner(self.options.step_ms / 1e3),
                        EngineConfig(self.policy, self.num_blocks, shutdown_grace_s=self.options.shutdown_grace_s,
                                   prefix_caching=self.options.prefix_caching,
                                   doorbell=self.options.doorbell),
                        self.options.slo(IntakeConfig(self.vocab_size, self.max_model_len, eos_ids=())),
                        scenario=self.options.scenario(self.policy))
        try:
            engine.serve(stop)
        finally:
            self.options.save_scenario(engine.scheduler.scenario)

    def close(self) -> None:
        pass
