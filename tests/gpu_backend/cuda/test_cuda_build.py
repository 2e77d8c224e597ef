"""The CUDA sources compile for sm_90 with relocatable device code and link
with the device runtime (what the H100 loads); the CPU twin builds with g++."""
from __future__ import annotations

import pathlib
import subprocess

import pytest

from gpu_backend.cuda import build

KERNELS = ("blink_scheduler", "blink_scheduler_shared", "blink_echo_step", "blink_clock_probe", "blink_bench_scan", "blink_bench_launch",
           "blink_bench_child", "blink_bench_tail", "blink_stage_inputs", "blink_finish_step")


def _elf_function_symbols(path: pathlib.Path) -> dict[str, str]:
    """name -> section index ('UND' for undefined) of FUNC symbols, via binutils readelf."""
    out = subprocess.run(["readelf", "-sW", str(path)], capture_output=True, text=True, check=True).stdout
    syms = {}
    for line in out.splitlines():
        cols = line.split()
        if len(cols) >= 8 and cols[3] == "FUNC":
            syms[cols[-1]] = cols[-2]
    return syms


@pytest.mark.slow
def test_device_module_builds_for_sm90_with_device_runtime(nvcc, tmp_path, monkeypatch):
    monkeypatch.setenv("BLINK_CACHE_DIR", str(tmp_path))
    cubin = build.build_device_module("sm_90", nvcc)
    data = cubin.read_bytes()
    assert data[:4] == b"\x7fELF" and len(data) > 4096
    try:
        syms = _elf_function_symbols(cubin)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("readelf not available")
    for k in KERNELS:
        assert k in syms and syms[k] != "UND", f"kernel {k} missing from the linked cubin"
    # device graph launch is resolved by the driver at load time, as in any nvcc -rdc program
    assert syms.get("cudaGraphLaunch") == "UND"
    # cached: a second build is the same file
    assert build.build_device_module("sm_90", nvcc) == cubin


@pytest.mark.slow
def test_every_source_builds_for_sm90a_with_warnings_as_errors(nvcc, tmp_path):
    outs = build.build_strict(tmp_path)
    assert {p.name for p in outs} >= {"scheduler.o", "model_step.o", "bench.o", "blink_sched_sm_90a.cubin",
                                      "libblink_twin.so"}
    assert set(build.DEVICE_SOURCES) == {p.name for p in build.CSRC.glob("*.cu")}   # none left out of the module


def test_compiler_error_is_one_line(nvcc, tmp_path, monkeypatch):
    monkeypatch.setenv("BLINK_CACHE_DIR", str(tmp_path))
    src = tmp_path / "bad.cu"
    src.write_text("__global__ void k() { this is not cuda; }\n")
    with pytest.raises(build.BuildError) as e:
        build._run([nvcc, "-arch=sm_90", "-c", str(src), "-o", str(tmp_path / "bad.o")], "nvcc bad.cu")
    assert "\n" not in str(e.value) and "error" in e.value.log


def test_missing_nvcc_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("BLINK_CACHE_DIR", str(tmp_path))
    with pytest.raises(build.BuildError, match="nvcc not found"):
        monkeypatch.setattr(build, "find_nvcc", lambda: None)
        build.build_device_module()


def test_host_twin_builds_and_is_cached(twin_lib, tmp_path, monkeypatch):
    monkeypatch.setenv("BLINK_CACHE_DIR", str(tmp_path))
    so = build.build_host_twin()
    assert so.exists() and so.stat().st_size > 0
    assert build.build_host_twin() == so
