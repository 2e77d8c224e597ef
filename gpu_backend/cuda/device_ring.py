"""The ring as the scheduler kernel addresses it.

    HostMappedRing(ring): the daemon's shm mapping, page-locked and mapped for
        the device (cuMemHostRegister DEVICEMAP), so `blink serve --executor
        cuda` works on one box with the normal shm frontend. Device reads and
        writes cross PCIe; the kernel uses volatile accesses and system fences.
    DeviceRing(geometry): the ring in device memory (cuMemAlloc), formatted
        from the host once; for the RDMA deployment (the NIC writes it through a
        dmabuf MR, registered by the RDMA issue) and for benchmarks. read/write
        copy bytes with the driver, as a transport would.
"""
from __future__ import annotations

import numpy as np

from shared_layout import Ring, RingGeometry

from .driver import bindings, check


class HostMappedRing:
    def __init__(self, ring: Ring):
        d = bindings()
        self.ring = ring
        self._view = np.frombuffer(ring.buf, np.uint8)      # [total bytes] keeps the mapping's address fixed
        self.host_addr = self._view.ctypes.data
        self.nbytes = self._view.nbytes
        flags = d.CU_MEMHOSTREGISTER_DEVICEMAP | d.CU_MEMHOSTREGISTER_PORTABLE
        check(d.cuMemHostRegister(self.host_addr, self.nbytes, flags), "cuMemHostRegister(ring shm)")
        self._registered = True
        self.device_addr = int(check(d.cuMemHostGetDevicePointer(self.host_addr, 0), "cuMemHostGetDevicePointer"))

    @property
    def geometry(self) -> RingGeometry:
        return self.ring.geom

    def close(self) -> None:
        if self._registered:
            self._registered = False
            check(bindings().cuMemHostUnregister(self.host_addr), "cuMemHostUnregister")


class DeviceRing:
    def __init__(self, geometry: RingGeometry):
        d = bindings()
        self.geometry = geometry
        self.nbytes = geometry.total_size
        self.device_addr = int(check(d.cuMemAlloc(self.nbytes), "cuMemAlloc(ring)"))
        check(d.cuMemsetD8(self.device_addr, 0, self.nbytes), "cuMemsetD8(ring)")
        staging = bytearray(geometry.total_size)      # formatted on the host once
        Ring.create(staging, geometry)
        self.write(0, bytes(staging[:geometry.prompt_arena_offset]))   # header + slots; arenas stay zero

    def write(self, offset: int, data: bytes) -> None:
        buf = np.frombuffer(bytes(data), np.uint8)
        check(bindings().cuMemcpyHtoD(self.device_addr + offset, buf.ctypes.data, buf.nbytes), "cuMemcpyHtoD")

    def write_batch(self, writes: list[tuple[int, bytes]]) -> None:
        for off, data in writes:      # synchronous copies: each lands before the next starts
            self.write(off, data)

    def read(self, offset: int, nbytes: int) -> bytes:
        out = np.empty(nbytes, np.uint8)
        check(bindings().cuMemcpyDtoH(out.ctypes.data, self.device_addr + offset, nbytes), "cuMemcpyDtoH")
        return out.tobytes()

    def close(self) -> None:
        if self.device_addr:
            check(bindings().cuMemFree(self.device_addr), "cuMemFree(ring)")
            self.device_addr = 0

