"""One-time setup of the persistent scheduler through cuda-python, then hands off.

    build.build_device_module() -> cuModuleLoadData -> kernels
    device buffers (cuMemAlloc, zeroed) + control block (cuMemHostAlloc DEVICEMAP)
    step graphs from a StepGraphSource: EchoGraphs (the stand-in: one
        blink_echo_step node, two instances) or the captured model graphs
        (gpu_backend/graphs/device.py), instantiated for device launch, uploaded,
        with their lookup tables in device memory
    clock probe: device %globaltimer -> offset to the host's CLOCK_MONOTONIC
    SchedParams -> device memory
    scheduler graph: one blink_scheduler node (1 x 256), instantiated for device
        launch, uploaded, launched once on a non-blocking stream
  then the host only reads control (heartbeat, counters) and, to stop, writes
  control.stop / control.abort and waits for the stream to drain.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import time
from typing import Protocol

import numpy as np

from shared_layout import RingGeometry

from . import build, structs
from .config import DEVICE_LAUNCH_LIMIT, SchedulerConfig
from .driver import CudaError, Device, bindings, check

log = logging.getLogger(__name__)

SCHEDULER_THREADS = 256       # one block (paper §4.2)
STEP_THREADS = 256


class KernelArgs:
    """A kernel's argument list as the driver wants it: an array of pointers to the values."""

    def __init__(self, *values: int):
        self.values = np.array(values, dtype=np.uint64)                      # [n] the arguments (all 8-byte)
        self.pointers = np.array([self.values.ctypes.data + 8 * i for i in range(len(values))], dtype=np.uint64)

    @property
    def address(self) -> int:
        return self.pointers.ctypes.data


class Module:
    """The device module (cubin) and its kernels."""

    def __init__(self, cubin_path=None):
        d = bindings()
        image = np.frombuffer((cubin_path or build.build_device_module()).read_bytes(), np.uint8)
        self.module = check(d.cuModuleLoadData(image.ctypes.data), "cuModuleLoadData(blink_sched.cubin)")
        self._functions: dict[str, object] = {}

    def function(self, name: str):
        if name not in self._functions:
            self._functions[name] = check(bindings().cuModuleGetFunction(self.module, name.encode()),
                                          f"cuModuleGetFunction({name})")
        return self._functions[name]

    def launch(self, name: str, stream, args: KernelArgs, grid: int = 1, block: int = 1) -> None:
        check(bindings().cuLaunchKernel(self.function(name), grid, 1, 1, block, 1, 1, 0, stream, args.address, 0),
              f"cuLaunchKernel({name})")

    def device_graph(self, name: str, stream, args: KernelArgs, grid: int = 1, block: int = 1):
        """A one-kernel graph instantiated for device launch and uploaded: (graph, exec)."""
        d = bindings()
        graph = check(d.cuGraphCreate(0), "cuGraphCreate")
        node = d.CUDA_KERNEL_NODE_PARAMS()
        node.func = self.function(name)
        node.gridDimX, node.gridDimY, node.gridDimZ = grid, 1, 1
        node.blockDimX, node.blockDimY, node.blockDimZ = block, 1, 1
        node.sharedMemBytes = 0
        node.kernelParams = args.address
        check(d.cuGraphAddKernelNode(graph, None, 0, node), f"cuGraphAddKernelNode({name})")
        flag = int(d.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH)
        exe = check(d.cuGraphInstantiate(graph, flag), f"cuGraphInstantiate({name}, device launch)")
        check(d.cuGraphUpload(exe, stream), f"cuGraphUpload({name})")
        return graph, exe

    def close(self) -> None:
        check(bindings().cuModuleUnload(self.module), "cuModuleUnload")


class PinnedMapped:
    """Page-locked host memory the device can address (cuMemHostAlloc DEVICEMAP)."""

    def __init__(self, nbytes: int):
        d = bindings()
        self.nbytes = nbytes
        self.host_addr = int(check(d.cuMemHostAlloc(nbytes, d.CU_MEMHOSTALLOC_DEVICEMAP), "cuMemHostAlloc"))
        ctypes.memset(self.host_addr, 0, nbytes)
        self.device_addr = int(check(d.cuMemHostGetDevicePointer(self.host_addr, 0), "cuMemHostGetDevicePointer"))

    def close(self) -> None:
        if self.host_addr:
            check(bindings().cuMemFreeHost(self.host_addr), "cuMemFreeHost")
            self.host_addr = 0


def calibrate_clock(module: Module, stream, samples: int = 9) -> int:
    """Offset that puts device %globaltimer readings on the host's CLOCK_MONOTONIC (ns)."""
    d = bindings()
    out = PinnedMapped(8)
    try:
        args = KernelArgs(out.device_addr)
        best = None
        for _ in range(samples):
            t0 = time.monotonic_ns()
            module.launch("blink_clock_probe", stream, args)
            check(d.cuStreamSynchronize(stream), "cuStreamSynchronize(clock probe)")
            t1 = time.monotonic_ns()
            gt = ctypes.c_uint64.from_address(out.host_addr).value
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, (t0 + t1) // 2 - gt)
        return best[1]
    finally:
        out.close()


class StepGraphSource(Protocol):
    """What the scheduler launches each step."""
    max_rows: int          # rows of the largest graph (sizes the row buffers); 0: no rows

    def build(self, rt: "SchedulerRuntime") -> structs.GraphTable:
        """Make the graphs for rt.params_addr (their kernels read that parameter block),
        instantiated for device launch and uploaded; the table's arrays in device memory."""
        ...

    def close(self) -> None:
        ...


class EchoGraphs:
    """The stand-in step graph (the null model's echo), two instances launched alternately."""
    max_rows = 0

    def __init__(self):
        self.graphs: list = []
        self.execs_addr = 0

    def build(self, rt: "SchedulerRuntime") -> structs.GraphTable:
        d = bindings()
        self.graphs = [rt.module.device_graph("blink_echo_step", rt.stream, rt.kernel_args, block=STEP_THREADS)
                       for _ in range(structs.STEP_GRAPHS)]
        execs = np.array([int(exe) for _, exe in self.graphs], np.uint64)
        self.execs_addr = int(check(d.cuMemAlloc(execs.nbytes), "cuMemAlloc(step graph execs)"))
        check(d.cuMemcpyHtoD(self.execs_addr, execs.ctypes.data, execs.nbytes), "cuMemcpyHtoD(step graph execs)")
        return structs.GraphTable(execs=self.execs_addr, shapes=0, n_graphs=1)

    def close(self) -> None:
        d = bindings()
        for graph, exe in self.graphs:
            check(d.cuGraphExecDestroy(exe), "cuGraphExecDestroy")
            check(d.cuGraphDestroy(graph), "cuGraphDestroy")
        self.graphs = []
        if self.execs_addr:
            check(d.cuMemFree(self.execs_addr), "cuMemFree(step graph execs)")
            self.execs_addr = 0


@dataclasses.dataclass
class SchedulerStats:
    running: bool
    exit_code: int
    counters: dict[str, int]


class SchedulerRuntime:
    """The persistent scheduler on one device over a ring at `ring_device_addr`."""

    def __init__(self, device: Device, config: SchedulerConfig, geometry: RingGeometry, ring_device_addr: int,
                 module: Module | None = None, graphs: StepGraphSource | None = None, params_addr: int = 0):
        """`params_addr`: device memory for the parameter block, allocated by the caller (the model
        graphs were captured reading it before the ring existed); 0: allocated and freed here."""
        d = bindings()
        device.make_current()
        log.info("%s: host-native atomics %d (cudaDevAttrHostNativeAtomicSupported; the ring protocol uses "
                 "none: one writer per word, fences), launch window %d of %d", device.name,
                 device.host_native_atomics, config.window_limit, DEVICE_LAUNCH_LIMIT)
        self.device, self.config, self.geometry = device, config, geometry
        self.module = module or Module()
        self._own_module = module is None
        self.graphs = graphs if graphs is not None else EchoGraphs()
        self.stream = check(d.cuStreamCreate(int(d.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate")
        self.buffers: dict[str, int] = {}
        for name, nbytes in config.buffer_sizes(geometry.slot_count, self.graphs.max_rows).items():
            addr = int(check(d.cuMemAlloc(nbytes), f"cuMemAlloc({name})"))
            check(d.cuMemsetD8(addr, 0, nbytes), f"cuMemsetD8({name})")
            self.buffers[name] = addr
        self.control_mem = PinnedMapped(ctypes.sizeof(structs.SchedControl))
        self.control = structs.SchedControl.from_address(self.control_mem.host_addr)
        self._own_params = params_addr == 0
        self.params_addr = params_addr or int(check(d.cuMemAlloc(ctypes.sizeof(structs.SchedParams)),
                                                    "cuMemAlloc(params)"))
        self.kernel_args = KernelArgs(self.params_addr)
        self.ring_device_addr = ring_device_addr
        table = self.graphs.build(self)
        self.clock_offset_ns = calibrate_clock(self.module, self.stream)
        self.params = config.params(geometry, ring_device_addr, self.buffers, self.control_mem.device_addr,
                                    table, self.clock_offset_ns)
        check(d.cuMemcpyHtoD(self.params_addr, ctypes.addressof(self.params), ctypes.sizeof(self.params)),
              "cuMemcpyHtoD(params)")
        # shared_state: the loop's own kernel over copies in shared memory (scheduler.cu)
        kernel = "blink_scheduler_shared" if self.config.shared_state else "blink_scheduler"
        self.sched_graph = self.module.device_graph(kernel, self.stream, self.kernel_args, block=SCHEDULER_THREADS)
        check(d.cuStreamSynchronize(self.stream), "cuStreamSynchronize(setup)")
        self.started = False

    def start(self) -> None:
        """Launch the scheduler graph; from here on the device runs on its own."""
        check(bindings().cuGraphLaunch(self.sched_graph[1], self.stream), "cuGraphLaunch(scheduler)")
        self.started = True

    def running(self) -> bool:
        """True while the scheduler (or a tail-launched successor, or a step graph) runs."""
        d = bindings()
        err, = d.cuStreamQuery(self.stream)
        if err == d.CUresult.CUDA_ERROR_NOT_READY:
            return True
        check((err,), "scheduler stream")
        return False

    def request_stop(self, abort: bool = False) -> None:
        """Drain (no new claims, in-flight work within the grace period), or abort everything now."""
        if abort:
            self.control.abort = 1
        self.control.stop = 1

    def wait(self, timeout_s: float) -> bool:
        """Wait for the scheduler to exit; False if it still runs after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.running():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def stats(self) -> SchedulerStats:
        c = self.control
        counters = {k: int(getattr(c, k)) for k in (*structs.COUNTERS, "max_window_launches")}
        return SchedulerStats(bool(c.running), int(c.exit_code), counters)

    def read_buffer(self, name: str, dtype=np.uint32) -> np.ndarray:
        """A copy of one of the scheduler's device buffers (tests and diagnostics; the scheduler has
        exited, or the copy races it)."""
        nbytes = self.config.buffer_sizes(self.geometry.slot_count, self.graphs.max_rows)[name]
        out = np.zeros(nbytes // np.dtype(dtype).itemsize, dtype)
        check(bindings().cuMemcpyDtoH(out.ctypes.data, self.buffers[name], out.nbytes), f"cuMemcpyDtoH({name})")
        return out

    def read_state(self) -> structs.SchedState:
        st = structs.SchedState()
        check(bindings().cuMemcpyDtoH(ctypes.addressof(st), self.buffers["state"], ctypes.sizeof(st)),
              "cuMemcpyDtoH(state)")
        return st

    def close(self) -> None:
        """Free everything; the scheduler must have exited (wait() returned True)."""
        d = bindings()
        if self.started and self.running():
            raise CudaError("the scheduler still runs; stop it before closing")
        graph, exe = self.sched_graph
        check(d.cuGraphExecDestroy(exe), "cuGraphExecDestroy")
        check(d.cuGraphDestroy(graph), "cuGraphDestroy")
        self.graphs.close()
        for addr in [*self.buffers.values(), *([self.params_addr] if self._own_params else [])]:
            check(d.cuMemFree(addr), "cuMemFree")
        self.buffers = {}
        self.control_mem.close()
        check(d.cuStreamDestroy(self.stream), "cuStreamDestroy")
        if self._own_module:
            self.module.close()
