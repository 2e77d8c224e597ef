"""The step graph's draw, timed on its own and checked on the device (issue 17: the sort the draw
used to run over the whole vocabulary, every step, whatever the rows asked for, was ~0.64 ms of an
8.3 ms float32 decode step at 128 rows on the H200, 2026-11-27).

    rows (the decode shapes' row counts) x sampling mixes (greedy; temperature 1 with no filter,
    the OpenAI default; top-p 0.9; top-k 50 with top-p 0.95; min_p 0.05), seeded random logits
    [rows, vocab] float32 on the device
      -> triton_ms: graphs/triton_sampler.draw (no sort: greedy rows stop after the argmax, top-k and
         top-p thresholds by a radix descent per row), CUDA events, median of `runs`
         pipelined_ms: the same kernels with PIPELINED_STAGES (tl.range's load pipeline, cp.async two
         tiles ahead; the A/B that keeps DRAW_STAGES at 1: on the H200 it was ~10% slower, 2026-11-28;
         pipelined_same: its tokens equal)
         torch_ms: graphs/sampler.draw (PyTorch's operators, the stable sort the thresholds use)
         sort_ms: that sort alone over the rows (what every step paid before, greedy rows too)
         agree: the share of rows where both draws give the same token; outside: Triton tokens the
         reference's filters drop (must be 0)
      -> a list of dicts, one per (rows, mix); a failing part costs its cell (the error recorded)
    logprobs_table: the logprob records of every row (graphs/triton_sampler.logprobs: two walks a
    row and a merge of its candidates) against PyTorch's (graphs/sampler.logprobs), timed the same way; ids compared with PyTorch's,
    ranks with the raw logits' (rank_ties: rows where PyTorch's log-softmax rounds two values equal);
    every_tile_ms: the same kernel merging every tile (LOGPROB_CANDIDATES off; the A/B that decides it)

    python -m bench.cuda_draw [--rows 1,64,128] [--vocab 49152] [--runs 20] [--out DIR]

bench.cuda_step_profile runs it beside the shapes (the plan's graphs call). On a CPU only the
PyTorch columns run (the Triton kernels need a GPU or the interpreter).
"""
from __future__ import annotations

import statistics
import time

import torch

MIXES = {  # name -> (temperature, top_p, top_k, min_p)
    "greedy": (0.0, 1.0, 0, 0.0),
    "t1": (1.0, 1.0, 0, 0.0),
    "top_p0.9": (0.7, 0.9, 0, 0.0),
    "top_k50_p0.95": (0.8, 0.95, 50, 0.0),
    "min_p0.05": (1.0, 1.0, 0, 0.05),
}
PIPELINED_STAGES = 3   # the draw's A/B: its walks with this many tl.range stages (the default is DRAW_STAGES)


def _timed(fn, runs: int, cuda: bool) -> float:
    """Median ms of fn() after one warm-up: CUDA events on a GPU, wall time on a CPU."""
    fn()
    out = []
    for _ in range(runs):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(out), 4)


def _batch(rows: int, vocab: int, mix: str, device: str, seed: int = 0):
    temp, top_p, top_k, min_p = MIXES[mix]
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=gen) * 3).to(device)
    f32 = dict(dtype=torch.float32, device=device)
    return (x, torch.full((rows,), temp, **f32), torch.full((rows,), top_p, **f32),
            torch.full((rows,), top_k, dtype=torch.int64, device=device),
            torch.randint(-2**62, 2**62, (rows,), generator=gen).to(device),
            torch.full((rows,), 7, dtype=torch.int64, device=device), torch.full((rows,), min_p, **f32))


@torch.inference_mode()
def draw_table(device: str, vocab: int, rows_list, runs: int, triton: bool | None = None) -> list[dict]:
    """One dict per (rows, mix): triton_ms, torch_ms, sort_ms, agree, outside (module docstring)."""
    from gpu_backend.graphs import sampler
    cuda = device.startswith("cuda")
    triton = cuda if triton is None else triton
    out = []
    for rows in sorted(set(rows_list)):
        for mix in MIXES:
            args = _batch(rows, vocab, mix, device)
            x, temp, top_p, top_k, seed, index, min_p = args
            row = {"rows": rows, "vocab": vocab, "mix": mix}
            want = sampler.draw(*args)
            row["torch_ms"] = _timed(lambda: sampler.draw(*args), runs, cuda)
            row["sort_ms"] = _timed(lambda: torch.sort(x, dim=-1, descending=True, stable=True), runs, cuda)
            if triton:
                try:
                    from gpu_backend.graphs import triton_sampler as ts
                    got = ts.draw(*args)
                    row["triton_ms"] = _timed(lambda: ts.draw(*args), runs, cuda)
                    # the same kernels with tl.range's load pipeline: the A/B that decides
                    # triton_sampler.DRAW_STAGES; the tokens must not move
                    row["pipelined_ms"] = _timed(lambda: ts.draw(*args, stages=PIPELINED_STAGES), runs, cuda)
                    row["pipelined_same"] = bool(torch.equal(ts.draw(*args, stages=PIPELINED_STAGES), got))
                    row["agree"] = round(float((got == want).float().mean()), 4)
                    probs, order = sampler.filtered_sorted(x, temp, top_p, top_k, min_p)
                    kept = torch.zeros_like(probs).scatter_(1, order, probs) > 0
                    sampled = temp >= sampler.MIN_TEMPERATURE
                    row["outside"] = int((~kept.gather(1, got[:, None])[:, 0] & sampled).sum())
                except Exception as e:         # noqa: BLE001 - recorded in the result
                    row["triton_error"] = f"{type(e).__name__}: {e}"[:300]
            out.append(row)
            print(f"  draw {rows:>4} rows {mix:<14} triton {row.get('triton_ms', '-')} ms  torch {row['torch_ms']} ms  "
                  f"sort {row['sort_ms']} ms  agree {row.get('agree', '-')}", flush=True)
    return out


@torch.inference_mode()
def logprobs_table(device: str, vocab: int, rows_list, runs: int, triton: bool | None = None) -> list[dict]:
    """One dict per row count: the logprob records of every row (each asked for), triton_ms
    (triton_sampler.logprobs: two walks a row, its candidates merged) against torch_ms (sampler.logprobs: log_softmax,
    gather, compare-and-sum, torch.topk), and whether ranks and ids agree."""
    from gpu_backend.graphs import sampler
    cuda = device.startswith("cuda")
    triton = cuda if triton is None else triton
    k = min(sampler.TOP_LOGPROBS, vocab)
    out = []
    for rows in sorted(set(rows_list)):
        gen = torch.Generator().manual_seed(rows)
        raw = (torch.randn(rows, vocab, generator=gen) * 3).to(device)
        tokens = torch.randint(0, vocab, (rows,), generator=gen).to(device)
        row = {"rows": rows, "vocab": vocab, "torch_ms": _timed(lambda: sampler.logprobs(raw, tokens, k), runs, cuda)}
        if triton:
            try:
                from gpu_backend.graphs import triton_sampler as ts
                want = torch.ones(rows, dtype=torch.int64, device=device)
                got, ref = ts.logprobs(raw, tokens, k, want), sampler.logprobs(raw, tokens, k)
                row["triton_ms"] = _timed(lambda: ts.logprobs(raw, tokens, k, want), runs, cuda)
                # ranks are counted on the raw logits (the kernel's rule, docs/cuda.md), PyTorch's on the
                # log-softmax, where two raw values within rounding of each other can tie: compare with
                # the raw rule, and count the rows where the log-softmax tie moves PyTorch's rank
                raw_rank = (raw > raw.gather(1, tokens[:, None])).sum(-1) + 1
                row["same_ranks_ids"] = bool(torch.equal(got[1], raw_rank) and torch.equal(got[2], ref[2]))
                row["rank_ties"] = int((raw_rank != ref[1]).sum())
                # every tile merged (LOGPROB_CANDIDATES off): the A/B that decides it; the records must not move
                every = ts.logprobs(raw, tokens, k, want, candidates=False)
                row["every_tile_ms"] = _timed(lambda: ts.logprobs(raw, tokens, k, want, candidates=False), runs, cuda)
                row["every_tile_same"] = all(bool(torch.equal(x, y)) for x, y in zip(got, every))
                row["max_value_diff"] = float((got[3] - ref[3]).abs().max())
            except Exception as e:             # noqa: BLE001 - recorded in the result
                row["triton_error"] = f"{type(e).__name__}: {e}"[:300]
        out.append(row)
        print(f"  logprobs {rows:>4} rows  triton {row.get('triton_ms', '-')} ms  torch {row['torch_ms']} ms", flush=True)
    return out


def logprobs_markdown(table: list[dict]) -> list[str]:
    if not table:
        return []
    lines = ["", f"The logprob records alone, every row asking (seeded random logits [rows, {table[0]['vocab']}]): "
             "the fused kernel (two walks a row and a merge of its candidates; rows not asking are skipped in a "
             "step) against PyTorch's operators:",
             "", "| rows | Triton logprobs ms | every tile merged ms | PyTorch logprobs ms | ranks (raw logits) and ids "
             "the same | rows where PyTorch's log-softmax ties move the rank | largest value difference | "
             "every-tile records the same |", "|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['rows']} | {r.get('triton_ms', r.get('triton_error', '-'))} | {r.get('every_tile_ms', '-')} | "
                     f"{r['torch_ms']} | {r.get('same_ranks_ids', '-')} | {r.get('rank_ties', '-')} | "
                     f"{r.get('max_value_diff', '-')} | {r.get('every_tile_same', '-')} |")
    return lines


def markdown(table: list[dict]) -> list[str]:
    """The draw's table for a result file."""
    if not table:
        return []
    lines = ["", f"The draw alone (bench/cuda_draw.py), seeded random logits [rows, {table[0]['vocab']}] float32: "
             "Triton's (no sort), PyTorch's (graphs/sampler.draw) and the sort every step ran before; `agree`: "
             "rows where both give the same token, `outside`: Triton tokens the filters drop (must be 0):", "",
             f"| rows | mix | Triton draw ms | {PIPELINED_STAGES}-stage pipeline ms | PyTorch draw ms | sort alone ms | "
             f"agree | outside | pipelined tokens the same |", "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['rows']} | {r['mix']} | {r.get('triton_ms', r.get('triton_error', '-'))} | "
                     f"{r.get('pipelined_ms', '-')} | {r['torch_ms']} | {r['sort_ms']} | {r.get('agree', '-')} | "
                     f"{r.get('outside', '-')} | {r.get('pipelined_same', '-')} |")
    return lines


def main(argv=None) -> int:
    """The two tables alone, on the first GPU (or the CPU: PyTorch's columns), as a result file."""
    import argparse
    import json
    import pathlib
    from .machine_label import machine_label
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,64,128", help="row counts, comma-separated")
    ap.add_argument("--vocab", type=int, default=49152, help="columns (SmolLM2's vocabulary)")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--out", default="", help="folder for <date>-<device>-cuda_draw.{json,md}")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [int(r) for r in args.rows.split(",") if r]
    res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
           "draw": draw_table(device, args.vocab, rows, args.runs),
           "logprobs": logprobs_table(device, args.vocab, rows, args.runs)}
    md = [f"# The draw and the logprob records alone: {res['device']}", "",
          f"torch {res['torch']}; medians of {args.runs} runs after a warm-up.", *markdown(res["draw"]),
          *logprobs_markdown(res["logprobs"]), "", f"Reproduce: `python -m bench.cuda_draw --rows {args.rows} --vocab {args.vocab} --runs {args.runs}`."]
    print("\n".join(md))
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        machine = "cpu" if device == "cpu" else machine_label("auto", res["device"])
        stem = f"{time.strftime('%Y-%m-%d')}-{machine}-cuda_draw"
        (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
        (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
