"""Structured outputs: what a constraint costs to compile, and what it costs per generated token.

    compile: distinct nested-object schemas (arrays with bounds, enums, an integer range, an
        optional field; property names varied so no compile hits the cache) ->
        ConstraintCompiler.compile_now -> p50 / p90 seconds, states, ring words
    sampler: the daemon's batched sampler (gpu_backend.sampling.sample) over [N, 49152] logits, N = 1
        and 16 rows, free vs constrained by the same regex's automaton, the two run on the same
        logits step after step (so machine noise hits both alike) -> median ms per step and the
        difference: the whole per-token cost the automaton adds in the daemon
    decode: `blink serve` on SmolLM2 (CPU executor); 1 and 16 concurrent streams, each asked for
        exactly --tokens tokens (min_tokens = max_tokens), free text vs a regex constraint
        ([a-z ,.]+, which a prose-writing model follows), rounds alternating A/B in one run
        -> median time per output token (first to last token of a stream) and the ratio

    python -m bench.structured [--schemas 10] [--tokens 48] [--rounds 3] [--out bench/results/NAME]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import time

from . import machine, servers


def schema(i: int) -> dict:
    """A nested object with arrays and enums; names carry `i` so every schema is new."""
    return {
        "type": "object",
        "properties": {
            f"name_{i}": {"type": "string"},
            f"age_{i}": {"type": "integer", "minimum": 0, "maximum": 120},
            "kind": {"enum": ["cat", "dog", "bird", f"other_{i}"]},
            "owner": {"type": "object", "properties": {"first": {"type": "string"}, "email": {"type": "string"},
                                                       "vip": {"type": "boolean"}},
                      "required": ["first", "email", "vip"]},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
            "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
        "required": [f"name_{i}", f"age_{i}", "kind", "owner", "tags", "nickname"],
    }


def bench_compile(n: int) -> dict:
    from dpu_frontend.structured.compiler import ConstraintCompiler
    from dpu_frontend.structured.request import parse
    from dpu_frontend.tokenizer import load_tokenizer

    tok = load_tokenizer("default")
    cc = ConstraintCompiler(tok.tokenizer, min(tok.eos_ids))
    t0 = time.perf_counter()
    cc.vocabulary()
    vocab_s = time.perf_counter() - t0
    times, cpu, states, words = [], [], [], []
    for i in range(n):
        c = parse({"guided_json": schema(i)})
        t0, c0 = time.perf_counter(), time.thread_time()
        r = cc.compile_now(c)
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        states.append(r.n_states)
        words.append(len(r.words) // 4)
    cc.close()
    q = statistics.quantiles(times, n=10) if n >= 2 else times * 9
    return {"schemas": n, "vocabulary_s": vocab_s, "compile_p50_s": statistics.median(times),
            "compile_p90_s": q[-1], "compile_s": times, "compile_cpu_p50_s": statistics.median(cpu), "states": statistics.median(states),
            "words": statistics.median(words)}


REGEX = "[a-z ,.]+"


def bench_sampler(rows=(1, 16), steps: int = 200) -> dict:
    import numpy as np
    import torch

    from dpu_frontend.structured.compiler import ConstraintCompiler
    from dpu_frontend.structured.request import parse
    from dpu_frontend.tokenizer import load_tokenizer
    from gpu_backend.sampling import sample
    from gpu_backend.scheduler.sequence import SamplingParams, Sequence
    from shared_layout.automaton import decode

    tok = load_tokenizer("default")
    vocab = tok.vocab_size
    words = ConstraintCompiler(tok.tokenizer, min(tok.eos_ids)).compile_now(parse({"guided_regex": REGEX})).words
    automaton = decode(np.frombuffer(words, "<i4"), vocab)

    def batch(n, constrained):
        return [Sequence(slot=i, seq=i, epoch=0, prompt=[1, 2, 3], max_tokens=steps + 1,
                         params=SamplingParams(temperature=1.0, seed=i, min_tokens=steps + 1,
                                               automaton=automaton if constrained else None),
                         stop_ids=frozenset(tok.eos_ids), max_len=4096) for i in range(n)]
    out = {}
    for n in rows:
        free, cons = batch(n, False), batch(n, True)
        tf, tc = [], []
        for _ in range(steps):
            logits = torch.randn(n, vocab)
            for seqs, times in ((free, tf), (cons, tc)):
                t0 = time.perf_counter()
                toks = sample(logits, seqs)
                times.append(time.perf_counter() - t0)
                for s, t in zip(seqs, toks):
                    s.output.append(t)
        diffs = [c - f for f, c in zip(tf, tc)]
        out[str(n)] = {"free_ms": statistics.median(tf) * 1e3, "constrained_ms": statistics.median(tc) * 1e3,
                       "added_ms_median": statistics.median(diffs) * 1e3}
    return out


async def _stream(session, url: str, body: dict) -> tuple[float, int]:
    """(seconds per token after the first, tokens) of one streamed completion."""
    stamps, n = [], 0
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                stamps.append(time.perf_counter())
                n += 1
    return (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1), n


async def _round(url: str, streams: int, tokens: int, constrained: bool) -> float:
    import aiohttp
    body = {"model": servers.SERVED_NAME, "prompt": "Write a short story about a cat:", "max_tokens": tokens,
            "min_tokens": tokens, "temperature": 1.0, "stream": True}
    if constrained:
        body["guided_regex"] = REGEX
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        out = await asyncio.gather(*(_stream(s, url, dict(body, seed=i)) for i in range(streams)))
    return statistics.median(tpot for tpot, _ in out)


def bench_decode(tokens: int, rounds: int, streams_list=(1, 16)) -> dict:
    spec = servers.server_spec("blink", model="default", cpus=None, threads=os.cpu_count() or 1,
                               blink_args=("--max-batch-size", "16"))
    log = pathlib.Path("/tmp") / f"bench-structured-{time.time_ns()}.log"
    server = servers.start_server(spec, log)
    try:
        servers.wait_ready(server, spec.base_url, spec.model_name, 600, spec.health_path)
        asyncio.run(_round(spec.base_url, 1, 4, True))          # compile the constraint once (cached after)
        out = {}
        for streams in streams_list:
            free, cons = [], []
            for _ in range(rounds):
                free.append(asyncio.run(_round(spec.base_url, streams, tokens, False)))
                cons.append(asyncio.run(_round(spec.base_url, streams, tokens, True)))
            out[str(streams)] = {"free_s_per_token": statistics.median(free),
                                 "constrained_s_per_token": statistics.median(cons),
                                 "ratio": statistics.median(cons) / statistics.median(free),
                                 "free_rounds": free, "constrained_rounds": cons}
        return out
    finally:
        server.stop()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemas", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--out", type=pathlib.Path, help="write NAME.json and NAME.md")
    args = ap.parse_args(argv)
    result = {"machine": machine.machine_info(), "compile": bench_compile(args.schemas),
              "sampler": bench_sampler()}
    if not args.skip_decode:
        result["decode"] = bench_decode(args.tokens, args.rounds)
    c = result["compile"]
    m = result["machine"]
    lines = [f"machine: {m['cpu_model']}, {m['logical_cpus']} CPUs, load average at start {m['loadavg_at_start']}",
             f"compile ({c['schemas']} nested schemas, {c['states']:.0f} states / {c['words']:.0f} ring words "
             f"median): p50 {c['compile_p50_s']:.3f} s, p90 {c['compile_p90_s']:.3f} s wall "
             f"(p50 {c['compile_cpu_p50_s']:.3f} CPU-s on the compiling thread); vocabulary once "
             f"{c['vocabulary_s']:.3f} s"]
    for n, d in result["sampler"].items():
        lines.append(f"daemon sampler, {n} row(s) of {REGEX!r}: free {d['free_ms']:.2f} ms/step, constrained "
                     f"{d['constrained_ms']:.2f} ms/step, added by the automaton (median of paired steps) "
                     f"{d['added_ms_median']:.3f} ms")
    for streams, d in result.get("decode", {}).items():
        lines.append(f"decode, {streams} stream(s): free {d['free_s_per_token'] * 1e3:.1f} ms/token, constrained "
                     f"{d['constrained_s_per_token'] * 1e3:.1f} ms/token, ratio {d['ratio']:.3f}")
    print("\n".join(lines))
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        cmd = "python -m bench.structured " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
        args.out.with_suffix(".md").write_text(f"# bench.structured\n\n`{cmd}`\n\n" + "\n".join(
            f"- {x}" for x in lines) + "\n")


if __name__ == "__main__":
    main()
