"""Kernels one step graph launches, counted on a CPU, for each kind of step kernels (issue 17: a
SmolLM2 step on a GPU is mostly its kernels' launch gaps, so their number is the figure to cut).

    model (random:smollm2) + bench.cuda_step_profile.Profiler's buffers for one shape
      -> "torch": the step's top-level PyTorch operators that launch kernels (the profiler; views,
         no-op casts and allocations left out)
      -> "triton": the same, plus one per Triton kernel launch; here the Triton kernels are
         counted, not run (Triton's interpreter would add operators of its own), so that step's
         outputs are not computed
      -> one line per kind, and the operators and kernels behind each count

    python -m bench.step_kernel_count [--decode 64x256] [--model random:smollm2]

On a GPU, bench.cuda_step_profile counts the kernels the device ran (its profile table).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch


def count(step, shape) -> tuple[int, collections.Counter]:
    """(launches, by name) of one run of step on shape: launching operators (+ Triton kernels)."""
    from torch.profiler import ProfilerActivity, profile

    from .cuda_step_profile import NO_KERNEL
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        step.run(shape)
    by = collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::") and e.name not in NO_KERNEL
                             and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
    return sum(by.values()), by


class _Counted:
    """A Triton kernel whose launches are counted instead of run."""

    def __init__(self, name: str, kernel, seen: collections.Counter):
        self.name, self.seen = name, seen
        # the draw's output: valid token ids for the logprobs that follow (set by numpy: no operator counted)
        self.tokens_at = kernel.arg_names.index("tokens_ptr") if "tokens_ptr" in kernel.arg_names else None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen[self.name] += 1
            if self.tokens_at is not None:
                args[self.tokens_at].numpy()[:] = 0
        return launch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:smollm2")
    ap.add_argument("--decode", default="64x256", help="RxC: rows x context of the decode step")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")         # the kernels' module imports without a GPU
    from gpu_backend.graphs import triton_kernels as tk
    from gpu_backend.graphs import triton_sampler as ts
    from gpu_backend.graphs.device import load_graph_model
    from gpu_backend.graphs.step import StepFunction

    from .cuda_step_profile import Profiler, parse_shapes
    config, model = load_graph_model(args.model, torch.float32, "cpu")
    prof = Profiler(model, config, parse_shapes(args.decode, "decode"), [], "cpu", kernels="torch")
    g = prof.shapes[0]
    prof.stage(g)
    n, by = count(prof.step, g)
    print(f"kernels a step of {g}, torch: {n} ({', '.join(f'{k} {v}' for k, v in by.most_common(8))}, ...)")
    seen: collections.Counter = collections.Counter()
    kernels = {(mod, name): getattr(mod, name) for mod in (tk, ts)
               for name in vars(mod) if name.startswith("_") and name.endswith("_kernel")}
    try:
        for (mod, name), kernel in kernels.items():
            setattr(mod, name, _Counted(name, kernel, seen))
        step = StepFunction(model, prof.pool, prof.buffers, prof.plan, kernels="triton")
        prof.stage(g)
        step.run(g)                                         # warm (first-call allocations)
        seen.clear()
        n, by = count(step, g)
    finally:
        for (mod, name), kernel in kernels.items():
            setattr(mod, name, kernel)
    print(f"kernels a step of {g}, triton: {n + sum(seen.values())} ({n} PyTorch operators: "
          f"{', '.join(f'{k} {v}' for k, v in by.most_common(6))}, ...; {sum(seen.values())} Triton: "
          f"{', '.join(f'{k} {v}' for k, v in seen.most_common())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
