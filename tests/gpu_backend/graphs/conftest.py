"""Fixtures for the graph cache's tests: a tiny random model. The twin library
and shm rings come from tests/gpu_backend/conftest.py."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model():
    from gpu_backend.model import LlamaModel, tiny_config
    return LlamaModel.random(tiny_config(), seed=3)
