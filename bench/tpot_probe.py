"""One stream's time per output token through any OpenAI server: N streamed chats, one at a time,
each of 128 forced tokens (ignore_eos, temperature 0) on a unique prompt; TPOT p50 of each chat
(the median gap between content chunks), then the median over the chats after the first.

    python -m bench.tpot_probe http://127.0.0.1:8123/v1 [N] -> one line per chat, then
        "median tpot <ms>" (what bench/avx2_proxy_1stream.sh reads)

The openai client, as users run it; no load beside it. A probe for A/B runs that alternate servers
on a noisy machine, not a throughput benchmark (that is `blink bench`).
"""
from __future__ import annotations

import random
import statistics
import sys
import time

WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud")


def main(argv=None) -> int:
    from openai import OpenAI
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m bench.tpot_probe BASE_URL [N]", file=sys.stderr)
        return 2
    client = OpenAI(base_url=argv[0], api_key="x")
    n = int(argv[1]) if len(argv) > 1 else 6
    model = client.models.list().data[0].id
    rng = random.Random(1)
    tpots = []
    for i in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(60))
        t0, times = time.perf_counter(), []
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"{i} {words}"}],
                                                max_tokens=128, stream=True, temperature=0,
                                                extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                times.append(time.perf_counter())
        gaps = [b - a for a, b in zip(times, times[1:])]
        tpots.append(statistics.median(gaps) * 1e3)
        print(f"ttft {(times[0] - t0) * 1e3:.1f} ms, tpot p50 {tpots[-1]:.2f} ms, chunks {len(times)}", flush=True)
    print(f"median tpot {statistics.median(tpots[1:] or tpots):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
