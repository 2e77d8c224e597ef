"""Suite-wide markers: `gpu` and `rdma` tests skip cleanly without the hardware."""
from __future__ import annotations

import functools
import glob
import os

import pytest


@functools.cache
def gpu_reason() -> str | None:
    """None when an NVIDIA GPU with compute capability >= 9.0 and cuda-python are usable."""
    from gpu_backend.cuda.driver import unavailable_reason
    return unavailable_reason()


@functools.cache
def rdma_reason() -> str | None:
    if not glob.glob("/sys/class/infiniband/*"):
        return "no RDMA device (mlx5, rxe or siw)"
    try:
        from shared_layout.rdma.device import import_pyverbs
        import_pyverbs()  # also finds Debian's python3-pyverbs from inside the venv
    except Exception:  # ImportError or PyverbsMissing
        return "pyverbs not installed"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        # markers, not keywords: a test under tests/shared_layout/rdma/ has "rdma" among its keywords
        if item.get_closest_marker("gpu") and (why := gpu_reason()):
            item.add_marker(pytest.mark.skip(reason=f"gpu test: {why}"))
        if item.get_closest_marker("rdma") and (why := rdma_reason()):
            if os.environ.get("BLINK_REQUIRE_RDMA") == "1":   # scripts/rdma_vm.sh guests: never skip
                raise pytest.UsageError(f"BLINK_REQUIRE_RDMA=1 but rdma tests cannot run: {why}")
            item.add_marker(pytest.mark.skip(reason=f"rdma test: {why}"))


@pytest.fixture
def ring_name(request):
    """A unique shared-memory name for one test, unlinked afterwards."""
    from shared_layout.shm import ShmRegion
    name = f"blink-test-{os.getpid()}-{abs(hash(request.node.nodeid)) % 10**8}"
    yield name
    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        pass
    del ShmRegion
