"""The graph cache on the CPU: what a captured step graph does, run eagerly.

    launch(params, graph id):
      blink_twin_stage (csrc/model_step.h via the g++ twin library: the graph's
        first kernel) -> StaticBuffers
      StepFunction.run(shape) (the PyTorch the graph captures) -> tokens
      blink_twin_finish (the graph's last kernel) -> step_tokens, *done = step_no

Used as the launch callback of the scheduler's CPU twin (the persistent loop
with the real model, no GPU) and by the host-loop runner on the CPU, so CI
runs the staging, the lookup tables, the KV allocator and the step function
together against the CPU executor.
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from ..model.llama import LlamaModel
from .buckets import BucketTable
from .plan import CapturePlan
from .step import GraphKVPool, KVShape, StaticBuffers, StepFunction


class CpuGraphs:
    def __init__(self, model: LlamaModel, table: BucketTable, num_blocks: int, kernels: str = "torch"):
        """`num_blocks`: the allocator's pool; the tensors get one more, the padding sink. `kernels`:
        StepFunction's ("triton" here runs the GPU's fused kernels under Triton's interpreter, for tests)."""
        from ..cuda import twin
        self.lib = twin.lib()
        cfg = model.config
        self.model, self.table, self.num_blocks = model, table, num_blocks
        self.plan = CapturePlan(table, cfg, dtype_bytes=torch.finfo(model.dtype).bits // 8)
        bs = table.config.block_size
        self.pool = GraphKVPool(KVShape.of(cfg, num_blocks, bs), model.dtype, model.device)
        self.buffers = StaticBuffers(self.plan.static_sizes(), model.device)
        self.step = StepFunction(model, self.pool, self.buffers, self.plan, kernels=kernels)
        self.io = self.buffers.io(bs, num_blocks)
        self._arrays = table.device_arrays()     # kept alive: the tables point into them
        self.launches = [0] * len(table.shapes)

    @property
    def max_rows(self) -> int:
        return self.table.max_rows

    def graph_table(self):
        """structs.GraphTable over host memory (execs 0: launches go through launch())."""
        a = self._arrays
        return self.table.graph_table(0, a["shapes"].ctypes.data, a["prefill"].ctypes.data, a["decode"].ctypes.data)

    def launch(self, params_addr: int, which: int) -> int:
        """Run graph `which // 2` (instance which % 2) over the parameter block at params_addr."""
        gid = which // 2
        shape = self.table.shapes[gid]
        io = ctypes.byref(self.io)
        self.lib.blink_twin_stage(params_addr, io, shape.rows, shape.len, shape.ctx)
        self.step.run(shape)
        self.lib.blink_twin_finish(params_addr, io)
        self.launches[gid] += 1
        return 0

    def launch_cb(self, params_addr_fn):
        """A TwinScheduler launch callback; params_addr_fn() gives the scheduler's parameter block."""
        def cb(ctx, which) -> int:
            try:
                return self.launch(params_addr_fn(), int(which))
            except Exception:       # a failed step ends its requests, as a failed device launch does
                import logging
                logging.getLogger("blink.gpu_daemon").exception("CPU graph %d failed", which // 2)
                return -1
        return cb

    def tokens(self) -> np.ndarray:
        return self.buffers.tokens.numpy()
