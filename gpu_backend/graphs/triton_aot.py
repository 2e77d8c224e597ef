"""Ahead-of-time compile of every Triton kernel variant a model's step graphs use, for a GPU
that is not here (the rehearsal of issue 17's plan: a kernel that cannot compile for sm_90a is
found on a CPU machine, not on a lent GPU).

    ModelConfig (default SmolLM2's shape) + dtype + block size
      -> variants(): (kernel, signature, compile-time constants, num_warps) of each launch the
         wrappers in triton_kernels.py and triton_sampler.py make for that model: both
         add_rms_norm forms, silu_mul, rope_kv_write, decode_attention (unsplit, and split along the
         context with its combine kernel), the prefill tile of
         paged_attention, the sampler's processing (with and without an automaton), bans, uniform,
         seat update, the draw's two kernels, the logprobs
      -> triton.compile(..., target=GPUTarget("cuda", 90, 32)) each (Triton's own ptxas; no
         driver, no GPU) -> warps, shared memory and cubin size of each, one line apiece; an error
         for a variant that needs what a device-launched graph cannot hold (a scratch buffer
         allocated at launch, a cooperative or cluster launch, programmatic dependent launch)

    python -m gpu_backend.graphs.triton_aot [--arch 90] [--dtype float32] [--block-size 16]

Run without TRITON_INTERPRET (under the interpreter the kernels are not compilable functions).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def variants(config, dtype: torch.dtype, block_size: int) -> list[tuple[str, object, dict, dict, int]]:
    """[(label, kernel, signature, constants, num_warps)] of the launches a step makes for `config`."""
    from . import triton_kernels as tk
    t = "*" + _TYPES[dtype]
    h, kv, d = config.num_heads, config.num_kv_heads, config.head_dim
    out = []
    for has_delta in (False, True):
        out.append((f"add_rms_norm[delta={has_delta}]", tk._add_rms_norm_kernel,
                    {"x_ptr": t, "d_ptr": t, "w_ptr": t, "out_ptr": t, "n_cols": "i32", "stride_x": "i32",
                     "stride_d": "i32", "stride_o": "i32", "eps": "fp32", "HAS_DELTA": "constexpr", "BLOCK": "constexpr"},
                    {"HAS_DELTA": has_delta, "BLOCK": tk._pow2(config.hidden_size)}, 4))
    out.append(("silu_mul", tk._silu_mul_kernel,
                {"gu_ptr": t, "out_ptr": t, "n_cols": "i32", "stride_gu": "i32", "stride_o": "i32", "BLOCK": "constexpr"},
                {"BLOCK": tk.silu_block(config.intermediate_size)}, 4))
    out.append(("rope_kv_write", tk._rope_kv_write_kernel,
                {"qkv_ptr": t, "pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "slot_ptr": "*i64", "q_out_ptr": t,
                 "k_cache_ptr": t, "v_cache_ptr": t, "stride_qkv_t": "i32", "stride_q_t": "i32", "stride_c_slot": "i32",
                 "H": "constexpr", "KV": "constexpr", "D": "constexpr", "HALF": "constexpr", "BLOCK_H": "constexpr",
                 "BLOCK_KV": "constexpr"},
                {"H": h, "KV": kv, "D": d, "HALF": d // 2, "BLOCK_H": tk._pow2(h), "BLOCK_KV": tk._pow2(kv)}, 2))
    g = h // kv
    out.append(("decode_attention", tk._decode_attention_kernel,
                {"qkv_ptr": t, "pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "slot_ptr": "*i64", "k_cache_ptr": t,
                 "v_cache_ptr": t, "tables_ptr": "*i64", "out_ptr": t, "scale": "fp32", "stride_qkv_t": "i32",
                 "stride_o_t": "i32", "stride_c_slot": "i32", "n_tables": "i32", "ctx": "i32", "H": "constexpr",
                 "G": "constexpr", "KV": "constexpr", "D": "constexpr", "HALF": "constexpr", "BS": "constexpr",
                 "BLOCK_G": "constexpr", "BLOCK_N": "constexpr", "IEEE": "constexpr"},
                {"H": h, "G": g, "KV": kv, "D": d, "HALF": d // 2, "BS": block_size, "BLOCK_G": max(16, tk._pow2(g)),
                 "BLOCK_N": tk.DECODE_BLOCK_N, "IEEE": dtype == torch.float32}, 4))
    out.append(("decode_attention.split", tk._decode_split_kernel,
                {"qkv_ptr": t, "pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "slot_ptr": "*i64", "k_cache_ptr": t,
                 "v_cache_ptr": t, "tables_ptr": "*i64", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32",
                 "scale": "fp32", "stride_qkv_t": "i32", "stride_c_slot": "i32", "n_tables": "i32", "ctx": "i32",
                 "chunk": "i32", "splits": "i32", "H": "constexpr", "G": "constexpr", "KV": "constexpr",
                 "D": "constexpr", "HALF": "constexpr", "BS": "constexpr", "BLOCK_G": "constexpr",
                 "BLOCK_N": "constexpr", "IEEE": "constexpr"},
                {"H": h, "G": g, "KV": kv, "D": d, "HALF": d // 2, "BS": block_size, "BLOCK_G": max(16, tk._pow2(g)),
                 "BLOCK_N": tk.DECODE_BLOCK_N, "IEEE": dtype == torch.float32}, 4))
    out.append(("decode_attention.combine", tk._decode_combine_kernel,
                {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": t, "stride_o_t": "i32",
                 "splits": "i32", "G": "constexpr", "KV": "constexpr", "D": "constexpr", "BLOCK_G": "constexpr"},
                {"G": g, "KV": kv, "D": d, "BLOCK_G": max(16, tk._pow2(g))}, 4))
    for kind, seq in (("prefill", 64),):       # one-token rows go to decode_attention in a step graph
        bm, bn = tk.attention_tiles(seq, g)
        out.append((f"paged_attention[{kind} {bm}x{bn}]", tk._paged_attention_kernel,
                    {"q_ptr": t, "k_cache_ptr": t, "v_cache_ptr": t, "tables_ptr": "*i64", "pos_ptr": "*i64",
                     "out_ptr": t, "scale": "fp32", "stride_q_t": "i32", "stride_o_t": "i32", "stride_c_slot": "i32",
                     "n_tables": "i32", "ctx": "i32", "S": "i32", "G": "constexpr", "KV": "constexpr", "D": "constexpr",
                     "BS": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "IEEE": "constexpr"},
                    {"G": g, "KV": kv, "D": d, "BS": block_size, "BLOCK_M": bm, "BLOCK_N": bn,
                     "IEEE": dtype == torch.float32}, 4))
    # the sampler's (float32 logits whatever the model's dtype); step graphs always stage an automaton
    from . import triton_sampler as ts
    from .sampler import ROW_STOPS
    auto_types = {True: ("*i1", "*i1"), False: ("*i64", "*fp32")}
    for auto in (True, False):
        on_t, allowed_t = auto_types[auto]
        out.append((f"sampler.process[automaton={auto}]", ts._process_kernel,
                    {"logits_ptr": "*fp32", "out_ptr": "*fp32", "seat_ptr": "*i64", "bias_ptr": "*fp32",
                     "counts_ptr": "*fp32", "prompt_ptr": "*i1", "rep_ptr": "*fp32", "freq_ptr": "*fp32",
                     "pres_ptr": "*fp32", "auto_on_ptr": on_t, "auto_allowed_ptr": allowed_t, "vocab": "i32",
                     "stride_l": "i32", "stride_s": "i32", "stride_a": "i32", "HAS_AUTOMATON": "constexpr",
                     "BLOCK": "constexpr"},
                    {"HAS_AUTOMATON": auto, "BLOCK": ts.PROCESS_BLOCK}, 4))
    out.append(("sampler.bans", ts._ban_kernel,
                {**{k: "*fp32" if k == "out_ptr" else "*i64" for k in (
                    "out_ptr", "seat_ptr", "index_ptr", "min_tokens_ptr", "stop_ptr", "recent_ptr", "prefix_ptr",
                    "plen_ptr", "last_ptr")},
                 "vocab": "i32", "stride_o": "i32", "n_words": "i32", "word_len": "i32", "n_stops": "i32",
                 "WORDS": "constexpr", "LEN": "constexpr", "STOPS": "constexpr"},
                {"WORDS": ts.BAN_WORDS_BLOCK, "LEN": ts.BAN_LEN_BLOCK, "STOPS": tk._pow2(ROW_STOPS)}, 4))
    out.append(("sampler.uniform", ts._uniform_kernel,
                {"seed_ptr": "*i64", "index_ptr": "*i64", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                {"BLOCK": ts.UNIFORM_BLOCK}, 1))
    for name, fn, warps in (("sampler.draw_prep", ts._draw_prep_kernel, 4),
                            ("sampler.draw_pick", ts._draw_pick_kernel, ts.PICK_WARPS)):
        ptrs = (("x_ptr", "*fp32"), ("y_ptr", "*fp32"), ("greedy_ptr", "*i64"), ("top_ptr", "*fp32"),
                ("temp_ptr", "*fp32"), ("min_p_ptr", "*fp32")) if name.endswith("prep") else (
                ("y_ptr", "*fp32"), ("top_ptr", "*fp32"), ("greedy_ptr", "*i64"), ("temp_ptr", "*fp32"),
                ("top_p_ptr", "*fp32"), ("top_k_ptr", "*i64"), ("seed_ptr", "*i64"), ("index_ptr", "*i64"),
                ("tokens_ptr", "*i64"))
        out.append((name, fn, {**dict(ptrs), "vocab": "i32", "stride": "i32", "BLOCK": "constexpr",
                               "STAGES": "constexpr"}, {"BLOCK": ts.DRAW_BLOCK, "STAGES": ts.DRAW_STAGES}, warps))
    out.append(("sampler.logprobs", ts._logprobs_kernel,           # step graphs always pass the rows' want flags
                {"raw_ptr": "*fp32", "tokens_ptr": "*i64", "want_ptr": "*i64", "lp_ptr": "*fp32", "rank_ptr": "*i64",
                 "ids_ptr": "*i64", "vals_ptr": "*fp32", "cand_ptr": "*i64", "vocab": "i32", "stride": "i32",
                 "k": "i32", "cap": "i32", "HAS_WANT": "constexpr", "TOP": "constexpr", "BLOCK": "constexpr",
                 "CANDIDATES": "constexpr", "STAGES": "constexpr"},
                {"HAS_WANT": True, "TOP": ts.TOP_BLOCK, "BLOCK": ts.LOGPROB_BLOCK,
                 "CANDIDATES": ts.LOGPROB_CANDIDATES, "STAGES": ts.LOGPROB_STAGES}, 8))
    from .sampler import BAD_WORD_LEN
    out.append(("sampler.update", ts._update_kernel,
                {"tokens_ptr": "*i64", "seat_ptr": "*i64", "counts_ptr": "*fp32", "recent_ptr": "*i64", "vocab": "i32",
                 "sink": "i32", "recent_len": "i32", "LEN": "constexpr"},
                {"LEN": tk._pow2(BAD_WORD_LEN - 1)}, 1))
    return out


def options(label: str, warps: int) -> dict:
    """The compile options a variant launches with (the sampler's processing and draw: no FMA contraction)."""
    no_fma = label.startswith(("sampler.process", "sampler.draw"))
    return {"num_warps": warps, **({"enable_fp_fusion": False} if no_fma else {})}


def compile_all(config, dtype: torch.dtype, block_size: int, arch: int = 90) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    res = []
    for label, fn, sig, consts, warps in variants(config, dtype, block_size):
        t0 = time.perf_counter()
        # pointers 16-byte aligned, as the JIT specialises them for torch's allocations
        attrs = {(i,): [["tt.divisibility", 16]] for i, (k, v) in enumerate(sig.items()) if v.startswith("*")}
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", arch, 32), options=options(label, warps))
        md = k.metadata
        # what a device-launchable graph node cannot take: a scratch buffer Triton allocates at launch,
        # a cooperative or cluster launch, programmatic dependent launch
        odd = {name: v for name, v in (("global_scratch_size", md.global_scratch_size),
                                       ("profile_scratch_size", getattr(md, "profile_scratch_size", 0)),
                                       ("num_ctas", md.num_ctas - 1),
                                       ("launch_cooperative_grid", getattr(md, "launch_cooperative_grid", False)),
                                       ("launch_pdl", getattr(md, "launch_pdl", False))) if v}
        if odd:
            raise RuntimeError(f"{label}: launches a step graph cannot capture for device launch: {odd}")
        res.append({"kernel": label, "name": md.name, "shared": md.shared, "num_warps": md.num_warps,
                    "cubin_bytes": len(k.asm.get("cubin", b"")), "s": round(time.perf_counter() - t0, 2)})
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--model", default="smollm2", help="'smollm2' (its shape) or a folder with config.json")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("triton_aot: unset TRITON_INTERPRET (interpreted kernels do not compile)", file=sys.stderr)
        return 2
    if args.model == "smollm2":
        from .device import smollm2_shape_config
        config = smollm2_shape_config(tied=False)
    else:
        import json
        import pathlib
        from ..model.config import ModelConfig
        config = ModelConfig.from_hf(json.loads((pathlib.Path(args.model) / "config.json").read_text()))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    for r in compile_all(config, dtype, args.block_size, args.arch):
        print(f"triton_aot: sm_{args.arch} {r['kernel']:<34} {r['num_warps']} warps, shared {r['shared']} B, "
              f"cubin {r['cubin_bytes']} B, {r['s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
