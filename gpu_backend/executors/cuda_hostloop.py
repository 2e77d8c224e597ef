"""The host-loop CUDA executor (`--executor cuda-hostloop`): the baseline every
GPU number is compared with. The same step graphs as `cuda`, launched by the
host each step, with the batch reassembled on the host, as mainstream stacks
do (paper Fig. 3).

    __init__: check the GPU, build the device module; with a model: load it onto
        the GPU, size it exactly as the cuda executor does (graphs/config.py),
        capture the same graphs against the host loop's parameter block
        (graphs/device.CudaLauncher); --model null: the stand-in echo graph
    serve(ring, stop): register the shm ring for the device -> Engine
        (gpu_backend/engine.py: intake, policy, KV BlockAllocator, publishing on
        the host) with HostLoopRunner (graphs/hostloop.py): per step the host
        picks the graph, writes the rows, request copies and block tables,
        copies them to the device, launches, copies the tokens back and waits
"""
from __future__ import annotations

import json
import logging
import threading
import time

from shared_layout import Ring

from ..cuda import build, driver
from ..scheduler.policy import PolicyConfig, blocks_needed
from . import ExecutorOptions

log = logging.getLogger("blink.gpu_daemon")

NULL_VOCAB_SIZE = 49152
NULL_MAX_MODEL_LEN = 8192
NULL_MAX_BATCH_SIZE = 256
NULL_MAX_PREFILL_TOKENS = 1 << 20


def unavailable_reason() -> str | None:
    """The cuda executor's check: a usable GPU and nvcc for the staging kernels."""
    why = driver.unavailable_reason()
    if why is not None:
        return why
    if build.find_nvcc() is None:
        return "nvcc not found (set BLINK_NVCC or CUDA_HOME) to build the step kernels"
    return None


class CudaHostLoopExecutor:
    name = "cuda-hostloop"

    def __init__(self, options: ExecutorOptions):
        from ..cuda.driver import bindings, check
        from ..cuda.runtime import Module, PinnedMapped
        from ..graphs.device import CudaLauncher
        from ..graphs.hostloop import StepBlock
        t0 = time.monotonic()
        self.options = options
        self.device = driver.open_device(0)
        self.module = Module(build.build_device_module())
        d = bindings()
        self.cache = None
        if options.model == "null":
            self.table = None
            self.vocab_size, self.eos_ids = NULL_VOCAB_SIZE, ()
            self.max_model_len = min(options.max_model_len or NULL_MAX_MODEL_LEN, NULL_MAX_MODEL_LEN)
            bs = options.block_size
            self.policy = PolicyConfig(options.max_batch_size or NULL_MAX_BATCH_SIZE,
                                       options.max_prefill_tokens or NULL_MAX_PREFILL_TOKENS, bs)
            self.num_blocks = self.policy.max_batch_size * blocks_needed(self.max_model_len, bs)  # bookkeeping only
            max_rows, max_blocks = 0, 1
        else:
            import torch

            from ..graphs.buckets import BucketTable
            from ..graphs.capture import GraphCache
            from ..graphs.config import GraphExecConfig, graph_dtype
            from ..graphs.device import load_graph_model
            torch.cuda.set_device(self.device.ordinal)
            dtype = graph_dtype(options.dtype)
            model_config, model = load_graph_model(options.model, dtype)
            g = GraphExecConfig.from_options(options, model_config, dtype)
            g.apply_blas()
            self.vocab_size, self.max_model_len = model_config.vocab_size, g.max_model_len
            self.eos_ids = tuple(model_config.eos_token_ids)
            self.policy, self.num_blocks = g.policy, g.num_blocks
            self.table = BucketTable(g.buckets)
            self.device.make_current()
            self.cache = GraphCache(model, self.table, g.num_blocks, self.module, kernels=g.kernels)
            max_rows, max_blocks = self.table.max_rows, blocks_needed(g.max_model_len, g.policy.block_size)
        t_model = time.monotonic()
        self.device.make_current()
        self.stream = check(d.cuStreamCreate(int(d.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate")
        _, nbytes = StepBlock.layout_of(self.policy.max_batch_size, max_rows, max_blocks)
        self.pinned = PinnedMapped(nbytes)                                 # the host side of every step copy
        self.block = StepBlock(self.policy.max_batch_size, max_rows, max_blocks, host_addr=self.pinned.host_addr)
        self.device_block = int(check(d.cuMemAlloc(self.block.nbytes), "cuMemAlloc(host-loop block)"))
        check(d.cuMemsetD8(self.device_block, 0, self.block.nbytes), "cuMemsetD8(host-loop block)")
        self.launcher = CudaLauncher(self.cache, self.module, self.block, self.device_block, self.stream)
        self.setup_report = {"model_load_s": t_model - t0, "setup_s": time.monotonic() - t0,
                             "graphs": self.cache.report() if self.cache is not None else {}}
        log.info("cuda-hostloop executor on %s: setup %.1f s", self.device.name, self.setup_report["setup_s"])
        log.info("graph cache report %s", json.dumps(self.setup_report))   # bench/cuda_graphs.py reads this line

    def serve(self, ring: Ring, stop: threading.Event) -> None:
        from ..cuda.device_ring import HostMappedRing
        from ..engine import Engine, EngineConfig
        from ..graphs.hostloop import HostLoopRunner
        from ..scheduler.intake import IntakeConfig
        self.device.make_current()          # this thread makes every step's CUDA calls
        mapped = HostMappedRing(ring)
        try:
            self.launcher.bind(ring, mapped.device_addr)
            runner = HostLoopRunner(ring, self.block, self.launcher, self.table)
            engine = Engine(ring, runner, EngineConfig(self.options.sched(self.policy), self.num_blocks,
                                                       shutdown_grace_s=self.options.shutdown_grace_s,
                                   prefix_caching=self.options.prefix_caching,
                                   doorbell=self.options.doorbell),
                            self.options.slo(IntakeConfig(self.vocab_size, self.max_model_len, self.eos_ids,
                                                          structured_outputs=False, prompt_logprobs=False)),
                            scenario=self.options.scenario(self.policy))
            try:
                engine.serve(stop)
            finally:
                self.options.save_scenario(engine.scheduler.scenario)
                log.info("host loop: %d steps", engine.steps)
        finally:
            from ..cuda.driver import bindings
            bindings().cuStreamSynchronize(self.stream)
            mapped.close()

    def close(self) -> None:
        from ..cuda.driver import bindings, check
        d = bindings()
        if self.launcher is not None:
            self.launcher.close()
            self.launcher = None
        if self.cache is not None:
            self.cache.close()
            self.cache = None
        if self.device_block:
            check(d.cuMemFree(self.device_block), "cuMemFree(host-loop block)")
            self.device_block = 0
        self.pinned.close()
