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
