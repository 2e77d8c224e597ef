"""`--executor cuda-hostloop` on a machine without a usable GPU: one line, exit 2,
no traceback, no ring left half-made; the registry finds its module."""
from __future__ import annotations

import subprocess
import sys

import pytest

from gpu_backend.cuda import driver
from gpu_backend.cuda.child_env import child_env
from gpu_backend.executors import REGISTRY, resolve



def test_registered_under_its_flag_name():
    spec = resolve("cuda-hostloop", "default")
    assert spec is REGISTRY["cuda-hostloop"] and spec.class_name == "CudaHostLoopExecutor"
    from gpu_backend.executors import cuda_hostloop
    assert cuda_hostloop.CudaHostLoopExecutor.name == "cuda-hostloop"


@pytest.mark.parametrize("model", ["default", "null"])
def test_daemon_refuses_in_one_line_without_a_gpu(ring_name, model):
    if driver.unavailable_reason() is None:
        pytest.skip("a usable GPU is present")
    env = child_env()
    res = subprocess.run([sys.executable, "-m", "dpu_frontend.cli", "gpu-daemon", "--executor", "cuda-hostloop",
                          "--model", model, "--ring", ring_name], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert len(lines) == 1 and "--executor cuda-hostloop needs" in lines[0] and "Traceback" not in res.stderr
