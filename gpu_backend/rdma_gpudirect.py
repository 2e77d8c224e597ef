"""GPUDirect RDMA for a ring in GPU memory: may the NIC write it, and must someone flush?

    query_caps(device) -> GpuDirectCaps -> plan_placement(caps, consumer) -> RingPlacement
    export_dmabuf(dptr, nbytes) -> dma-buf fd -> VerbsPort.register_dmabuf (shared_layout.rdma.device)
    flush_writes(): cuFlushGPUDirectRDMAWrites, where the placement says it is needed

A frontend's RDMA WRITEs reach GPU memory over PCIe. Whether the GPU's own SMs
then observe them in the order they were posted is a device property
(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING). The ring protocol needs
that order: the scheduler reads a slot's payload after it sees the state word.
- ordering OWNER or ALL_DEVICES: the ring may live in GPU memory as is;
- ordering NONE: a consumer on the host can restore the order by calling
  cuFlushGPUDirectRDMAWrites after it sees a state word and before it reads the
  payload (supported when the flush-options attribute has the HOST bit); the
  persistent scheduler reads from the device and cannot, so its ring stays in
  host-mapped memory (PCIe keeps posted writes to host memory in order).
The frontend never uses NIC atomics on the ring (its memory region does not
even allow them): they are not atomic with respect to the SMs' atomics.
`plan_placement` is pure and tested on CPU; the rest needs cuda-python and a GPU.
"""
from __future__ import annotations

import dataclasses
import mmap

ORDERING_NONE = 0           # CU_GPU_DIRECT_RDMA_WRITES_ORDERING_NONE
ORDERING_OWNER = 100        # ..._OWNER: the owning GPU sees writes in order
ORDERING_ALL_DEVICES = 200  # ..._ALL_DEVICES
FLUSH_OPTION_HOST = 1       # CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST
FLUSH_OPTION_MEMOPS = 2     # ..._OPTION_MEMOPS
CONSUMERS = ("device", "host")   # who reads the ring: persistent kernel, or a host loop / CPU


class GpuDirectError(RuntimeError):
    """The GPU cannot take part in RDMA as asked."""


@dataclasses.dataclass(frozen=True)
class GpuDirectCaps:
    rdma_supported: bool       # CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED
    dmabuf_supported: bool     # CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
    write_ordering: int        # CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING
    flush_options: int         # CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS (bit mask)


@dataclasses.dataclass(frozen=True)
class RingPlacement:
    where: str                 # "gpu" (dma-buf MR over device memory) or "host" (host-mapped ring)
    flush_before_read: bool    # consumer calls flush_writes() between a state word and its payload
    reason: str


def plan_placement(caps: GpuDirectCaps, consumer: str) -> RingPlacement:
    """Where the RDMA-visible ring may live on this GPU, and whether reads need a flush first."""
    if consumer not in CONSUMERS:
        raise ValueError(f"consumer must be one of {CONSUMERS}, got {consumer!r}")
    if not caps.rdma_supported:
        return RingPlacement("host", False, "GPU does not support GPUDirect RDMA")
    if not caps.dmabuf_supported:
        return RingPlacement("host", False, "GPU driver cannot export device memory as a dma-buf")
    if caps.write_ordering >= ORDERING_OWNER:
        return RingPlacement("gpu", False, "GPU orders GPUDirect RDMA writes for its own SMs")
    if consumer == "host" and caps.flush_options & FLUSH_OPTION_HOST:
        return RingPlacement("gpu", True, "GPU does not order GPUDirect RDMA writes: the host consumer "
                                          "flushes them before reading a payload")
    return RingPlacement("host", False, "GPU does not order GPUDirect RDMA writes and the persistent "
                                        "scheduler cannot flush them from the device")


def dmabuf_range(dptr: int, nbytes: int, page_bytes: int = mmap.PAGESIZE) -> int:
    """Length to export for a ring at `dptr`: the range must start and end on host pages."""
    if dptr <= 0 or nbytes <= 0:
        raise GpuDirectError(f"bad device range {dptr:#x} + {nbytes}")
    if dptr % page_bytes:
        raise GpuDirectError(f"device pointer {dptr:#x} is not aligned to the {page_bytes}-byte host page "
                             f"(allocate the ring with cuMemAlloc, which aligns to 2 MiB)")
    return -(-nbytes // page_bytes) * page_bytes


# -- cuda-python -------------------------------------------------------------------------
def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver
        except ImportError:
            raise GpuDirectError("GPU ring registration needs cuda-python (pip install 'blink-py[cuda]')") from None
    return driver


def _check(result, what: str):
    err, *rest = result
    if int(err) != 0:
        raise GpuDirectError(f"{what} failed: {getattr(err, 'name', err)}")
    return rest[0] if len(rest) == 1 else rest


def query_caps(device_ordinal: int = 0) -> GpuDirectCaps:
    d = _driver()
    try:
        _check(d.cuInit(0), "cuInit")
    except GpuDirectError:
        raise
    except Exception as e:   # newer cuda-python raises when no driver library is present
        raise GpuDirectError(f"no usable CUDA driver: {e}") from None
    dev = _check(d.cuDeviceGet(device_ordinal), "cuDeviceGet")
    A = d.CUdevice_attribute

    def attr(name: str) -> int:
        return int(_check(d.cuDeviceGetAttribute(getattr(A, name), dev), name))

    return GpuDirectCaps(
        rdma_supported=bool(attr("CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED")),
        dmabuf_supported=bool(attr("CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED")),
        write_ordering=attr("CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING"),
        flush_options=attr("CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS"))


def export_dmabuf(dptr: int, nbytes: int) -> tuple[int, int]:
    """(dma-buf fd, exported length) for device memory [dptr, +nbytes); caller's context current.

    Also marks the range SYNC_MEMOPS so cudaMemcpy on it never races RDMA traffic
    (what GPUDirect RDMA asks of memory a NIC writes).
    """
    d = _driver()
    length = dmabuf_range(dptr, nbytes)
    _check(d.cuPointerSetAttribute(1, d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, dptr),
           "cuPointerSetAttribute(SYNC_MEMOPS)")
    fd = _check(d.cuMemGetHandleForAddressRange(
        dptr, length, d.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0),
        "cuMemGetHandleForAddressRange(DMA_BUF_FD)")
    return int(fd), length


def flush_writes() -> None:
    """Make every GPUDirect RDMA write so far visible to the current context's GPU."""
    d = _driver()
    _check(d.cuFlushGPUDirectRDMAWrites(
        d.CUflushGPUDirectRDMAWritesTarget.CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
        d.CUflushGPUDirectRDMAWritesScope.CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER),
        "cuFlushGPUDirectRDMAWrites")
