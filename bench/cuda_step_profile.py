"""Where a step graph's time goes, shape by shape (issue 17: the Fig. 3 ratio is the host loop's
per-step overhead against this time, so it is the number that decides it).

    model (random:smollm2 by default: SmolLM2's shape, seeded random weights made where it runs)
      + the graph cache's pieces for the chosen shapes: BucketTable, CapturePlan (attention row
        groups), GraphKVPool, StaticBuffers, StepFunction (the code every step graph captures)
      -> per shape (rows x len, ctx): the static buffers staged as a full step of that shape
         would be (every row at the whole context: positions, distinct KV blocks, slot mapping,
         greedy rows on the sink seat), then
           parts (eager, synchronised, median of --runs): forward (embedding, layers with the
             paged attention, final norm), logits (the head over each row's last token), sample
             (sampler.sample_step: processors, filtering, draw, logprobs)
           step (eager): StepFunction.run, what one graph replays; the same for the baseline (the
             model unfused, explicit RMSNorm operations, explicit attention), the A/B
           graph (CUDA only): torch.cuda.CUDAGraph of StepFunction.run replayed --runs times,
             CUDA events: the device's own time of a step, no launch or scheduler in it
      -> profile of one shape (--profile, default the largest decode shape): torch.profiler over
         3 eager steps, the 15 largest kernels by device time (on a CPU the operators by CPU
         time) and the kernels a step launches; a capture or a profiler that fails costs its
         column or table (the error is recorded), not the run
      -> the draw alone at the decode shapes' row counts, each sampling mix, and the logprob
         records of every row (bench/cuda_draw.py)
      -> OUT/<date>-<machine>-cuda_step_profile.json + .md

    python -m bench.cuda_step_profile [--out DIR] [--decode 1x256,128x1024] [--prefill 16x128x512]
    python -m bench.cuda_step_profile --device cpu --quick     (the rehearsal's run, and CI's)

On a CPU the same code runs eagerly (no graph column): that is how CI checks this script before a
GPU ever runs it.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import torch

from .machine_label import machine_label

DATE = time.strftime("%Y-%m-%d", time.gmtime())
REPO = pathlib.Path(__file__).resolve().parents[1]
BLOCK = 16
# bench.cuda_graphs' conditions: its buckets put 1-64 running rows on the 1 / 8 / 32 / 128-row
# decode graphs at ctx 256, and contexts past 256 on the max context (--max-model-len 1024); 1 and 8 rows
# at 1,024 split their decode attention along the context on a GPU (timed split and unsplit)
DECODE = "1x256,8x256,32x256,128x256,1x1024,8x1024,64x1024,128x1024"
PREFILL = "1x128x512,16x128x512"
QUICK_DECODE, QUICK_PREFILL = "1x64,4x128", "2x32x64"
QUICK_ROWS, QUICK_CTX = 4, 128    # --quick caps shapes given explicitly too (the rehearsal's dry run of a stage)
TOP = 15
# operators that launch no kernel (views, metadata, dtype no-ops): left out of the launching count
NO_KERNEL = frozenset(f"aten::{n}" for n in (
    "view", "reshape", "permute", "expand", "slice", "select", "as_strided", "split", "unsqueeze", "t",
    "transpose", "detach", "alias", "empty", "_unsafe_view", "split_with_sizes", "narrow", "empty_strided", "empty_like",
    "lift_fresh", "resolve_conj", "resolve_neg", "squeeze", "unflatten", "expand_as", "view_as", "result_type",
    "item", "_local_scalar_dense", "is_nonzero", "chunk", "unbind", "to"))


def quick_shapes(text: str) -> str:
    """Shapes "RxC,..." / "RxSxC,..." with rows capped at QUICK_ROWS and every length at QUICK_CTX, in
    order, duplicates dropped: a stage's own shapes made small enough for a CPU's dry run of its code
    (the bf16 step profile's 128x256 took over its 60 s budget on an AVX2-only CPU without bf16 math)."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        parts = item.split("x")
        if not all(p.isdigit() for p in parts):
            out.append(item)                   # parse_shapes says what is wrong with it
            continue
        small = [min(int(parts[0]), QUICK_ROWS)] + [min(int(p), QUICK_CTX) for p in parts[1:]]
        out.append("x".join(map(str, small)))
    return ",".join(dict.fromkeys(out))


def parse_shapes(text: str, kind: str) -> list[tuple[int, int, int]]:
    """"RxC,..." (decode) or "RxSxC,..." (prefill) -> [(rows, len, ctx)]; ctx rounded up to whole blocks."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        parts = item.split("x")
        want = 2 if kind == "decode" else 3
        if len(parts) != want or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"bench.cuda_step_profile: bad {kind} shape {item!r} "
                             f"({'RxC' if kind == 'decode' else 'RxSxC'}, positive integers)")
        r, s, c = (int(parts[0]), 1, int(parts[1])) if kind == "decode" else tuple(map(int, parts))
        c = -(-c // BLOCK) * BLOCK
        if s > c:
            raise SystemExit(f"bench.cuda_step_profile: prefill shape {item!r}: len above its context")
        out.append((r, s, c))
    return out


class Profiler:
    """The graph cache's pieces for a set of shapes, on one device."""

    def __init__(self, model, config, decode, prefill, device: str, baseline_model=None, kernels: str = "auto"):
        from gpu_backend.graphs.buckets import BucketConfig, BucketTable
        from gpu_backend.graphs.plan import CapturePlan
        from gpu_backend.graphs.step import GraphKVPool, KVShape, StaticBuffers, StepFunction
        self.model, self.config, self.device = model, config, device
        rows = max(r for r, _, _ in decode + prefill)
        ctx = max(c for _, _, c in decode + prefill)
        tokens = max([r * s for r, s, _ in prefill] or [1])
        buckets = BucketConfig(
            max_batch_size=max(r for r, _, _ in decode) if decode else 1, max_prefill_tokens=max(tokens, BLOCK),
            max_model_len=ctx, block_size=BLOCK, split_len=max([s for _, s, _ in prefill] or [BLOCK]),
            len_granularity=BLOCK, prefill_rows=tuple(sorted({r for r, _, _ in prefill})) or (1,),
            prefill_lens=tuple(sorted({s for _, s, _ in prefill})) or (BLOCK,),
            prefill_ctxs=tuple(sorted({c for _, _, c in prefill})) or (ctx,),
            decode_rows=tuple(sorted({r for r, _, _ in decode})) or (1,),
            decode_ctxs=tuple(sorted({c for _, _, c in decode})) or (ctx,))
        self.table = BucketTable(buckets)
        by_key = {(g.kind, g.rows, g.len, g.ctx): g for g in self.table.shapes}
        from gpu_backend.graphs.buckets import KIND_DECODE, KIND_PREFILL
        self.shapes = [by_key[(KIND_DECODE, *k)] for k in decode] + [by_key[(KIND_PREFILL, *k)] for k in prefill]
        self.num_blocks = rows * ctx // BLOCK                      # every row its own blocks
        dtype_bytes = torch.finfo(model.dtype).bits // 8
        self.plan = CapturePlan(self.table, config, dtype_bytes=dtype_bytes)
        self.pool = GraphKVPool(KVShape.of(config, self.num_blocks, BLOCK), model.dtype, device)
        self.buffers = StaticBuffers(self.plan.static_sizes(), device)
        self.step = StepFunction(model, self.pool, self.buffers, self.plan, kernels=kernels)
        # where the served step takes the fused Triton kernels (a GPU), the same model with PyTorch's
        # operators beside it: the A/B of the kernels alone
        self.torch_step = None if self.step.kernels == "torch" else StepFunction(
            model, self.pool, self.buffers, self.plan, kernels="torch")
        # where the served step's prefill takes PyTorch's operators ("auto" on a GPU), the Triton kernels'
        # prefill beside it: the A/B that decides it
        self.triton_step = None if self.step.kernels != "triton" or self.step.prefill_kernels == "triton" else \
            StepFunction(model, self.pool, self.buffers, self.plan, kernels="triton")
        # the A/B: the step as it was before the kernel-count work (projections unfused, explicit
        # RMSNorm operations, attention as matmul / mask / softmax / matmul), same buffers and pool
        self.base_step = None if baseline_model is None else StepFunction(
            baseline_model, self.pool, self.buffers, self.plan, attention="explicit")
        torch.manual_seed(0)
        self.pool.k.normal_(0, 1)      # cached K/V of the contexts the rows attend over
        self.pool.v.normal_(0, 1)

    def stage(self, g) -> None:
        """The buffers as the graph's first kernel leaves them for a step of shape g at full context."""
        b, r, s, c = self.buffers, g.rows, g.len, g.ctx
        per = c // BLOCK
        tables = torch.arange(r * per, dtype=torch.int64).view(r, per)                    # [R, C/bs]
        first = c - s                                                                      # the row's first query
        pos = first + torch.arange(s, dtype=torch.int64).repeat(r, 1)                     # [R, S]
        slots = tables.gather(1, pos // BLOCK) * BLOCK + pos % BLOCK                      # [R, S]
        gen = torch.Generator().manual_seed(1)
        b.input_ids[:r * s].copy_(torch.randint(0, self.config.vocab_size, (r * s,), generator=gen))
        b.positions[:r * s].copy_(pos.reshape(-1))
        b.slot_mapping[:r * s].copy_(slots.reshape(-1))
        b.block_tables[:r * per].copy_(tables.reshape(-1))
        b.q_lens[:r].fill_(s)
        b.temperature[:r].zero_()                                                          # greedy
        b.seat[:r].fill_(b.seats.sink)
        b.lp_want[:r].zero_()            # no row's logprob record read, as in Fig. 3 (the fused step skips them)

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def _timed(self, fn, runs: int) -> float:
        """Median ms of fn() over `runs` calls after one warm-up, synchronised around each."""
        fn()
        out = []
        for _ in range(runs):
            self._sync()
            t0 = time.perf_counter()
            fn()
            self._sync()
            out.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(out)

    @torch.inference_mode()
    def parts(self, g, runs: int) -> dict:
        from gpu_backend.graphs.sampler import sample_step
        from gpu_backend.graphs.step import GraphAttention
        b, r, s = self.buffers, g.rows, g.len
        last = torch.arange(r, device=self.device) * s + (b.q_lens[:r] - 1)
        hidden = self.step.forward(g)
        rows = hidden.index_select(0, last)
        logits = self.model.compute_logits(rows)
        return {"forward_ms": self._timed(lambda: self.step.forward(g), runs),
                "logits_ms": self._timed(lambda: self.model.compute_logits(rows), runs),
                "sample_ms": self._timed(lambda: sample_step(logits, b.row_params.view(r), b.seats, self.step.kernels),
                                         runs),
                "step_ms": self._timed(lambda: self.step.run(g), runs),
                "row_group": "-" if (self.step.kernels if g.len == 1 else self.step.prefill_kernels) == "triton"
                else GraphAttention(self.pool, b, g, self.plan.row_group(g)).group}

    @torch.inference_mode()
    def base_step_ms(self, g, runs: int) -> float:
        """Median ms of the baseline's eager step."""
        return self._timed(lambda: self.base_step.run(g), runs)

    def graph_ms(self, g, runs: int, step=None) -> float | None:
        """Median device ms of one replay of the captured step (CUDA events), or None on a CPU."""
        if not self.device.startswith("cuda"):
            return None
        step = step or self.step
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step.run(g)                    # warm-up outside the capture (cuBLAS, sort temporaries)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step.run(g)
        graph.replay()
        out = []
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        del graph
        torch.cuda.empty_cache()
        return statistics.median(out)

    @torch.inference_mode()
    def profile(self, g, steps: int = 3, step=None) -> dict:
        from torch.profiler import ProfilerActivity, profile
        cuda = self.device.startswith("cuda")
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        step = step or self.step
        step.run(g)
        self._sync()
        with profile(activities=acts) as prof:
            for _ in range(steps):
                step.run(g)
            self._sync()
        events = prof.key_averages()

        def dev_us(e) -> float:
            return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0)

        # on a GPU the kernels themselves (an operator's self device time is its kernels' again);
        # on a CPU the operators by their own CPU time
        kernel_events = [e for e in events if dev_us(e) > 0 and not e.key.startswith("aten::")] if cuda else []
        key = dev_us if cuda else (lambda e: float(e.self_cpu_time_total))
        top = sorted(kernel_events if cuda else events, key=key, reverse=True)[:TOP]
        kernels = sum(e.count for e in kernel_events)
        ops = sum(e.count for e in events if e.key.startswith("aten::"))
        # operators called from outside aten (the model's own calls), less those that launch nothing:
        # on a CPU the count of what would be kernel launches on a GPU
        launching = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.name not in NO_KERNEL
                        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
        return {"shape": str(g), "steps": steps, "clock": "device" if cuda else "cpu",
                "kernels_per_step": round(kernels / steps, 1) if cuda else None,
                "aten_ops_per_step": round(ops / steps, 1),
                "launching_ops_per_step": round(launching / steps, 1),
                "top": [{"name": e.key[:90], "calls_per_step": round(e.count / steps, 1),
                         "ms_per_step": round(key(e) / 1e3 / steps, 4)} for e in top]}


def run(args) -> dict:
    from gpu_backend.graphs import fused_forward
    from gpu_backend.graphs import triton_kernels as tk
    from gpu_backend.graphs.device import load_graph_model
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    decode_text = QUICK_DECODE if args.quick and args.decode is None else args.decode or DECODE
    prefill_text = QUICK_PREFILL if args.quick and args.prefill is None else (
        PREFILL if args.prefill is None else args.prefill)
    if args.quick:
        decode_text, prefill_text = quick_shapes(decode_text), quick_shapes(prefill_text)
        if args.profile:
            args.profile = quick_shapes(args.profile)
    decode, prefill = parse_shapes(decode_text, "decode"), parse_shapes(prefill_text, "prefill")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    t0 = time.perf_counter()
    config, model = load_graph_model(args.model, dtype, device)
    base = load_graph_model(args.model, dtype, device, fuse=False)[1] if args.baseline else None
    prof = Profiler(model, config, decode, prefill, device, base, kernels=args.kernels)
    res = {"date": DATE, "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
           "model": args.model, "dtype": args.dtype, "runs": args.runs, "torch": torch.__version__,
           "kernels": prof.step.kernels, "prefill_kernels": prof.step.prefill_kernels,
           "kv_pool_mib": round(prof.pool.nbytes / 2**20, 1), "setup_s": round(time.perf_counter() - t0, 1),
           "shapes": []}
    for g in prof.shapes:
        prof.stage(g)
        row = {"shape": str(g), "rows": g.rows, "len": g.len, "ctx": g.ctx, **prof.parts(g, args.runs)}
        try:                                   # a capture that fails costs this column, not the run
            row["graph_ms"] = prof.graph_ms(g, args.runs)
        except Exception as e:                 # noqa: BLE001 - recorded in the result
            row["graph_ms"], row["graph_error"] = None, f"{type(e).__name__}: {e}"[:300]
        splits = (fused_forward.decode_splits(g.rows, g.ctx, model, torch.device(device), BLOCK)
                  if g.len == 1 and prof.step.kernels == "triton" else 1)
        row["splits"] = splits
        if splits > 1:                         # the split decode attention's A/B: the same step unsplit
            os.environ[tk.SPLIT_ENV] = "0"
            try:
                row["unsplit_graph_ms"] = prof.graph_ms(g, args.runs)
            except Exception as e:             # noqa: BLE001 - recorded in the result
                row["unsplit_graph_ms"], row["graph_error"] = None, f"unsplit {type(e).__name__}: {e}"[:300]
            finally:
                os.environ.pop(tk.SPLIT_ENV)
        if prof.torch_step is not None:        # the same model on PyTorch's operators: the kernels' A/B
            try:
                row["torch_graph_ms"] = prof.graph_ms(g, args.runs, prof.torch_step)
            except Exception as e:             # noqa: BLE001 - recorded in the result
                row["torch_graph_ms"], row["graph_error"] = None, f"torch ops {type(e).__name__}: {e}"[:300]
        if prof.triton_step is not None and g.len > 1:   # a prefill served on PyTorch's operators: Triton's
            try:
                row["triton_graph_ms"] = prof.graph_ms(g, args.runs, prof.triton_step)
            except Exception as e:             # noqa: BLE001 - recorded in the result
                row["triton_graph_ms"], row["graph_error"] = None, f"triton {type(e).__name__}: {e}"[:300]
        if prof.base_step is not None:
            row["base_step_ms"] = prof.base_step_ms(g, args.runs)
            try:
                row["base_graph_ms"] = prof.graph_ms(g, args.runs, prof.base_step)
            except Exception as e:             # noqa: BLE001 - recorded in the result
                row["base_graph_ms"], row["graph_error"] = None, f"baseline {type(e).__name__}: {e}"[:300]
        row = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
        res["shapes"].append(row)
        print(f"  {row['shape']:<28} step {row['step_ms']:9.3f} ms  graph {row['graph_ms']} ms  "
              f"(forward {row['forward_ms']}, logits {row['logits_ms']}, sample {row['sample_ms']})", flush=True)
    if args.draw:                              # the draw alone, at the decode shapes' row counts
        from . import cuda_draw
        try:
            rows = [min(r, 4) if args.quick else r for r, _, _ in decode] or [1]     # quick: the CPU's dry run
            res["draw"] = cuda_draw.draw_table(device, config.vocab_size, rows, args.runs,
                                               triton=prof.step.kernels == "triton")
            res["logprobs"] = cuda_draw.logprobs_table(device, config.vocab_size, rows, args.runs,
                                                       triton=prof.step.kernels == "triton")
        except Exception as e:                 # noqa: BLE001 - recorded in the result
            res["draw_error"] = f"{type(e).__name__}: {e}"[:300]
    want = args.profile or str(max((g for g in prof.shapes if g.len == 1), key=lambda g: (g.rows, g.ctx),
                                   default=prof.shapes[-1]))
    target = next((g for g in prof.shapes if str(g) == want or f"{g.rows}x{g.ctx}" == want), None)
    if target is None:
        raise SystemExit(f"bench.cuda_step_profile: --profile {want!r} is not one of the shapes")
    prof.stage(target)
    try:                                       # the profiler (CUPTI on a GPU) failing costs its table only
        res["profile"] = prof.profile(target)
    except Exception as e:                     # noqa: BLE001 - recorded in the result
        res["profile"] = {"shape": str(target), "error": f"{type(e).__name__}: {e}"[:300]}
    if prof.torch_step is not None:
        try:
            res["torch_profile"] = prof.profile(target, step=prof.torch_step)
        except Exception as e:                 # noqa: BLE001 - recorded in the result
            res["torch_profile"] = {"shape": str(target), "error": f"{type(e).__name__}: {e}"[:300]}
    if prof.base_step is not None:
        try:
            res["base_profile"] = prof.profile(target, step=prof.base_step)
        except Exception as e:                 # noqa: BLE001 - recorded in the result
            res["base_profile"] = {"shape": str(target), "error": f"{type(e).__name__}: {e}"[:300]}
    return res


def write_results(res: dict, out_dir: pathlib.Path, machine: str) -> pathlib.Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{DATE}-{machine}-cuda_step_profile"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
    p = res["profile"]
    lines = [f"# Step graphs, shape by shape: {machine} ({res['device']})", "",
             f"Model {res['model']} ({res['dtype']}), torch {res['torch']}, step kernels {res.get('kernels', 'torch')}, "
             f"every row at its whole context, greedy, no row asking logprobs (the fused logprobs skip them; "
             f"PyTorch's operators compute every row's); "
             f"medians of {res['runs']} runs after a warm-up. Eager parts are synchronised around each call; "
             f"`graph` is one replay of the captured step (CUDA events), the device's own time of a step.", "",
             "Where a decode step splits its attention along the context (`splits` > 1: few rows, long context, "
             "graphs/triton_kernels.decode_splits), `unsplit graph ms` is the same step captured with "
             "`BLINK_DECODE_SPLIT=0`.", "",
             "| shape | graph ms | eager step ms | forward ms | logits ms | sample ms | attention row group | "
             "splits | unsplit graph ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["shapes"]:
        lines.append(f"| {r['shape']} | {r['graph_ms'] if r['graph_ms'] is not None else '-'} | {r['step_ms']} | "
                     f"{r['forward_ms']} | {r['logits_ms']} | {r['sample_ms']} | {r['row_group']} | "
                     f"{r.get('splits', 1)} | {r.get('unsplit_graph_ms', '-')} |")
    kernels = res.get("kernels", "torch")
    if any("base_step_ms" in r for r in res["shapes"]):
        bp, tp = res.get("base_profile", {}), res.get("torch_profile")
        tt = any("triton_graph_ms" in r for r in res["shapes"])   # prefill served on PyTorch's operators
        count = "kernels_per_step" if p.get("kernels_per_step") is not None else "launching_ops_per_step"
        served = ("the fused Triton kernels (graphs/fused_forward.py)" + (
                      "; prefill steps on PyTorch's operators, with `Triton graph ms` the same prefill on the Triton "
                      "kernels" if tt else "") if kernels == "triton" else
                  "PyTorch's operators: projections fused, F.rms_norm, attention by scaled_dot_product_attention "
                  "with one mask a step")
        lines += ["", f"A/B in this run: the step as served ({served})"
                  + (", the same model on PyTorch's operators (projections fused, F.rms_norm, SDPA)" if tp else "")
                  + " and the baseline (unfused, explicit norm operations, matmul / mask / softmax / matmul):", "",
                  "| shape | graph ms | " + ("PyTorch ops graph ms | " if tp else "") + ("Triton graph ms | " if tt else "")
                  + "baseline graph ms | eager step ms | baseline eager step ms |",
                  "|---|---|---|---|---|" + ("---|" if tp else "") + ("---|" if tt else "")]

        def ms(v):
            return v if v is not None else "-"
        for r in res["shapes"]:
            lines.append(f"| {r['shape']} | {ms(r['graph_ms'])} | " + (f"{ms(r.get('torch_graph_ms'))} | " if tp else "")
                         + (f"{ms(r.get('triton_graph_ms'))} | " if tt else "")
                         + f"{ms(r.get('base_graph_ms'))} | {r['step_ms']} | {r['base_step_ms']} |")
        if "error" not in p and "error" not in bp:
            lines += ["", f"{count.replace('_', ' ')} of {p['shape']}: {p[count]} as served"
                      + (f", {tp.get(count)} on PyTorch's operators" if tp and "error" not in tp else "")
                      + f", {bp.get(count)} baseline."
                      + (" (On a CPU the Triton kernels run in Triton's interpreter, whose own operators count here.)"
                         if kernels == "triton" and p.get("clock") == "cpu" else "")]
    from .cuda_draw import logprobs_markdown
    from .cuda_draw import markdown as draw_markdown
    lines += draw_markdown(res.get("draw", [])) + logprobs_markdown(res.get("logprobs", []))
    lines += ["", f"The draw's table failed: {res['draw_error']}"] if "draw_error" in res else []
    errors = [f"{r['shape']}: {r['graph_error']}" for r in res["shapes"] if r.get("graph_error")]
    lines += ["", f"Capture failed: {'; '.join(errors)}"] if errors else []
    if "error" in p:
        lines += ["", f"Profile of {p['shape']} failed: {p['error']}"]
    else:
        cuda = p["clock"] == "device"
        lines += ["", f"Profile of {p['shape']} over {p['steps']} eager steps ({p['clock']} time): "
                  f"{p['kernels_per_step'] if cuda else '-'} kernels, "
                  f"{p['aten_ops_per_step']} aten operators a step (nested ones included), "
                  f"{p['launching_ops_per_step']} of them called by the model and launching kernels.", "",
                  f"| {'kernel' if cuda else 'operator'} | calls a step | ms a step |", "|---|---|---|"]
        lines += [f"| `{t['name']}` | {t['calls_per_step']} | {t['ms_per_step']} |" for t in p["top"]]
    lines += ["", "Reproduce: `python -m bench.cuda_step_profile` (on a CPU: `--device cpu --quick`)."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return stem


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machine", default="auto", help="result files' label; auto: the card's model, or cpu")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "bench" / "results"))
    ap.add_argument("--model", default="random:smollm2")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--device", default="auto", help="cuda, cpu, or auto (cuda where there is one)")
    ap.add_argument("--decode", default=None, help=f"decode shapes RxC (default {DECODE})")
    ap.add_argument("--prefill", default=None, help=f"prefill shapes RxSxC (default {PREFILL}; '' for none)")
    ap.add_argument("--profile", default=None, help="the shape to profile (its printed name, or RxC of a decode "
                                                    "shape); default the largest decode shape")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--kernels", default="auto", choices=("auto", "triton", "torch"),
                    help="the served step's forward (graphs/fused_forward.py); auto: Triton's on a GPU, with the "
                         "same model on PyTorch's operators beside it")
    ap.add_argument("--no-baseline", dest="baseline", action="store_false",
                    help="skip the A/B against the step before the kernel-count work")
    ap.add_argument("--no-draw", dest="draw", action="store_false",
                    help="skip the draw's table (bench/cuda_draw.py: the draw alone, each sampling mix)")
    ap.add_argument("--quick", action="store_true", help=f"small shapes ({QUICK_DECODE}; {QUICK_PREFILL}; shapes given "
                                                         f"capped at {QUICK_ROWS} rows and {QUICK_CTX} positions), 3 runs")
    args = ap.parse_args(argv)
    if args.quick:
        args.runs = min(args.runs, 3)
    res = run(args)
    machine = "cpu" if args.machine == "auto" and res["device"] == "cpu" else machine_label(args.machine, res["device"])
    stem = write_results(res, pathlib.Path(args.out), machine)
    print(stem.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
