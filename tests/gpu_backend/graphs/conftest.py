"""Fixtures for the graph cache's tests: the g++ twin library (skip cleanly
without a compiler), small rings in real shared memory, a tiny random model."""
from __future__ import annotations

import pytest

from gpu_backend.cuda import build
from shared_layout import Ring, RingGeometry
from shared_layout.shm import ShmRegion


@pytest.fixture(scope="session")
def twin_lib():
    if build.find_gxx() is None:
        pytest.skip("no g++")
    from gpu_backend.cuda import twin
    return twin.lib()


@pytest.fixture
def shm_ring(ring_name):
    """make(geometry) -> Ring in /dev/shm/<ring_name>; unlinked by ring_name's fixture."""
    regions = []

    def make(geom: RingGeometry = RingGeometry(64, 1 << 14, 1 << 14)) -> Ring:
        region = ShmRegion.create(ring_name, geom.total_size)
        regions.append(region)
        return Ring.create(region.buf, geom)

    yield make
    for r in regions:
        r.close()


@pytest.fixture(scope="session")
def tiny_model():
    from gpu_backend.model import LlamaModel, tiny_config
    return LlamaModel.random(tiny_config(), seed=3)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The tiny model's ops are microseconds on one thread; with intra-op threads on a busy
    2-core CI box they wait milliseconds for each other."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
