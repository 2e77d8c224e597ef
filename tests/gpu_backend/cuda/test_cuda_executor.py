"""The executor's refusals: one clear line, never a traceback, on machines that cannot run it."""
from __future__ import annotations

import pytest

from gpu_backend.cuda import driver
from gpu_backend.executors import ExecutorOptions, resolve


def test_unavailable_reason_is_one_line_without_a_usable_gpu():
    if driver.unavailable_reason() is None:
        pytest.skip("a usable GPU is present")
    from gpu_backend.executors import cuda
    why = cuda.unavailable_reason()
    assert why and "\n" not in why
    spec_why = resolve("cuda", "null").unavailable_reason()
    assert spec_why and "\n" not in spec_why
    with pytest.raises(driver.CudaUnavailable):
        driver.open_device(0)


@pytest.mark.parametrize("executor", ["cuda", "cuda-hostloop"])
def test_model_executors_refuse_without_a_gpu(executor):
    """Both CUDA executors serve real models now; without a usable GPU they refuse in one line."""
    if driver.unavailable_reason() is None:
        pytest.skip("a usable GPU is present")
    spec = resolve(executor, "default")
    why = spec.unavailable_reason()
    assert why and "\n" not in why
    with pytest.raises(driver.CudaUnavailable):
        spec.create(ExecutorOptions(model="default"))


def test_check_raises_named_errors():
    try:
        d = driver.bindings()
    except driver.CudaUnavailable as e:
        assert "cuda-python" in str(e)
        return
    with pytest.raises(driver.CudaError, match="CUDA_ERROR_INVALID_VALUE"):
        driver.check((d.CUresult.CUDA_ERROR_INVALID_VALUE,), "probe")
    assert driver.check((d.CUresult.CUDA_SUCCESS, 5)) == 5
