"""The CUDA executor: the persistent GPU scheduler serves the ring; the host
process only sets it up and then watches.

    __init__: check the GPU (cc >= 9.0, driver, cuda-python), build the device
        module with nvcc (cached) -> the daemon publishes vocab / max_len, READY
    serve(ring, stop): register the shm ring for the device (host-mapped) ->
        SchedulerRuntime (buffers, step graphs and the scheduler graph for
        device launch) -> start -> watch the device heartbeat until `stop`
        -> control.stop (drain within the grace period) -> wait -> close

This issue's step graph is the stand-in echo (the null model: output token i =
prompt[i % prompt_len]); `--model null` selects it. The model graphs replace
it in the next issue with the same scheduler.
"""
from __future__ import annotations

import logging
import threading
import time

from shared_layout import Ring

from ..cuda import build, driver
from ..cuda.config import SchedulerConfig
from . import ExecutorOptions

log = logging.getLogger("blink.gpu_daemon")

NULL_VOCAB_SIZE = 49152
NULL_MAX_MODEL_LEN = 8192
DEFAULT_MAX_BATCH_SIZE = 256
DEFAULT_MAX_PREFILL_TOKENS = 1 << 20
HEARTBEAT_STALL_S = 10.0      # no device beat for this long while running: the scheduler is stuck


def unavailable_reason() -> str | None:
    """Refines the registry's GPU check: the device module must also be buildable."""
    why = driver.unavailable_reason()
    if why is not None:
        return why
    if build.find_nvcc() is None:
        return "nvcc not found (set BLINK_NVCC or CUDA_HOME) to build the scheduler"
    return None


class CudaExecutor:
    name = "cuda"

    def __init__(self, options: ExecutorOptions):
        if options.model != "null":
            raise ValueError("the CUDA executor serves only the stand-in echo model for now: use --model null")
        self.options = options
        self.vocab_size = NULL_VOCAB_SIZE
        self.max_model_len = min(options.max_model_len or NULL_MAX_MODEL_LEN, NULL_MAX_MODEL_LEN)
        self.config = SchedulerConfig(
            max_batch_size=options.max_batch_size or DEFAULT_MAX_BATCH_SIZE,
            max_prefill_tokens=options.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS,
            block_size=options.block_size, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            grace_s=options.shutdown_grace_s)
        self.device = driver.open_device(0)
        from ..cuda.runtime import Module   # cuda-python is known to import by now
        self.module = Module(build.build_device_module())
        log.info("cuda executor on %s (cc %d.%d, %d SMs), scheduler module built", self.device.name,
                 *self.device.compute_capability, self.device.multiprocessors)

    def serve(self, ring: Ring, stop: threading.Event) -> None:
        from ..cuda.device_ring import HostMappedRing
        from ..cuda.runtime import SchedulerRuntime
        self.device.make_current()
        mapped = HostMappedRing(ring)
        rt = None
        try:
            rt = SchedulerRuntime(self.device, self.config, ring.geom, mapped.device_addr, self.module)
            rt.start()
            log.info("persistent scheduler started (clock offset %d ns)", rt.clock_offset_ns)
            self._watch(rt, stop)
            rt.request_stop()
            if not rt.wait(self.config.grace_s + 5.0):
                log.error("scheduler did not drain in time; aborting what is left")
                rt.request_stop(abort=True)
                if not rt.wait(10.0):
                    raise RuntimeError("the persistent scheduler does not stop")
            s = rt.stats()
            log.info("scheduler exited (%s): %s", s.exit_code, s.counters)
        finally:
            if rt is not None and rt.started and rt.running():   # an error above: end the device side too
                rt.request_stop(abort=True)
                rt.wait(10.0)
            if rt is None or not rt.running():
                if rt is not None:
                    rt.close()
                mapped.close()   # the device no longer touches the ring

    def _watch(self, rt, stop: threading.Event) -> None:
        """Until `stop`: the device beats control.heartbeat; a silent or exited scheduler is an error."""
        last, last_change = -1, time.monotonic()
        while not stop.wait(0.05):
            if not rt.running():
                s = rt.stats()
                raise RuntimeError(f"persistent scheduler exited unexpectedly (exit code {s.exit_code})")
            beat = rt.control.heartbeat
            now = time.monotonic()
            if beat != last:
                last, last_change = beat, now
            elif now - last_change > HEARTBEAT_STALL_S:
                raise RuntimeError(f"persistent scheduler heartbeat stalled for {now - last_change:.1f} s")

    def close(self) -> None:
        pass
