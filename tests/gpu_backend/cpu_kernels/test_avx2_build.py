"""The CPU kernels built as an AVX2-only CPU builds them (BLINK_CPU_MARCH=x86-64-v3), on any machine
that can run that code: the build must not need AVX512 anywhere (no zmm register in the library, so
no AVX512 instruction from the compiler's own vectorising either), and the kernel and executor tests
pass on it. Our machines change CPU kind from day to day; this catches on a wider CPU what would
otherwise first fail on an AVX2-only one (its -march=native build), where CI would go red.
BLINK_CPU_ISA narrows the dispatch of a native build at run time; this narrows the build itself."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from gpu_backend import cpu_kernels as ck

REPO = pathlib.Path(__file__).resolve().parents[3]
AVX2_TESTS = ("tests/gpu_backend/cpu_kernels/test_quant_kernels.py", "tests/gpu_backend/cpu_kernels/test_cpu_kernels.py",
              "tests/gpu_backend/cpu_kernels/test_prefill_attention.py", "tests/gpu_backend/executors/test_cpu_forward.py",
              "tests/gpu_backend/executors/test_cpu_decode.py")


def _runs_x86_64_v3() -> bool:
    flags = set(ck._cpu_flags().split())
    return {"avx2", "fma", "bmi2", "f16c", "movbe"} <= flags


pytestmark = pytest.mark.skipif(not _runs_x86_64_v3() or ck.find_gxx() is None,
                                reason="needs an x86 CPU with AVX2 (x86-64-v3) and g++")


@pytest.fixture(scope="module")
def avx2_env():
    env = {**os.environ, ck.MARCH_ENV: "x86-64-v3"}
    env.pop(ck.ISA_ENV, None)                          # the build's own widest path: AVX2
    return env


def test_the_avx2_build_has_no_avx512_instruction(avx2_env):
    r = subprocess.run([sys.executable, "-c", "from gpu_backend import cpu_kernels as ck; print(ck.build())"],
                       cwd=REPO, env=avx2_env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    lib = pathlib.Path(r.stdout.strip().splitlines()[-1])
    assert lib.exists() and "-march=x86-64-v3" in subprocess.run(
        [sys.executable, "-c", "from gpu_backend import cpu_kernels as ck; print(ck.GXX_FLAGS)"], cwd=REPO,
        env=avx2_env, capture_output=True, text=True, timeout=60).stdout
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump to read the library's instructions")
    asm = subprocess.run([objdump, "-d", str(lib)], capture_output=True, text=True, timeout=300).stdout
    assert "ymm" in asm and "zmm" not in asm           # AVX2 code, and no AVX512 register anywhere


def test_the_kernel_and_executor_tests_pass_on_the_avx2_build(avx2_env):
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *AVX2_TESTS], cwd=REPO,
                       env=avx2_env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout.splitlines()[-1], r.stdout[-500:]
