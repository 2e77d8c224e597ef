"""cuda-python (cuda.bindings.driver) for the CUDA executor: the one-line
refusal when the machine cannot run it, error checking, the device context.

    unavailable_reason() -> None | "why not" (no cuda-python, no driver, no GPU,
        compute capability below 9.0)
    open_device(ordinal) -> Device (primary context made current)
    check(call_result) -> the values of a cuda-python call, or CudaError

cuda.bindings is imported lazily: nothing here fails at import on a CPU box.
"""
from __future__ import annotations

import dataclasses
import functools

MIN_COMPUTE_CAPABILITY = (9, 0)   # device graph launch from a persistent kernel, as the paper runs it (H100)


class CudaUnavailable(RuntimeError):
    """This machine cannot run the CUDA executor; str() is the one line to show."""


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


def bindings():
    """cuda.bindings.driver, or CudaUnavailable."""
    try:
        from cuda.bindings import driver
    except ImportError:
        raise CudaUnavailable("cuda-python is not installed (pip install 'blink-py[cuda]')") from None
    return driver


def check(result, what: str = "CUDA call"):
    """cuda-python returns (CUresult, *values): raise on error, else the value(s)."""
    d = bindings()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != d.CUresult.CUDA_SUCCESS:
        raise CudaError(f"{what} failed: {getattr(err, 'name', err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@functools.cache
def unavailable_reason() -> str | None:
    """None when a GPU of compute capability >= 9.0 and cuda-python are usable, else why not."""
    try:
        d = bindings()
    except CudaUnavailable as e:
        return str(e)
    try:
        err, = d.cuInit(0)
    except RuntimeError as e:   # cuda-bindings raises when libcuda.so.1 cannot be loaded
        return f"no NVIDIA driver ({e})"
    if err != d.CUresult.CUDA_SUCCESS:
        return f"no usable CUDA driver ({err.name})"
    err, n = d.cuDeviceGetCount()
    if err != d.CUresult.CUDA_SUCCESS or n == 0:
        return "no CUDA device"
    best = (0, 0)
    attr = d.CUdevice_attribute
    for i in range(n):
        _, dev = d.cuDeviceGet(i)
        _, major = d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        _, minor = d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
        best = max(best, (major, minor))
    if best < MIN_COMPUTE_CAPABILITY:
        return (f"compute capability {best[0]}.{best[1]} is below "
                f"{MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]}")
    return None


@dataclasses.dataclass
class Device:
    ordinal: int
    handle: object           # CUdevice
    context: object          # CUcontext (the primary context, current on the calling thread)
    name: str
    compute_capability: tuple[int, int]
    multiprocessors: int
    host_native_atomics: bool = False   # cudaDevAttrHostNativeAtomicSupported: 0 on x86 + PCIe (the ring needs none)

    def make_current(self) -> None:
        check(bindings().cuCtxSetCurrent(self.context), "cuCtxSetCurrent")


def open_device(ordinal: int = 0) -> Device:
    """The device's primary context, made current; CudaUnavailable when it cannot run the executor."""
    why = unavailable_reason()
    if why is not None:
        raise CudaUnavailable(why)
    d = bindings()
    dev = check(d.cuDeviceGet(ordinal), "cuDeviceGet")
    attr = d.CUdevice_attribute
    cc = (check(d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)),
          check(d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)))
    if cc < MIN_COMPUTE_CAPABILITY:
        raise CudaUnavailable(f"device {ordinal} has compute capability {cc[0]}.{cc[1]}, below 9.0")
    sms = check(d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))
    host_atomics = check(d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED, dev))
    name = check(d.cuDeviceGetName(256, dev), "cuDeviceGetName")
    ctx = check(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    check(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return Device(ordinal, dev, ctx, name.split(b"\0")[0].decode(errors="replace"), cc, sms, bool(host_atomics))
