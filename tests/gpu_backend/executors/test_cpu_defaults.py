"""The CPU executor's defaults: seats sized from the KV pool (64 streams of the embedded model all
run in the default 1 GiB), never more than the cap, at least one."""
from __future__ import annotations

from gpu_backend.executors.cpu import MAX_BATCH_SIZE_CAP, SEAT_TOKENS, default_max_batch_size
from gpu_backend.kv_pool import blocks_for_budget


def test_seats_come_from_the_kv_pool():
    # SmolLM2-135M (30 layers, 3 KV heads of 64) in float32, the default 1 GiB, 16-token blocks
    blocks = blocks_for_budget(1024 * 2**20, 30, 3, 64, 16, 4)
    seats = default_max_batch_size(blocks, 16)
    assert seats >= 64                                            # 64 streams run at once
    assert seats * SEAT_TOKENS <= blocks * 16                     # each seat's typical request fits
    assert default_max_batch_size(10**7, 16) == MAX_BATCH_SIZE_CAP
    assert default_max_batch_size(3, 16) == 1


def test_threads_default_to_every_core_with_passive_openmp_waits(monkeypatch):
    import argparse
    import os

    from gpu_backend import cli
    from gpu_backend.executors.cpu import default_threads
    assert default_threads() == len(os.sched_getaffinity(0))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--step-ms", "1"])          # refused before anything starts (exit 2)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert cli.run(args) == 2 and os.environ["GOMP_SPINCOUNT"] == "10000"   # bounded spin, then sleep
    assert "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setenv("GOMP_SPINCOUNT", "500")              # an operator's setting wins
    assert cli.run(args) == 2 and os.environ["GOMP_SPINCOUNT"] == "500"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")         # so does a wait policy
    assert cli.run(args) == 2 and "GOMP_SPINCOUNT" not in os.environ


def test_auto_dtype_follows_a_narrowed_isa(monkeypatch):
    """--dtype auto picks bf16 only where the CPU has bf16 math and BLINK_CPU_ISA keeps it: the
    switch narrowed to avx2 or avx512 serves as a CPU without it would (float32 activations)."""
    import torch

    from gpu_backend.executors import cpu
    monkeypatch.setattr(cpu, "open", lambda *a, **k: __import__("io").StringIO("flags\t: fpu avx2 avx512_bf16\n"),
                        raising=False)
    monkeypatch.delenv("BLINK_CPU_ISA", raising=False)
    assert cpu.cpu_has_native_bf16() and cpu.resolve_dtype("auto") == torch.bfloat16
    for narrow in ("scalar", "avx2", "AVX512"):
        monkeypatch.setenv("BLINK_CPU_ISA", narrow)
        assert not cpu.cpu_has_native_bf16() and cpu.resolve_dtype("auto") == torch.float32
    monkeypatch.setenv("BLINK_CPU_ISA", "avx512bf16")
    assert cpu.resolve_dtype("auto") == torch.bfloat16
    assert cpu.resolve_dtype("float32") == torch.float32             # an explicit dtype is never changed
    monkeypatch.setattr(cpu, "open", lambda *a, **k: __import__("io").StringIO("flags\t: fpu avx2\n"), raising=False)
    assert cpu.resolve_dtype("auto") == torch.float32


def test_auto_kv_dtype_is_bf16_for_quantized_weights_in_float32_on_the_kernels():
    """--kv-cache-dtype auto: the model's dtype (vLLM's auto), except quantized weights computed in
    float32 on the kernels (an AVX2 CPU serving the embedded Q4_1 model): bf16, as llama.cpp's f16
    cache. An explicit choice stands; float32 under bf16 activations is refused with a reason."""
    import pytest
    import torch

    from gpu_backend.executors.cpu import resolve_kv_dtype
    kernels = object()
    f32, bf16 = torch.float32, torch.bfloat16
    assert resolve_kv_dtype("auto", f32, True, kernels) == bf16
    assert resolve_kv_dtype("auto", f32, False, kernels) == f32          # a float model keeps float32 K/V
    assert resolve_kv_dtype("auto", f32, True, None) == f32              # the PyTorch layer: no mixed kernels
    assert resolve_kv_dtype("auto", bf16, True, kernels) == bf16
    assert resolve_kv_dtype("float32", f32, True, kernels) == f32
    assert resolve_kv_dtype("bfloat16", f32, False, None) == bf16
    with pytest.raises(ValueError, match="--kv-cache-dtype float32 under --dtype bfloat16"):
        resolve_kv_dtype("float32", bf16, True, kernels)


def test_the_kv_cache_dtype_flag_reaches_the_executor_options():
    import argparse

    from gpu_backend import cli
    from dpu_frontend.serve import DAEMON_FLAGS
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert parser.parse_args([]).kv_cache_dtype == "auto"
    assert parser.parse_args(["--kv-cache-dtype", "float32"]).kv_cache_dtype == "float32"
    assert "--kv-cache-dtype" in [flag for flag, _, _ in DAEMON_FLAGS]    # `blink serve` passes it on
