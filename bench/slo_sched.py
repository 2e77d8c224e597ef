"""SLO-aware scheduling: FCFS vs PRIORITY vs LVF under overload, through `blink serve`.

    the embedded model's tokenizer -> two SLO classes of /v1/completions requests
      interactive: short prompt, short output, tight TTFT target, priority 0
      batch:       longer prompt, long output, loose TTFT target, priority 1
    -> capacity: a fresh `blink serve --scheduling-policy fcfs`, closed loop (twice as many
       clients as seats by default, so no seat idles between a reply and the next request;
       the same class mix) for --capacity-s: completed requests/s = the load this machine
       sustains
    -> for each policy (fcfs, priority, lvf; a fresh server each, the same flags): one
       Poisson arrival schedule (seeded, identical for every policy) at --load-factor x
       that rate for --duration-s, every request streamed, a drain cut-off after
    -> per policy: TTFT and TBT SLO attainment (a request attains TTFT if its first token
       came within its ttft_slo_ms, TBT if its mean time between tokens was within its
       tbt_slo_ms; a request not finished by the cut-off attains neither), P50/P99 of
       TTFT and TBT, output tokens/s and requests/s -> JSON + markdown

    python -m bench.slo_sched --out bench/results/<date>-<machine>-slo-sched

The machine is shared: the load average is recorded at start and end, and the policies
run back to back in one invocation so their ratios, not absolute times, count.
Goal (issue 23): LVF >= 30 points more TTFT attainment than FCFS at equal throughput
(within 5%).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
POLICIES = ("fcfs", "priority", "lvf")


@dataclasses.dataclass(frozen=True)
class SloClass:
    name: str
    prompt_tokens: int
    max_tokens: int
    ttft_slo_ms: int
    tbt_slo_ms: int
    priority: int
    share: float          # fraction of requests


def classes(args) -> tuple[SloClass, ...]:
    return (SloClass("interactive", 48, 16, args.interactive_ttft_ms, args.interactive_tbt_ms, 0, 0.5),
            SloClass("batch", 160, 96, args.batch_ttft_ms, args.batch_tbt_ms, 1, 0.5))


@dataclasses.dataclass
class Record:
    cls: str
    t_send: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    error: str | None = None


async def one_request(session, url: str, model: str, prompt: str, c: SloClass, rec: Record) -> None:
    """One streamed /v1/completions request; fills rec (times relative to its send)."""
    body = {"model": model, "prompt": prompt, "max_tokens": c.max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0.0, "priority": c.priority, "ttft_slo_ms": c.ttft_slo_ms, "tbt_slo_ms": c.tbt_slo_ms}
    rec.t_send = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}"
                return
            async for line in resp.content:
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter() - rec.t_send
                    if rec.ttft_s is None:
                        rec.ttft_s = now
                    rec.tokens += 1
                    rec.e2e_s = now
    except Exception as e:        # noqa: BLE001  recorded, the run goes on
        rec.error = f"{type(e).__name__}: {e}"


def start_server(policy: str, extra: list[str], log_dir: pathlib.Path):
    from bench.servers import SERVED_NAME, free_port, wait_ready
    port = free_port()
    argv = [sys.executable, "-m", "dpu_frontend.cli", "serve", "--model", "default", "--port", str(port),
            "--ring", f"blink-slo-{os.getpid()}-{port}", "--served-model-name", SERVED_NAME,
            "--scheduling-policy", policy, *extra]
    url = f"http://127.0.0.1:{port}"
    with open(log_dir / f"slo-sched-serve-{policy}.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    wait_ready(None, url, SERVED_NAME, timeout_s=600.0, health_path="/health")
    return proc, url, argv


def pick(i: int, cls: tuple[SloClass, ...]) -> SloClass:
    """Deterministic class mix by share (every request index gets the same class in every run)."""
    x = (i * 0.6180339887) % 1.0
    acc = 0.0
    for c in cls:
        acc += c.share
        if x < acc:
            return c
    return cls[-1]


async def capacity(url: str, model: str, prompts: dict, cls, clients: int, duration_s: float) -> dict:
    """Closed loop: `clients` concurrent request loops for duration_s; completed requests/s."""
    import aiohttp
    done: list[Record] = []
    t_end = time.perf_counter() + duration_s
    counter = iter(range(10**9))

    async def loop(session):
        while time.perf_counter() < t_end:
            i = next(counter)
            c = pick(i, cls)
            rec = Record(c.name)
            await one_request(session, url, model, prompts[c.name][i % len(prompts[c.name])], c, rec)
            if time.perf_counter() <= t_end and rec.error is None:
                done.append(rec)

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*(loop(session) for _ in range(clients)))
    wall = time.perf_counter() - t0
    return {"completed": len(done), "window_s": duration_s, "wall_s": round(wall, 1), "clients": clients,
            "req_per_s": len(done) / duration_s,
            "tokens_per_s": sum(r.tokens for r in done) / duration_s}


async def open_loop(url: str, model: str, prompts: dict, cls, arrivals: list[float], drain_s: float) -> dict:
    import aiohttp
    recs = [Record(pick(i, cls).name) for i in range(len(arrivals))]
    by_name = {c.name: c for c in cls}
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=arrivals[-1] + drain_s)) as session:
        async def fire(i: int):
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            c = by_name[recs[i].cls]
            try:
                await asyncio.wait_for(one_request(session, url, model, prompts[c.name][i % len(prompts[c.name])],
                                                   c, recs[i]),
                                       timeout=max(1.0, t0 + arrivals[-1] + drain_s - time.perf_counter()))
            except asyncio.TimeoutError:
                recs[i].error = recs[i].error or "cut off"
        await asyncio.gather(*(fire(i) for i in range(len(arrivals))))
    return summarize(recs, by_name, time.perf_counter() - t0)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summarize(recs: list[Record], by_name: dict, wall_s: float) -> dict:
    out = {"wall_s": round(wall_s, 1), "requests": len(recs)}
    finished = [r for r in recs if r.error is None and r.tokens == by_name[r.cls].max_tokens]
    ends = [r.t_send + r.e2e_s for r in finished]
    starts = [r.t_send for r in recs]
    span = (max(ends) - min(starts)) if ends else wall_s
    out["finished"] = len(finished)
    out["output_tokens_per_s"] = sum(r.tokens for r in finished) / span if span else 0.0
    out["req_per_s"] = len(finished) / span if span else 0.0

    def stats(group: list[Record]) -> dict:
        ttft_ok = sum(1 for r in group if r.ttft_s is not None and r in finished
                      and r.ttft_s * 1e3 <= by_name[r.cls].ttft_slo_ms)
        tbt = {id(r): (r.e2e_s - r.ttft_s) / (r.tokens - 1) for r in group
               if r in finished and r.tokens > 1}
        tbt_ok = sum(1 for r in group if id(r) in tbt and tbt[id(r)] * 1e3 <= by_name[r.cls].tbt_slo_ms)
        ttfts = [r.ttft_s * 1e3 for r in group if r.ttft_s is not None]
        tbts = [v * 1e3 for v in tbt.values()]
        n = max(1, len(group))
        return {"n": len(group), "finished": sum(1 for r in group if r in finished),
                "ttft_attainment": ttft_ok / n, "tbt_attainment": tbt_ok / n,
                "ttft_p50_ms": _pct(ttfts, 50), "ttft_p99_ms": _pct(ttfts, 99),
                "tbt_p50_ms": _pct(tbts, 50), "tbt_p99_ms": _pct(tbts, 99)}
    out["all"] = stats(recs)
    out["by_class"] = {name: stats([r for r in recs if r.cls == name]) for name in by_name}
    out["errors"] = sorted({r.error for r in recs if r.error})[:5]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.slo_sched", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="results path without suffix (.json and .md are written)")
    ap.add_argument("--max-batch-size", type=int, default=8, help="seats, the same for every policy")
    ap.add_argument("--threads", type=int, default=None, help="the daemon's --threads")
    ap.add_argument("--capacity-s", type=float, default=45.0, help="closed-loop window measuring sustainable load")
    ap.add_argument("--duration-s", type=float, default=60.0, help="open-loop arrival window per policy")
    ap.add_argument("--drain-s", type=float, default=120.0, help="after the last arrival, unfinished requests are cut")
    ap.add_argument("--load-factor", type=float, default=1.5, help="offered load / sustainable load")
    ap.add_argument("--capacity-clients", type=int, default=None,
                    help="closed-loop clients of the capacity probe (default twice --max-batch-size: with one a "
                         "seat, seats idle between a reply and the next request and the probe reads low)")
    ap.add_argument("--interactive-ttft-ms", type=int, default=3000)
    ap.add_argument("--interactive-tbt-ms", type=int, default=300)
    ap.add_argument("--batch-ttft-ms", type=int, default=30000)
    ap.add_argument("--batch-tbt-ms", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    args = ap.parse_args(argv)
    import numpy as np
    from bench.cpu_executor import cpu_description
    from bench.interference import stop_group
    from bench.servers import SERVED_NAME
    from bench.workload import PromptMaker, load_tokenizer
    cls = classes(args)
    rng = np.random.default_rng(args.seed)
    maker = PromptMaker(load_tokenizer("default"))
    prompts = {c.name: [maker.make(c.prompt_tokens, rng)[0] for _ in range(16)] for c in cls}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    extra = ["--max-batch-size", str(args.max_batch_size)] + (["--threads", str(args.threads)] if args.threads else [])
    load_start = os.getloadavg()
    t_start = time.time()

    proc, url, _ = start_server("fcfs", extra, out.parent)
    try:
        cap = asyncio.run(capacity(url, SERVED_NAME, prompts, cls, args.capacity_clients or 2 * args.max_batch_size,
                                   args.capacity_s))
    finally:
        stop_group(proc, 20.0)
    rate = args.load_factor * cap["req_per_s"]
    print(f"sustainable: {cap['req_per_s']:.3f} req/s ({cap['tokens_per_s']:.1f} tok/s); offering {rate:.3f} req/s",
          flush=True)
    arrivals = list(np.cumsum(np.random.default_rng(args.seed + 1).exponential(1.0 / rate,
                                                                               int(rate * args.duration_s) + 1)))
    arrivals = [a for a in arrivals if a <= args.duration_s] or [0.0]
    runs = {}
    for policy in args.policies.split(","):
        proc, url, argv_p = start_server(policy, extra, out.parent)
        try:
            runs[policy] = asyncio.run(open_loop(url, SERVED_NAME, prompts, cls, arrivals, args.drain_s))
            runs[policy]["argv"] = argv_p
        finally:
            stop_group(proc, 20.0)
        r = runs[policy]
        print(f"{policy}: TTFT attainment {r['all']['ttft_attainment']:.1%}, TBT {r['all']['tbt_attainment']:.1%}, "
              f"{r['output_tokens_per_s']:.1f} tok/s, finished {r['finished']}/{r['requests']}", flush=True)

    result = {"date": datetime.date.today().isoformat(), "cpu": cpu_description(), "cores": os.cpu_count(),
              "loadavg_start": [round(x, 2) for x in load_start],
              "loadavg_end": [round(x, 2) for x in os.getloadavg()], "wall_s": round(time.time() - t_start, 1),
              "classes": [dataclasses.asdict(c) for c in cls], "capacity": cap, "offered_req_per_s": rate,
              "arrivals": len(arrivals), "server_flags": extra, "runs": runs,
              "command": "python -m bench.slo_sched " + " ".join(argv if argv is not None else sys.argv[1:])}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(report(result) + "\n")
    print(report(result))
    return 0


def report(res: dict) -> str:
    cpu = res["cpu"]
    f = lambda x, d=0: "-" if x is None else f"{x:,.{d}f}"   # noqa: E731
    lines = [f"# SLO-aware scheduling under {res['offered_req_per_s'] / res['capacity']['req_per_s']:.2f}x "
             f"the sustainable load ({res['date']})", "",
             f"CPU: {cpu['model']} ({res['cores']} cores), flags {' '.join(cpu['simd_flags'])}. Load average at "
             f"start: {res['loadavg_start']} (end: {res['loadavg_end']}); the machine is shared.", "",
             f"Command: `{res['command']}` ({res['wall_s']:.0f} s)", "",
             "Each policy is a fresh `blink serve --model default` (embedded SmolLM2-135M) with "
             f"`{' '.join(res['server_flags'])} --scheduling-policy P`; the same seeded Poisson arrivals for each.",
             "", "Classes: " + "; ".join(
                 f"{c['name']} ({c['share']:.0%}): {c['prompt_tokens']}-token prompt, {c['max_tokens']} tokens out, "
                 f"TTFT target {c['ttft_slo_ms']} ms, TBT target {c['tbt_slo_ms']} ms, priority {c['priority']}"
                 for c in res["classes"]), "",
             f"Sustainable load (FCFS, closed loop with {res['capacity'].get('clients', res['server_flags'][1])} clients, "
             f"{res['capacity']['window_s']:.0f} s): {res['capacity']['req_per_s']:.3f} req/s, "
             f"{res['capacity']['tokens_per_s']:.1f} output tok/s. Offered: {res['offered_req_per_s']:.3f} req/s, "
             f"{res['arrivals']} requests.", "",
             "| policy | TTFT attainment | TBT attainment | TTFT P50 / P99 (ms) | TBT P50 / P99 (ms) | "
             "output tok/s | finished |", "|---|---|---|---|---|---|---|"]
    for p, r in res["runs"].items():
        a = r["all"]
        lines.append(f"| {p} | {a['ttft_attainment']:.1%} | {a['tbt_attainment']:.1%} | {f(a['ttft_p50_ms'])} / "
                     f"{f(a['ttft_p99_ms'])} | {f(a['tbt_p50_ms'])} / {f(a['tbt_p99_ms'])} | "
                     f"{r['output_tokens_per_s']:.1f} | {r['finished']}/{r['requests']} |")
    lines += ["", "Per class (TTFT attainment / TBT attainment / TTFT P99 ms):", ""]
    for p, r in res["runs"].items():
        lines.append(f"- {p}: " + "; ".join(
            f"{k} {v['ttft_attainment']:.1%} / {v['tbt_attainment']:.1%} / {f(v['ttft_p99_ms'])}"
            for k, v in r["by_class"].items()))
    if "fcfs" in res["runs"] and "lvf" in res["runs"]:
        fc, lv = res["runs"]["fcfs"], res["runs"]["lvf"]
        gain = 100 * (lv["all"]["ttft_attainment"] - fc["all"]["ttft_attainment"])
        thr = lv["output_tokens_per_s"] / fc["output_tokens_per_s"] if fc["output_tokens_per_s"] else 0.0
        met = gain >= 30 and abs(thr - 1) <= 0.05
        lines += ["", f"Goal (issue 23): LVF >= 30 points more TTFT attainment than FCFS at equal throughput "
                  f"(within 5%): LVF {gain:+.1f} points, throughput {thr:.3f}x FCFS: {'met' if met else 'not met'}."]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
