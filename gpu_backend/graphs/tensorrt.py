"""TensorRT as a graph source: the probe.

    python -m gpu_backend.graphs.tensorrt   -> one line: what this machine has, and
    which graph source the CUDA executors use (exit 0 either way)

The paper builds its graph cache from TensorRT engines. Here the step graphs
are captured from PyTorch (capture.py): TensorRT is optional, and where it is
absent (the CI machines and, as far as we know, the lent H100 image) nothing
needs it. An engine-backed source would slot in as another GraphCache
producer: `execute_async_v3` captured on the same stream between the staging
and finish kernels, one engine profile per bucket shape; it is not built yet,
so a TensorRT install is reported and left unused.
"""
from __future__ import annotations

import importlib.util


def unavailable_reason() -> str | None:
    """None when `import tensorrt` works; else why not (one line)."""
    if importlib.util.find_spec("tensorrt") is None:
        return "tensorrt is not installed"
    try:
        import tensorrt  # noqa: F401
    except Exception as e:       # a broken install (missing libnvinfer, wrong CUDA) must still give one line
        return f"tensorrt does not import ({type(e).__name__}: {e})"
    return None


def status() -> str:
    why = unavailable_reason()
    if why is not None:
        return f"TensorRT graph source skipped: {why}; the step graphs come from PyTorch capture"
    import tensorrt
    return (f"TensorRT {getattr(tensorrt, '__version__', '?')} found; engine-backed graphs are not built in this "
            "version, the step graphs come from PyTorch capture")


if __name__ == "__main__":
    print(status())
