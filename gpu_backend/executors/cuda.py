"""The CUDA executor: the persistent GPU scheduler serves the ring; the host
process only sets it up and then watches.

    __init__: check the GPU (cc >= 9.0, driver, cuda-python), build the device
        module with nvcc (cached); with a model: load it onto the GPU, size the
        KV pool and the graph cache (graphs/config.py), capture every step graph
        for device launch against the parameter block (graphs/device.py) -> the
        daemon publishes vocab / max_len, READY
    serve(ring, stop): register the shm ring for the device (host-mapped) ->
        SchedulerRuntime (buffers, the KV allocator, the step graphs' tables, the
        scheduler graph for device launch) -> start -> watch the device heartbeat
        until `stop` -> control.stop (drain within the grace period) -> wait -> close

`--model null` launches the stand-in echo graph (output token i =
prompt[i % prompt_len]) under the same scheduler.
"""
from __future__ import annotations

import ctypes
import json
import logging
import threading
import time

from shared_layout import Ring

from ..cuda import build, driver, structs
from ..cuda.config import SchedulerConfig, scheduling_fields
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
        self.options = options
        self.device = driver.open_device(0)
        from ..cuda.runtime import Module   # cuda-python is known to import by now
        self.module = Module(build.build_device_module())
        self.graphs = None
        self.params_addr = 0
        if options.model == "null":
            self.vocab_size = NULL_VOCAB_SIZE
            self.max_model_len = min(options.max_model_len or NULL_MAX_MODEL_LEN, NULL_MAX_MODEL_LEN)
            self.config = SchedulerConfig(
                max_batch_size=options.max_batch_size or DEFAULT_MAX_BATCH_SIZE,
                max_prefill_tokens=options.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS,
                block_size=options.block_size, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                grace_s=options.shutdown_grace_s, **scheduling_fields(options))
        else:
            self._setup_model(options)
        log.info("cuda executor on %s (cc %d.%d, %d SMs), scheduler module built", self.device.name,
                 *self.device.compute_capability, self.device.multiprocessors)

    def _setup_model(self, options: ExecutorOptions) -> None:
        import torch

        from ..cuda.driver import bindings, check
        from ..graphs.buckets import BucketTable
        from ..graphs.config import GraphExecConfig, graph_dtype
        from ..graphs.device import ModelGraphs, load_graph_model
        t0 = time.monotonic()
        torch.cuda.set_device(self.device.ordinal)        # torch on the primary context the driver API uses
        dtype = graph_dtype(options.dtype)
        model_config, model = load_graph_model(options.model, dtype)
        g = GraphExecConfig.from_options(options, model_config, dtype)
        g.apply_blas()
        self.vocab_size, self.max_model_len = model_config.vocab_size, g.max_model_len
        self.config = SchedulerConfig(
            max_batch_size=g.policy.max_batch_size, max_prefill_tokens=g.policy.max_prefill_tokens,
            block_size=g.policy.block_size, num_blocks=g.num_blocks, max_model_len=g.max_model_len,
            vocab_size=model_config.vocab_size, eos_ids=tuple(model_config.eos_token_ids)[:structs.MAX_EOS_IDS],
            grace_s=options.shutdown_grace_s, **scheduling_fields(options))
        t_model = time.monotonic()
        self.device.make_current()
        self.params_addr = int(check(bindings().cuMemAlloc(ctypes.sizeof(structs.SchedParams)), "cuMemAlloc(params)"))
        self.graphs = ModelGraphs(model, BucketTable(g.buckets), g.num_blocks, kernels=g.kernels)
        self.graphs.prepare(self.module, self.params_addr)
        self.setup_report = {"model_load_s": t_model - t0, "graphs": self.graphs.report(),
                             "setup_s": time.monotonic() - t0}
        log.info("cuda executor: model %s, %d KV blocks of %d, context %d, setup %.1f s",
                 options.model, g.num_blocks, g.policy.block_size, g.max_model_len, self.setup_report["setup_s"])
        log.info("graph cache report %s", json.dumps(self.setup_report))   # bench/cuda_graphs.py reads this line

    def serve(self, ring: Ring, stop: threading.Event) -> None:
        from ..cuda.device_ring import HostMappedRing
        from ..cuda.runtime import SchedulerRuntime
        self.device.make_current()
        mapped = HostMappedRing(ring)
        rt = None
        try:
            rt = SchedulerRuntime(self.device, self.config, ring.geom, mapped.device_addr, self.module,
                                  graphs=self.graphs, params_addr=self.params_addr)
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
        if self.params_addr:
            from ..cuda.driver import bindings, check
            if self.graphs is not None:
                self.graphs.close()
            check(bindings().cuMemFree(self.params_addr), "cuMemFree(params)")
            self.params_addr = 0
