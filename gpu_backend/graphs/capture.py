"""CUDA capture of the step graphs, made device-launchable (needs a GPU).

    GraphCache(model on the GPU, BucketTable, KV blocks, device Module)
      one GraphKVPool, one StaticBuffers (largest shape), the StepIO struct in
      device memory, one torch memory pool shared by every capture
    capture(params_addr): for each shape, largest activation first (once more with PyTorch's
      operators should "auto"'s Triton kernels fail to capture):
      torch.cuda.CUDAGraph(keep_graph=True) capturing, on one stream:
        blink_stage_inputs<<<R, 128>>>(params, io, S, C)   (cuLaunchKernel: a kernel node)
        StepFunction.run(shape)                            (PyTorch's kernels, memsets, copies)
        blink_finish_step<<<1, 256>>>(params, io)          (tokens, fence, *done = step_no)
      -> the raw cudaGraph_t: empty nodes removed (their edges re-joined), every
         node checked to be a kernel, memcpy or memset node (device launch allows
         nothing else), then cuGraphInstantiate(DEVICE_LAUNCH) twice (the
         scheduler alternates instances) and cuGraphUpload
    device_table(): the lookup tables and exec handles in device memory ->
      structs.GraphTable for the scheduler's parameter block
    report(): setup time, node counts, the cache's measured memory next to
      plan.MemoryEstimate

What capture needed (docs/cuda.md): keep_graph=True to reach the raw graph
before torch instantiates it; no host syncs or data-dependent shapes in the
step (fixed shapes per graph, in-graph sampling with a hash RNG, padding into
a sink block instead of masking writes); outputs copied into static buffers so
the shared pool can be reused by every graph in any replay order; our own
kernels launched on torch's capture stream so they become nodes of the same
graph; eager warm-up of the largest shapes before capturing (cuBLAS handles
and workspaces, sort temporaries) so nothing lazily initialises inside a capture.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import time

import numpy as np
import torch

from ..cuda import structs
from ..cuda.driver import CudaError, bindings, check
from ..model.llama import LlamaModel
from .buckets import BucketTable, GraphShape
from .plan import CapturePlan
from . import fused_forward
from .step import GraphKVPool, KVShape, StaticBuffers, StepFunction

log = logging.getLogger("blink.gpu_daemon")

STAGE_THREADS = 128
FINISH_THREADS = 256


class CaptureError(RuntimeError):
    """A captured graph cannot be launched from the device; str() names the nodes."""


def _node_type_name(t) -> str:
    return getattr(t, "name", str(t)).removeprefix("CU_GRAPH_NODE_TYPE_")


def graph_nodes(graph) -> list:
    d = bindings()
    res = d.cuGraphGetNodes(graph, 0)
    check((res[0],), "cuGraphGetNodes(count)")
    n = res[-1]
    res = d.cuGraphGetNodes(graph, n)
    check((res[0],), "cuGraphGetNodes")
    return list(res[1])[:n]


def node_types(graph) -> dict[str, int]:
    d = bindings()
    counts: dict[str, int] = {}
    for node in graph_nodes(graph):
        name = _node_type_name(check(d.cuGraphNodeGetType(node), "cuGraphNodeGetType"))
        counts[name] = counts.get(name, 0) + 1
    return counts


def _neighbours(fn, node) -> list:
    """Dependencies or dependents of a node (cuda-bindings 12 returns 3 values, 13 adds edge data)."""
    res = fn(node, 0)
    check((res[0],), fn.__name__)
    n = res[-1]
    if n == 0:
        return []
    res = fn(node, n)
    check((res[0],), fn.__name__)
    return list(res[1])[:n]


def _add_edge(graph, src, dst) -> None:
    d = bindings()
    try:
        res = d.cuGraphAddDependencies(graph, [src], [dst], None, 1)      # cuda-bindings 13: edge data
    except TypeError:
        res = d.cuGraphAddDependencies(graph, [src], [dst], 1)            # cuda-bindings 12
    check(res if isinstance(res, tuple) else (res,), "cuGraphAddDependencies")


def strip_empty_nodes(graph) -> int:
    """Remove EMPTY nodes (stream joins leave them), connecting each one's dependencies to
    its dependents so the order is kept. Returns how many were removed."""
    d = bindings()
    empty = d.CUgraphNodeType.CU_GRAPH_NODE_TYPE_EMPTY
    removed = 0
    for node in graph_nodes(graph):
        if check(d.cuGraphNodeGetType(node), "cuGraphNodeGetType") != empty:
            continue
        before = _neighbours(d.cuGraphNodeGetDependencies, node)
        after = _neighbours(d.cuGraphNodeGetDependentNodes, node)
        for a in before:
            for b in after:
                _add_edge(graph, a, b)
        check(d.cuGraphDestroyNode(node), "cuGraphDestroyNode(empty)")
        removed += 1
    return removed


def check_device_launchable(graph) -> dict[str, int]:
    """Node type counts; CaptureError unless every node is a kernel, memcpy or memset node."""
    counts = node_types(graph)
    bad = {k: v for k, v in counts.items() if k not in ("KERNEL", "MEMCPY", "MEMSET")}
    if bad:
        raise CaptureError(f"graph has nodes device launch does not allow: {bad} (all: {counts})")
    return counts


@dataclasses.dataclass
class CapturedGraph:
    shape: GraphShape
    torch_graph: object           # torch.cuda.CUDAGraph (owns the raw graph)
    raw: object                   # CUgraph
    execs: list                   # CUgraphExec per instance
    nodes: dict[str, int]
    empty_removed: int
    capture_s: float
    instantiate_s: float


class GraphCache:
    def __init__(self, model: LlamaModel, table: BucketTable, num_blocks: int, module, instances: int = 2,
                 kernels: str = "auto"):
        """model: on the GPU, in eval mode; module: gpu_backend.cuda.runtime.Module (staging kernels);
        kernels: the step's forward (fused_forward.KERNELS; "auto": the Triton kernels where they apply)."""
        d = bindings()
        if instances != structs.STEP_GRAPHS:
            raise ValueError(f"the scheduler alternates {structs.STEP_GRAPHS} instances per graph, not {instances}")
        self.model, self.table, self.module, self.instances = model, table, module, instances
        for name in ("blink_stage_inputs", "blink_finish_step"):
            module.function(name)          # looked up now: no driver calls but launches inside a capture
        cfg = model.config
        self.plan = CapturePlan(table, cfg, dtype_bytes=torch.finfo(model.dtype).bits // 8)
        bs = table.config.block_size
        self.pool = GraphKVPool(KVShape.of(cfg, num_blocks, bs), model.dtype, model.device)
        self.buffers = StaticBuffers(self.plan.static_sizes(), model.device)
        self.step = StepFunction(model, self.pool, self.buffers, self.plan, kernels=kernels)
        self.kernels_requested, self.kernels_fallback = kernels, None
        if kernels == "auto" and self.step.kernels == "torch":     # why "auto" did not take the Triton kernels
            self.kernels_fallback = fused_forward.supported(model) or fused_forward.self_test(model.device, model.dtype)
        log.info("step graphs: %s kernels in the model's forward (prefill steps: %s)", self.step.kernels,
                 self.step.prefill_kernels)
        self.io = self.buffers.io(bs, self.pool.sink_block)
        self.io_addr = int(check(d.cuMemAlloc(ctypes.sizeof(self.io)), "cuMemAlloc(step io)"))
        check(d.cuMemcpyHtoD(self.io_addr, ctypes.addressof(self.io), ctypes.sizeof(self.io)), "cuMemcpyHtoD(step io)")
        self.stream = torch.cuda.Stream()
        self.mempool = torch.cuda.graph_pool_handle()
        self.graphs: list[CapturedGraph | None] = [None] * len(table.shapes)
        self._tables: dict[str, int] = {}
        self._arrays = table.device_arrays()
        self.timing: dict[str, float] = {}
        self.memory: dict[str, int] = {}

    @staticmethod
    def _free_bytes() -> int:
        free, _ = check(bindings().cuMemGetInfo(), "cuMemGetInfo")
        return int(free)

    # -- capture ----------------------------------------------------------------------
    def _pad_inputs(self) -> None:
        """Inputs that touch only the sink block (for eager warm-up runs)."""
        b, bs = self.buffers, self.table.config.block_size
        b.input_ids.zero_()
        b.positions.zero_()
        b.slot_mapping.copy_(self.pool.sink_block * bs + torch.arange(b.slot_mapping.numel(), device=b.slot_mapping.device) % bs)
        b.block_tables.fill_(self.pool.sink_block)
        b.q_lens.zero_()
        b.temperature.fill_(1.0)                 # the sampling path too, not only argmax
        b.top_p.fill_(0.9)
        b.top_k.fill_(0)
        b.lp_want.fill_(1)                       # the logprobs' walk too

    def warm_up(self) -> None:
        """Run the largest shape of each kind eagerly on the capture stream, so lazy
        initialisation (cuBLAS handles and workspaces, sort temporaries) happens outside capture;
        with the Triton kernels also a decode shape whose attention is split along the context, if
        any is (its two kernels compile and load here, never first inside a capture)."""
        kinds = {}
        for g in self.table.shapes:
            if g.kind not in kinds or self.plan.activation_bytes(g) > self.plan.activation_bytes(kinds[g.kind]):
                kinds[g.kind] = g
        warm = list(kinds.values())
        if self.step.kernels == "triton":
            device, bs = self.pool.k.device, self.table.config.block_size
            warm += [g for g in self.table.shapes if g.len == 1 and
                     fused_forward.decode_splits(g.rows, g.ctx, self.model, device, bs) > 1][:1]
        with torch.cuda.stream(self.stream):
            self._pad_inputs()
            for g in [*warm, *warm]:
                self.step.run(g)
        self.stream.synchronize()
        torch.cuda.empty_cache()           # the warm-up's activations are not part of the graph cache

    def capture(self, params_addr: int) -> None:
        """Capture, check, instantiate for device launch (twice) and upload every graph; the
        staging and finish kernels read the parameter block at params_addr. Where "auto" took the
        Triton kernels and capturing them fails (a node the device cannot launch, a compile or
        launch error), the graphs are captured again with PyTorch's operators, the reason logged
        and reported (`kernels_fallback`): the step is slower, the executor still serves."""
        try:
            self._capture(params_addr)
        except Exception as e:      # noqa: BLE001 - retried once with the other kernels, else raised
            if self.kernels_requested != "auto" or self.step.kernels != "triton":
                raise
            why = fused_forward.failure(e)
            log.warning("step graphs: capturing the Triton kernels failed (%s); capturing PyTorch's operators", why)
            self._release_graphs()
            torch.cuda.synchronize()
            self.step = StepFunction(self.model, self.pool, self.buffers, self.plan, kernels="torch")
            self.kernels_fallback = why
            self._capture(params_addr)

    def _release_graphs(self) -> None:
        d = bindings()
        for g in self.graphs:
            if g is None:
                continue
            for exe in g.execs:
                check(d.cuGraphExecDestroy(exe), "cuGraphExecDestroy")
            g.torch_graph.reset()
        self.graphs = [None] * len(self.table.shapes)

    def _capture(self, params_addr: int) -> None:
        d = bindings()
        t0 = time.monotonic()
        self.warm_up()
        t_warm = time.monotonic()
        flag = int(d.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH)
        from ..cuda.runtime import KernelArgs
        finish_args = KernelArgs(params_addr, self.io_addr)
        torch.cuda.synchronize()
        free_before, reserved_before = self._free_bytes(), torch.cuda.memory_reserved()
        for gid in self.plan.capture_order():
            shape = self.table.shapes[gid]
            stage_args = KernelArgs(params_addr, self.io_addr, shape.len, shape.ctx)
            tg = torch.cuda.CUDAGraph(keep_graph=True)
            t1 = time.monotonic()
            with torch.cuda.graph(tg, pool=self.mempool, stream=self.stream, capture_error_mode="thread_local"):
                cs = d.CUstream(torch.cuda.current_stream().cuda_stream)
                self.module.launch("blink_stage_inputs", cs, stage_args, grid=shape.rows, block=STAGE_THREADS)
                self.step.run(shape)
                self.module.launch("blink_finish_step", cs, finish_args, grid=1, block=FINISH_THREADS)
            t2 = time.monotonic()
            raw = d.CUgraph(tg.raw_cuda_graph())
            removed = strip_empty_nodes(raw)
            nodes = check_device_launchable(raw)
            execs = []
            for _ in range(self.instances):
                exe = check(d.cuGraphInstantiate(raw, flag), f"cuGraphInstantiate({shape}, device launch)")
                check(d.cuGraphUpload(exe, d.CUstream(self.stream.cuda_stream)), f"cuGraphUpload({shape})")
                execs.append(exe)
            self.graphs[gid] = CapturedGraph(shape, tg, raw, execs, nodes, removed, t2 - t1, time.monotonic() - t2)
        self.stream.synchronize()
        t_end = time.monotonic()
        self.timing = {"warm_up_s": t_warm - t0, "capture_s": sum(g.capture_s for g in self.graphs),
                       "instantiate_s": sum(g.instantiate_s for g in self.graphs), "total_s": t_end - t0}
        torch.cuda.synchronize()
        # device-wide free memory lost to capture + instantiation: the shared capture pool
        # (torch's reserve for it) plus the driver's memory for the instantiated graphs
        lost = free_before - self._free_bytes()
        pool = torch.cuda.memory_reserved() - reserved_before
        self.memory = {"kv_pool_bytes": self.pool.nbytes, "static_bytes": self.buffers.nbytes,
                       "capture_pool_bytes": pool, "instantiated_bytes": lost - pool, "graph_cache_bytes": lost}
        log.info("graph cache: %d graphs captured in %.1f s (%.1f s instantiating), %.0f MiB",
                 len(self.graphs), self.timing["total_s"], self.timing["instantiate_s"],
                 self.memory["graph_cache_bytes"] / 2**20)

    # -- what the scheduler and the host loop use ----------------------------------------
    def exec_handle(self, graph: int, instance: int = 0):
        return self.graphs[graph].execs[instance]

    def device_table(self) -> structs.GraphTable:
        """Exec handles ([n * instances] u64) and lookup tables in device memory."""
        d = bindings()
        if not self._tables:
            execs = np.array([int(e) for g in self.graphs for e in g.execs], np.uint64)
            for name, arr in (("execs", execs), *self._arrays.items()):
                addr = int(check(d.cuMemAlloc(max(8, arr.nbytes)), f"cuMemAlloc(graph {name})"))
                check(d.cuMemcpyHtoD(addr, arr.ctypes.data, arr.nbytes), f"cuMemcpyHtoD(graph {name})")
                self._tables[name] = addr
        t = self._tables
        return self.table.graph_table(t["execs"], t["shapes"], t["prefill"], t["decode"])

    def report(self) -> dict:
        est = self.plan.memory_estimate()
        nodes = [sum(g.nodes.values()) for g in self.graphs if g is not None]
        return {"buckets": self.table.describe(), "kernels": self.step.kernels,
                "prefill_kernels": self.step.prefill_kernels, "kernels_fallback": self.kernels_fallback,
                "timing": self.timing, "memory": self.memory,
                "estimate": est.as_dict(), "nodes_per_graph": {"min": min(nodes), "max": max(nodes)} if nodes else {},
                "node_types": _sum_counts(g.nodes for g in self.graphs if g is not None),
                "empty_nodes_removed": sum(g.empty_removed for g in self.graphs if g is not None)}

    def close(self) -> None:
        d = bindings()
        self._release_graphs()
        for addr in [*self._tables.values(), self.io_addr]:
            if addr:
                try:
                    check(d.cuMemFree(addr), "cuMemFree(graph cache)")
                except CudaError:
                    log.exception("freeing graph cache memory")
        self._tables, self.io_addr = {}, 0


def _sum_counts(dicts) -> dict[str, int]:
    out: dict[str, int] = {}
    for dd in dicts:
        for k, v in dd.items():
            out[k] = out.get(k, 0) + v
    return out
