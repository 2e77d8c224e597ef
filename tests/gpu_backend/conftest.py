"""Fixtures shared by the CUDA scheduler and graph-cache tests: the g++ twin
library (skip cleanly without a compiler) and small rings in real shared memory."""
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

    def make(geom: RingGeometry = RingGeometry(64, 1 << 16, 1 << 16)) -> Ring:
        region = ShmRegion.create(ring_name, geom.total_size)
        regions.append(region)
        return Ring.create(region.buf, geom)

    yield make
    for r in regions:
        r.close()
