"""Fixtures for the CUDA executor's tests: nvcc (skip cleanly without it).
The twin library and shm rings come from tests/gpu_backend/conftest.py."""
from __future__ import annotations

import pytest

from gpu_backend.cuda import build


@pytest.fixture(scope="session")
def nvcc():
    path = build.find_nvcc()
    if path is None:
        pytest.skip("nvcc not installed")
    return path
