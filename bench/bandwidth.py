"""Memory-bandwidth probe: a STREAM-style triad with the daemon's threads, and the decode
speed it allows.

    triad_gb_s(threads): a = b + s * c over float32 arrays far larger than the last-level
    cache (torch's OpenMP threads, best of several passes; 3 arrays of bytes moved a pass)
    weight_bytes_per_token(model): the bytes one decode step reads from its weights: every
    projection (GGUF blocks, or float weights) and the logits head; embeddings read one row
    -> decode_bound_tok_s = bandwidth / bytes: what one stream could reach if decode did
       nothing but stream its weights once; a measured 1-stream decode / that bound is the
       fraction of the bandwidth limit it reaches (issue 21 asks for >= 0.6)

    python -m bench.bandwidth [--threads N] [--mb 256]

`blink bench` with blink on the default model runs probe() before its sweep (the machine as the
servers find it) and its report gives blink's 1-stream decode (1 / TPOT p50) as decode_fraction
of that bound.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn


def triad_gb_s(threads: int | None = None, mb: int = 256, passes: int = 5) -> float:
    """Best-of-`passes` triad bandwidth in GB/s (1e9 bytes) over arrays of `mb` MiB each."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        n = mb * 2**20 // 4
        b, c, a = torch.rand(n), torch.rand(n), torch.empty(n)
        torch.add(b, c, alpha=3.0, out=a)                   # touch every page once
        best = float("inf")
        for _ in range(passes):
            t = time.perf_counter()
            torch.add(b, c, alpha=3.0, out=a)
            best = min(best, time.perf_counter() - t)
        return 3 * n * 4 / best / 1e9
    finally:
        torch.set_num_threads(before)


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights a decode step streams: each matmul's weight (quantized blocks count
    their bytes) and the logits head; norms and biases are small and counted; the embedding
    table is not (one row a token), unless it is also the (tied, float) logits head."""
    total = 0
    seen: set[int] = set()
    head = getattr(model, "logits_head", None)
    for mod in list(model.modules()) + ([head] if head is not None else []):
        blocks = (mod.block_tensors() if hasattr(mod, "block_tensors")       # QuantKernelLinear, FloatActHead
                  else [seg.blocks for seg in getattr(mod, "segments", []) or []])       # QuantLinear
        for b in blocks:
            if id(b) not in seen:
                seen.add(id(b))
                total += b.numel()
        if isinstance(mod, nn.Embedding):
            continue
        weight = getattr(mod, "weight", None)          # a PackedLinear without the kernels: its packed copy
        for t in (weight if isinstance(weight, torch.Tensor) else getattr(mod, "packed", None),
                  getattr(mod, "bias", None)):
            if isinstance(t, torch.Tensor) and t.numel() and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    emb = getattr(model, "embed_tokens", None)
    if emb is not None and head is None and getattr(model, "lm_head", None) is None:
        total += emb.weight.numel() * emb.weight.element_size()      # tied float head: F.linear reads it all
    return total


def served_weight_bytes(model: str = "default") -> int:
    """Weight bytes a decode step of `blink serve --model MODEL` streams with its defaults (--dtype
    auto: a GGUF's quantized blocks, the CPU executor's repacked layouts and logits head)."""
    from gpu_backend import cpu_kernels
    from gpu_backend.executors.cpu import resolve_dtype
    from gpu_backend.executors.cpu_linear import prepare_model
    from gpu_backend.model.loader import load_model
    loaded = load_model(model, dtype=resolve_dtype("auto"), quantized=True).model
    return weight_bytes_per_token(prepare_model(loaded, cpu_kernels.load()))


def probe(threads: int, model: str = "default") -> dict:
    """The triad bandwidth with the server's threads and the served model's weight bytes a token."""
    gb_s = triad_gb_s(threads)
    weight_bytes = served_weight_bytes(model)
    return {"triad_gb_s": gb_s, "threads": threads, "weight_bytes_per_token": weight_bytes,
            "decode_bound_tok_s": gb_s * 1e9 / weight_bytes}


def decode_fraction(bandwidth: dict, tpot_p50_ms: float) -> tuple[float, float]:
    """(decode tok/s = 1000 / TPOT p50, that / the bandwidth bound) for one stream."""
    tok_s = 1000.0 / tpot_p50_ms
    return tok_s, tok_s / bandwidth["decode_bound_tok_s"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--mb", type=int, default=256, help="MiB per array (3 arrays)")
    args = ap.parse_args(argv)
    print(f"triad: {triad_gb_s(args.threads, args.mb):.1f} GB/s with {args.threads or torch.get_num_threads()} threads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
