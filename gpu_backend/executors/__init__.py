"""Executor registry: the name given to `--executor` -> the class that serves the ring.

    cli.py (ExecutorOptions from flags) -> resolve(executor, model) -> ExecutorSpec
      -> spec.unavailable_reason() (None when it can run here) -> spec.create(options)
      -> Executor: loads the model; daemon.py publishes vocab_size / max_model_len,
         then calls serve(ring, stop) until shutdown.

Entries name their module lazily so `blink gpu-daemon --executor cpu` never
imports CUDA code. Engineer D's executors plug in by providing the modules
named below (gpu_backend/executors/cuda.py with `CudaExecutor`,
cuda_hostloop.py with `CudaHostLoopExecutor`); a module may define
`unavailable_reason() -> str | None` to refine the default GPU check.
"""
from __future__ import annotations

import dataclasses
import importlib
import threading
from typing import Callable, Protocol

from shared_layout import Ring

from ..scheduler.intake import IntakeConfig
from ..scheduler.policy import PolicyConfig, Scenario, SchedPolicy

# --dtype auto on the CUDA executors (graphs/config.graph_dtype): bfloat16, the dtype SmolLM2 ships in
# and what vLLM's "auto" serves it in on a GPU: tensor-core matmuls and half the bytes of float32
# (the H200's step graphs 2.3x shorter, bench/results/2026-11-27-h200-gpu-check-2); float32 stays
# one flag away, and is what the GPU tests compare with the CPU reference in.
CUDA_AUTO_DTYPE = "bfloat16"


def cuda_dtype_name(option: str) -> str:
    """The CUDA executors' --dtype as the name of the dtype they load (auto -> CUDA_AUTO_DTYPE)."""
    return CUDA_AUTO_DTYPE if option == "auto" else option


class Executor(Protocol):
    name: str
    vocab_size: int       # published in the ring header before READY
    max_model_len: int    # prompt + output tokens at most, published before READY

    def serve(self, ring: Ring, stop: threading.Event) -> None:
        """Serve the ring until `stop` is set; then let in-flight requests finish for the
        grace period and end the rest ABORT/BACKEND_SHUTDOWN before returning."""
        ...

    def close(self) -> None:
        ...


@dataclasses.dataclass(frozen=True)
class ExecutorOptions:
    """What the daemon's flags say about the model and the engine (None = executor default)."""
    model: str = "default"
    max_batch_size: int | None = None
    max_prefill_tokens: int | None = None
    block_size: int = 16
    kv_cache_mb: int | None = None
    max_model_len: int | None = None
    threads: int | None = None
    dtype: str = "auto"                 # auto | float32 | bfloat16 (cpu.resolve_dtype; CUDA: CUDA_AUTO_DTYPE)
    kv_cache_dtype: str = "auto"        # cpu executor: auto | float32 | bfloat16 (cpu.resolve_kv_dtype)
    shutdown_grace_s: float = 2.0
    policy_trace: str | None = None     # write every policy decision here as a Scenario (JSON)
    step_ms: float = 0.0                # null executor: each engine step takes at least this long (0: no pacing)
    prefix_caching: bool = True         # share cached KV blocks of a common prefix (engine executors)
    scheduling_policy: str = "fcfs"     # fcfs | priority | lvf (engine executors and the device loop)
    ttft_slo_ms: int = 5000             # a request's TTFT target when it names none
    tbt_slo_ms: int = 100               # its time-between-tokens target when it names none
    doorbell: str | None = None         # host-loop executors: ring this ring's bell after each step that
                                        # published (the daemon sets the ring's name; shared_layout.doorbell)

    def sched(self, policy: PolicyConfig) -> PolicyConfig:
        """`policy` under the scheduling policy these options name."""
        return dataclasses.replace(policy, policy=SchedPolicy[self.scheduling_policy.upper()])

    def slo(self, intake: IntakeConfig) -> IntakeConfig:
        """`intake` with these options' default SLOs."""
        return dataclasses.replace(intake, ttft_slo_ms=self.ttft_slo_ms, tbt_slo_ms=self.tbt_slo_ms)

    def scenario(self, policy: PolicyConfig) -> Scenario | None:
        """A recorder for the policy decisions when --policy-trace was given."""
        return Scenario(policy, name="gpu-daemon") if self.policy_trace else None

    def save_scenario(self, scenario: Scenario | None) -> None:
        if scenario is not None and self.policy_trace:
            scenario.dump(self.policy_trace)


def gpu_unavailable_reason() -> str | None:
    """None when an NVIDIA GPU with compute capability >= 9.0 and cuda-python are usable."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return "cuda-python is not installed"
    try:
        err, = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return f"no usable CUDA driver ({err.name})"
        err, n = driver.cuDeviceGetCount()
        if err != driver.CUresult.CUDA_SUCCESS or n == 0:
            return "no CUDA device"
        best = 0
        for i in range(n):
            _, dev = driver.cuDeviceGet(i)
            attr = driver.CUdevice_attribute
            _, major = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
            best = max(best, major)
        if best < 9:
            return f"the best device has compute capability {best}.x"
    except Exception as e:   # a broken driver install must still give one line
        return f"CUDA check failed: {e}"
    return None


@dataclasses.dataclass(frozen=True)
class ExecutorSpec:
    name: str
    module: str                 # gpu_backend.executors.<module>
    class_name: str
    requirement: str            # what it needs, for the one-line error
    check: Callable[[], str | None] = lambda: None

    def unavailable_reason(self) -> str | None:
        """None when this executor can run on this machine, else why not."""
        why = self.check()
        if why is not None:
            return why
        try:
            mod = importlib.import_module(self.module)
        except ImportError as e:
            return f"its module {self.module} is not available ({e})"
        refine = getattr(mod, "unavailable_reason", None)
        return refine() if refine is not None else None

    def create(self, options: ExecutorOptions) -> Executor:
        cls = getattr(importlib.import_module(self.module), self.class_name)
        return cls(options)


REGISTRY: dict[str, ExecutorSpec] = {}


def register(spec: ExecutorSpec) -> None:
    REGISTRY[spec.name] = spec


register(ExecutorSpec("cpu", "gpu_backend.executors.cpu", "CpuExecutor", "PyTorch"))
register(ExecutorSpec("null", "gpu_backend.executors.null", "NullExecutor", "nothing"))
_GPU_NEED = "an NVIDIA GPU with compute capability >= 9.0 and cuda-python"
register(ExecutorSpec("cuda", "gpu_backend.executors.cuda", "CudaExecutor", _GPU_NEED, gpu_unavailable_reason))
register(ExecutorSpec("cuda-hostloop", "gpu_backend.executors.cuda_hostloop", "CudaHostLoopExecutor", _GPU_NEED,
                      gpu_unavailable_reason))

EXECUTOR_CHOICES = ("cpu", "cuda", "cuda-hostloop")


def resolve(executor: str, model: str) -> ExecutorSpec:
    """The spec for `--executor` and `--model`; `--model null` on the CPU path is the null executor."""
    if executor == "cpu" and model == "null":
        return REGISTRY["null"]
    return REGISTRY[executor]
