"""What the lent machine is, printed first by every GPU check (scripts/gpu_check.sh
`probe` stage): python and package versions, the GPU, and the device attribute
the ring protocol depends on.

    python3 -m gpu_backend.cuda.probe
      -> one line of versions; one line per GPU (name, compute capability, SMs,
         cudaDevAttrHostNativeAtomicSupported); exit 2 when the CUDA executor
         cannot run here (the reason in one line)
"""
from __future__ import annotations

import os
import platform
import sys
from importlib import metadata


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "missing"


def main() -> int:
    dists = ("numpy", "torch", "cuda-bindings", "gguf", "aiohttp", "tokenizers", "uvloop", "pytest", "pytest-timeout")
    print(f"python {platform.python_version()} ({sys.executable}), {os.cpu_count()} cores;",
          ", ".join(f"{d} {_version(d)}" for d in dists), flush=True)
    from . import driver
    why = driver.unavailable_reason()
    if why is not None:
        print(f"probe: the CUDA executor cannot run here: {why}")
        return 2
    dev = driver.open_device(0)
    d = driver.bindings()
    version = driver.check(d.cuDriverGetVersion(), "cuDriverGetVersion")
    print(f"GPU 0: {dev.name}, compute capability {dev.compute_capability[0]}.{dev.compute_capability[1]}, "
          f"{dev.multiprocessors} SMs, driver API {version // 1000}.{version % 1000 // 10}, "
          f"host-native atomics {int(dev.host_native_atomics)} (cudaDevAttrHostNativeAtomicSupported; "
          f"the ring protocol uses no cross-boundary atomics either way)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
