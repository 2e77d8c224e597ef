"""The CUDA executor's host side: build the C++ in gpu_backend/csrc, set the
persistent scheduler up through cuda-python, and watch it.

    build.py        nvcc -> device module (cubin, cudadevrt linked); g++ -> CPU twin (.so)
    structs.py      ctypes mirror of csrc/sched_types.h
    twin.py         the scheduler's decision core and whole loop on the CPU (ctypes)
    driver.py       cuda-python checks and errors; the one-line refusal
    device_ring.py  the ring as the device sees it: host-mapped shm, or device memory
    runtime.py      one-time setup: module, buffers, graphs for device launch, start, watch, stop

Nothing here imports cuda-python at module import time, so CPU-only machines
can build, test the twin, and get a clear refusal from the executor.
"""
