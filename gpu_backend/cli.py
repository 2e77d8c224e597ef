"""`blink gpu-daemon`: flags -> DaemonConfig -> daemon.run_daemon.

The only place the daemon's command line is parsed; components receive their
own frozen configs (ExecutorOptions, RingGeometry) built here.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from shared_layout import RingGeometry
from shared_layout.layout import DEFAULT_OUTPUT_ARENA_TOKENS, DEFAULT_PROMPT_ARENA_TOKENS, DEFAULT_SLOTS
from shared_layout.shm import DEFAULT_RING_NAME

from .executors import EXECUTOR_CHOICES, ExecutorOptions


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _non_negative_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ring", default=DEFAULT_RING_NAME, help="shared-memory ring name (/dev/shm/NAME)")
    p.add_argument("--model", default="default",
                   help="'default' (embedded SmolLM2-135M-Instruct), an HF folder, a .gguf file, "
                        "or 'null' (no compute: echoes the prompt)")
    p.add_argument("--executor", default="cpu", choices=EXECUTOR_CHOICES)
    p.add_argument("--slots", type=_positive_int, default=None,
                   help=f"ring slots when creating the ring (default {DEFAULT_SLOTS}; an existing ring keeps its own)")
    p.add_argument("--prompt-arena-tokens", type=_positive_int, default=None,
                   help=f"prompt arena capacity in tokens (default {DEFAULT_PROMPT_ARENA_TOKENS})")
    p.add_argument("--output-arena-tokens", type=_positive_int, default=None,
                   help=f"output arena capacity in tokens (default {DEFAULT_OUTPUT_ARENA_TOKENS})")
    p.add_argument("--max-batch-size", type=_positive_int, default=None,
                   help="requests decoding together at most (cpu default: as many 256-token requests as the KV cache holds, at most 256; null 256)")
    p.add_argument("--max-prefill-tokens", type=_positive_int, default=None,
                   help="prompt tokens prefilled in one step at most (cpu default 2048); longer prompts are chunked")
    p.add_argument("--block-size", type=_positive_int, default=16, help="KV cache block size in tokens")
    p.add_argument("--kv-cache-mb", type=_positive_int, default=None,
                   help="KV cache memory budget in MiB (cpu default 1024)")
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="context length (prompt + output) to serve; default the model's, capped by the KV pool")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="CPU threads for the cpu executor (default: all cores; OpenMP workers spin briefly "
                        "(GOMP_SPINCOUNT=10000) then sleep at barriers, unless OMP_WAIT_POLICY or "
                        "GOMP_SPINCOUNT is set)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="weights and KV cache; cpu executor, auto: bfloat16 where the CPU computes it "
                        "natively (avx512_bf16 / amx), else float32; cuda executors, auto: bfloat16 (the model's "
                        "own dtype, tensor-core matmuls, half the bytes of float32)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="KV cache of the cpu executor; auto: the model's dtype, except bfloat16 for quantized "
                        "weights computed in float32 (CPUs without bf16 math: half the KV bytes, as llama.cpp's "
                        "f16 cache)")
    p.add_argument("--shutdown-grace-s", type=_non_negative_float, default=2.0,
                   help="on SIGTERM, in-flight requests get this long to finish before they are aborted")
    p.add_argument("--step-ms", type=_non_negative_float, default=0.0,
                   help="--model null only: each engine step takes at least this long, like a model's decode "
                        "step (e.g. 20 = 50 tokens/s per stream); 0: as fast as possible")
    p.add_argument("--policy-trace", default=None, metavar="PATH",
                   help="record every batching decision to PATH as a policy Scenario (JSON) on exit")
    p.add_argument("--prefix-caching", "--enable-prefix-caching", dest="prefix_caching",
                   action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of a prompt prefix another request computed (default on; "
                        "--no-prefix-caching turns it off; the cuda executor's device loop caches the same way)")
    p.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs", "priority", "lvf"),
                   help="which waiting request runs first: fcfs (arrival order), priority (the request's "
                        "'priority', lower first; worse ones are preempted for better ones), lvf (SuperInfer's "
                        "Largest Virtual Lag Time first: requests lagging their TTFT/TBT targets first, long "
                        "runners rotated out); the cuda executor's device loop runs each the same way")
    p.add_argument("--ttft-slo-ms", type=_positive_int, default=5000,
                   help="time-to-first-token target of a request that names none (ttft_slo_ms), for lvf")
    p.add_argument("--tbt-slo-ms", type=_positive_int, default=100,
                   help="time-between-tokens target of a request that names none (tbt_slo_ms), for lvf")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    from . import rdma_server       # --transport shm|verbs and the RDMA bootstrap flags
    rdma_server.add_arguments(p)


# OpenMP workers spin a bounded while at barriers, then sleep: libgomp's default spin
# (300,000) lets a worker preempted by the frontend or a neighbour stall every parallel region
# of a step, fully passive waits pay a futex wake-up at each of the ~120 regions of a decode
# step (executors/cpu.py, default_threads, has the measurements). Read when torch loads
# libgomp: set before that import. An operator's OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
GOMP_SPINCOUNT = "10000"


def run(args: argparse.Namespace) -> int:
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    from . import rdma_server
    from .daemon import DaemonConfig, run_daemon
    logging.basicConfig(level=args.log_level.upper(), format="blink gpu-daemon: %(message)s")
    if args.step_ms and args.model != "null":
        print("blink gpu-daemon: --step-ms paces the null model only (--model null)", file=sys.stderr)
        return 2
    sizes = (args.slots, args.prompt_arena_tokens, args.output_arena_tokens)
    geometry = None
    if any(v is not None for v in sizes):
        try:
            geometry = RingGeometry(args.slots or DEFAULT_SLOTS,
                                    args.prompt_arena_tokens or DEFAULT_PROMPT_ARENA_TOKENS,
                                    args.output_arena_tokens or DEFAULT_OUTPUT_ARENA_TOKENS)
        except ValueError as e:
            print(f"blink gpu-daemon: {e}", file=sys.stderr)
            return 2
    options = ExecutorOptions(model=args.model, max_batch_size=args.max_batch_size,
                              max_prefill_tokens=args.max_prefill_tokens, block_size=args.block_size,
                              kv_cache_mb=args.kv_cache_mb, max_model_len=args.max_model_len,
                              threads=args.threads, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                              shutdown_grace_s=args.shutdown_grace_s,
                              policy_trace=args.policy_trace, step_ms=args.step_ms,
                              prefix_caching=args.prefix_caching, scheduling_policy=args.scheduling_policy,
                              ttft_slo_ms=args.ttft_slo_ms, tbt_slo_ms=args.tbt_slo_ms)
    try:
        rdma = rdma_server.config_from_args(args)      # before the model loads: no RDMA, one line
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    return run_daemon(DaemonConfig(ring_name=args.ring, geometry=geometry, executor=args.executor,
                                   options=options, rdma=rdma))
