"""Builds of the CUDA executor's C++ (gpu_backend/csrc): the device module with
nvcc, and the scheduler's CPU twin with g++. All compiler flags live here.

    csrc/*.cu + shared_layout/include/blink_ring_layout.h
      -> nvcc -rdc=true -c (one object per .cu) -> nvcc -dlink -cubin -lcudadevrt
      -> blink_sched.cubin (loaded by cuda-python's cuModuleLoadData)
    csrc/host_twin.cc + the same headers -> g++ -shared -> libblink_twin.so (ctypes)
    build_strict(): every .cu alone, and the device link, for the lent H100's
      sm_90a with warnings as errors (nvcc, host compiler and ptxas), and the twin
      with -Werror: what scripts/gpu_check.sh --rehearse runs before a GPU is lent

Outputs are cached under ${BLINK_CACHE_DIR:-~/.cache/blink}/cuda/<hash of the
sources, flags and compiler>/ and published atomically, so concurrent daemons
and test workers share one build and never see half a file.
"""
from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile

CSRC = pathlib.Path(__file__).resolve().parent.parent / "csrc"
LAYOUT_INCLUDE = pathlib.Path(__file__).resolve().parents[2] / "shared_layout" / "include"
DEVICE_SOURCES = ("scheduler.cu", "model_step.cu", "bench.cu")
DEFAULT_ARCH = "sm_90"        # Hopper: device graph launch from a persistent kernel (paper §4.2)

NVCC_FLAGS = ["-std=c++17", "-O3", "-lineinfo", "-rdc=true", "-Xptxas=-warn-spills",
              f"-I{CSRC}", f"-I{LAYOUT_INCLUDE}"]
GXX_FLAGS = ["-std=c++17", "-O2", "-Wall", "-Wextra", "-fPIC", "-shared", "-pthread",
             f"-I{CSRC}", f"-I{LAYOUT_INCLUDE}"]
STRICT_ARCH = "sm_90a"        # the H100's full instruction set (wgmma, setmaxnreg), -gencode form
STRICT_NVCC_FLAGS = ["-Werror", "all-warnings", "-Xcompiler=-Wall,-Wextra,-Werror", "-Xptxas=-Werror"]
STRICT_GXX_FLAGS = ["-Werror"]


class BuildError(RuntimeError):
    """A compiler is missing or failed; str() is one line, `log` the compiler output."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("BLINK_CACHE_DIR", "~/.cache/blink")).expanduser() / "cuda"


def find_nvcc() -> str | None:
    """nvcc from $BLINK_NVCC, $CUDA_HOME/bin, PATH, or /usr/local/cuda/bin."""
    for cand in (os.environ.get("BLINK_NVCC"),
                 os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None,
                 shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def find_gxx() -> str | None:
    return os.environ.get("BLINK_CXX") or shutil.which("g++") or shutil.which("c++")


@functools.cache
def _version(tool: str) -> str:
    try:
        return subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _sources_digest(*parts: str) -> str:
    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()) + sorted(LAYOUT_INCLUDE.glob("*.h")):
        if path.is_file():
            h.update(path.name.encode())
            h.update(path.read_bytes())
    for part in parts:
        h.update(part.encode())
    return h.hexdigest()[:16]


def _run(cmd: list[str], what: str) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except OSError as e:
        raise BuildError(f"{what}: cannot run {cmd[0]} ({e})") from None
    log = res.stdout + res.stderr
    if res.returncode != 0:
        first = next((line for line in log.splitlines() if "error" in line.lower()), log.strip()[:200])
        raise BuildError(f"{what} failed: {first}", log)
    return log


def _publish(build, out_dir: pathlib.Path, name: str) -> pathlib.Path:
    """Run `build(tmpdir) -> produced file` unless out_dir/name exists; move it in atomically."""
    target = out_dir / name
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        produced = build(pathlib.Path(tmp))
        os.replace(produced, target)
    return target


def build_device_module(arch: str = DEFAULT_ARCH, nvcc: str | None = None) -> pathlib.Path:
    """The scheduler, step and bench kernels, device-linked with cudadevrt, as one cubin."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (set BLINK_NVCC or CUDA_HOME, or put nvcc on PATH)")
    gencode = f"-gencode=arch=compute_{arch[3:]},code={arch}"
    key = _sources_digest(nvcc, _version(nvcc), arch, *NVCC_FLAGS)

    def build(tmp: pathlib.Path) -> pathlib.Path:
        objs = []
        for src in DEVICE_SOURCES:
            obj = tmp / (pathlib.Path(src).stem + ".o")
            _run([nvcc, *NVCC_FLAGS, gencode, "-c", str(CSRC / src), "-o", str(obj)], f"nvcc {src}")
            objs.append(str(obj))
        out = tmp / "blink_sched.cubin"
        _run([nvcc, gencode, "-dlink", "-cubin", *objs, "-lcudadevrt", "-o", str(out)],
             "nvcc device link (-dlink -lcudadevrt)")
        return out

    return _publish(build, cache_root() / key, f"blink_sched_{arch}.cubin")


SANITIZERS = ("thread", "address,undefined")


def sanitizer_flags() -> list[str]:
    """BLINK_TWIN_SANITIZE=thread|address,undefined: the twin built under that sanitizer (the
    process that loads it must preload the runtime, e.g. LD_PRELOAD=libtsan.so.2; tests/gpu_backend/
    cuda/test_twin_sanitizers.py runs the loop's workloads so)."""
    which = os.environ.get("BLINK_TWIN_SANITIZE", "")
    if not which:
        return []
    if which not in SANITIZERS:
        raise BuildError(f"BLINK_TWIN_SANITIZE={which!r}: expected one of {', '.join(SANITIZERS)}")
    return [f"-fsanitize={which}", "-g", "-fno-omit-frame-pointer"]


def build_host_twin(gxx: str | None = None, defines: tuple[str, ...] = ()) -> pathlib.Path:
    """The CPU twin and policy shim as a shared library for ctypes. `defines`: preprocessor
    symbols of a test variant (BLINK_PLANT_SURVEY_FAULT: sched_loop.h's planted survey fault)."""
    gxx = gxx or find_gxx()
    if gxx is None:
        raise BuildError("no C++ compiler found (g++); set BLINK_CXX")
    flags = [*GXX_FLAGS, *(f"-D{d}" for d in defines), *sanitizer_flags()]
    key = _sources_digest(gxx, _version(gxx), *flags)

    def build(tmp: pathlib.Path) -> pathlib.Path:
        out = tmp / "libblink_twin.so"
        _run([gxx, *flags, str(CSRC / "host_twin.cc"), "-o", str(out)], "g++ host_twin.cc")
        return out

    return _publish(build, cache_root() / key, "libblink_twin.so")


def build_strict(out_dir: pathlib.Path, arch: str = STRICT_ARCH, nvcc: str | None = None,
                 gxx: str | None = None) -> list[pathlib.Path]:
    """Every device source, the device link and the twin, warnings as errors, into out_dir
    (no cache: a check, not a build to reuse). Raises BuildError naming the first failure."""
    nvcc = nvcc or find_nvcc()
    gxx = gxx or find_gxx()
    if nvcc is None or gxx is None:
        raise BuildError(f"strict build needs nvcc and g++ (nvcc: {nvcc}, g++: {gxx})")
    gencode = f"-gencode=arch=compute_{arch[3:]},code={arch}"
    out_dir.mkdir(parents=True, exist_ok=True)
    objs = []
    for src in sorted(p.name for p in CSRC.glob("*.cu")):
        obj = out_dir / (pathlib.Path(src).stem + ".o")
        _run([nvcc, *NVCC_FLAGS, *STRICT_NVCC_FLAGS, gencode, "-c", str(CSRC / src), "-o", str(obj)],
             f"nvcc {src} ({arch}, warnings as errors)")
        objs.append(obj)
    cubin = out_dir / f"blink_sched_{arch}.cubin"
    _run([nvcc, gencode, "-Werror", "all-warnings", "-dlink", "-cubin", *map(str, objs), "-lcudadevrt",
          "-o", str(cubin)], f"nvcc device link ({arch})")
    twin = out_dir / "libblink_twin.so"
    _run([gxx, *GXX_FLAGS, *STRICT_GXX_FLAGS, str(CSRC / "host_twin.cc"), "-o", str(twin)], "g++ host_twin.cc -Werror")
    return [*objs, cubin, twin]
