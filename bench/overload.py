"""Overload benchmark: `blink serve` at 3x its measured saturation, then back to a light load.

    start blink serve (bounded: --slots, --max-queue, --queue-timeout-s, --request-timeout-s)
    -> baseline: a light load, latency of an unloaded server
    -> ramp: open-loop levels (evenly spaced arrivals), each drained; saturation = the best
       steady rate of completed requests over the levels (stops once a level falls short of
       its offered rate and no longer beats the best before it by 10%: batching keeps adding
       throughput past the first shortfall)
    -> overload: `factor` x saturation for `duration_s`, while /health is probed every
       0.5 s and resident memory sampled every 2 s
    -> recovery: the light load again; how long until requests complete at baseline latency
    -> settle: /metrics shows no slot, queue entry or arena token still held
    -> JSON + markdown in bench/results/

Pass criteria (recorded, not asserted here; tests/reliability runs a short version and
asserts them): no request lost (every one ended: 200 with [DONE], 429/503 with
Retry-After, or an error event), /health answered every probe, memory bounded
(growth after warm-up small next to the peak), clean leak check, recovery within
seconds. Latency numbers on a shared machine are indicative only.

    python -m bench.overload --model default --duration-s 300 --date 2026-11-22 --machine cpu2
    python -m bench.overload --model null --quick          # seconds; what CI runs
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

from .machine import machine_info
from .reliability import (OK, HealthProbe, MemorySampler, Outcome, ServeUnderTest, count_outcomes,
                          new_session, percentiles, prompt_ids, ring_geometry, send, settle, write_result)

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.overload", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="default (SmolLM2 on the CPU executor) | null (echo)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--ramp", default="0.25,0.5,1,2,4,8,16,32", help="offered req/s levels of the saturation ramp")
    p.add_argument("--ramp-level-s", type=float, default=30.0)
    p.add_argument("--factor", type=float, default=3.0, help="overload = factor x saturation")
    p.add_argument("--duration-s", type=float, default=300.0, help="length of the overload phase")
    p.add_argument("--light-fraction", type=float, default=0.25, help="baseline / recovery load, x saturation")
    p.add_argument("--baseline-s", type=float, default=30.0)
    p.add_argument("--recovery-s", type=float, default=60.0)
    p.add_argument("--warmup-s", type=float, default=30.0, help="overload seconds before memory must stay flat")
    p.add_argument("--client-timeout-s", type=float, default=300.0, help="a request unanswered this long is lost")
    # server bounds
    p.add_argument("--slots", type=int, default=48, help="ring slots: requests inside the daemon at most")
    p.add_argument("--max-queue", type=int, default=128, help="frontend wait queue before 429")
    p.add_argument("--queue-timeout-s", type=float, default=5.0)
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--max-batch-size", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="CI: seconds-long phases, null model defaults")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--date", default=datetime.date.today().isoformat())
    p.add_argument("--machine", default="local")
    p.add_argument("--out", default=None, help="output path without extension (default bench/results/DATE-MACHINE-overload)")
    args = p.parse_args(argv)
    if args.quick:
        args.ramp_level_s, args.duration_s, args.baseline_s, args.recovery_s, args.warmup_s = 3.0, 10.0, 3.0, 6.0, 3.0
        if args.model == "null":
            args.ramp = "10,40,160"
    return args


async def open_loop(session, base: str, rate: float, duration_s: float, body: dict, rng: np.random.Generator | None,
                    phase: str, timeout_s: float, sink: list[tuple[str, Outcome]]) -> None:
    """Poisson arrivals at `rate` for `duration_s` (evenly spaced when `rng` is None); waits for
    every request it sent to end."""
    loop = asyncio.get_running_loop()
    t_end = loop.time() + duration_s
    tasks = []
    t_next = loop.time()
    while True:
        t_next += rng.exponential(1.0 / rate) if rng is not None else 1.0 / rate
        if t_next >= t_end:
            break
        await asyncio.sleep(max(0.0, t_next - loop.time()))
        tasks.append(asyncio.ensure_future(send(session, base, "stream", body, timeout_s=timeout_s)))
    for o in await asyncio.gather(*tasks):
        sink.append((phase, o))


def completion_rate(outcomes: list[Outcome], t_from: float, t_to: float) -> float:
    """Requests completed OK per second within [t_from, t_to] (loop clock), by completion time."""
    n = sum(1 for o in outcomes if o.outcome == OK and t_from <= o.t_send_s + (o.e2e_s or 0.0) <= t_to)
    return n / max(1e-9, t_to - t_from)


def _level_stats(outcomes: list[Outcome], duration_s: float) -> dict:
    ok = [o for o in outcomes if o.outcome == OK]
    return {"sent": len(outcomes), "ok": len(ok), "completed_per_s": round(len(ok) / duration_s, 3),
            "outcomes": count_outcomes(outcomes), "e2e_s": percentiles([o.e2e_s for o in ok]),
            "ttft_s": percentiles([o.ttft_s for o in ok if o.ttft_s is not None])}


def recovery_time(outcomes: list[Outcome], t_drop: float, ok_e2e_s: float, min_good_after: int = 3) -> float | None:
    """Seconds from the load drop after which every request sent completed within `ok_e2e_s`;
    None if fewer than `min_good_after` good requests followed the last bad one."""
    rel = [(o.t_send_s - t_drop, o.outcome == OK and (o.e2e_s or 1e9) <= ok_e2e_s) for o in outcomes]
    last_bad = max((t for t, good in rel if not good), default=None)
    if last_bad is None:
        return 0.0 if rel else None
    if sum(1 for t, good in rel if t > last_bad) < min_good_after:
        return None
    return round(max(0.0, last_bad), 2)


async def run(args) -> dict:
    work = pathlib.Path(tempfile.mkdtemp(prefix="blink-overload-"))
    ring = f"blink-overload-{os.getpid()}"
    serve_args = ["--model", args.model, "--slots", str(args.slots), "--max-queue", str(args.max_queue),
                  "--queue-timeout-s", str(args.queue_timeout_s), "--request-timeout-s", str(args.request_timeout_s),
                  "--log-level", "warning"]
    if args.max_batch_size:
        serve_args += ["--max-batch-size", str(args.max_batch_size)]
    if args.threads:
        serve_args += ["--threads", str(args.threads)]
    geometry = ring_geometry(args.slots, None, None)
    rng = np.random.default_rng(args.seed)
    body = {"prompt": prompt_ids(args.prompt_tokens, args.seed), "max_tokens": args.output_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True}
    result: dict = {"benchmark": "overload", "args": vars(args), "machine": machine_info(),
                    "serve_argv": serve_args, "command": " ".join(["python -m bench.overload", *sys.argv[1:]])}
    t_start = time.time()
    serve = ServeUnderTest(ring, serve_args, work / "serve.log")
    records: list[tuple[str, Outcome]] = []
    try:
        async with new_session() as session:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            # Warm the path once (first prefill, tokenizer, allocator) before anything is timed.
            await send(session, serve.base, "warm", {**body, "stream": False}, timeout_s=args.client_timeout_s)

            # Ramp: evenly spaced arrivals (a short Poisson level is too noisy to read a rate from),
            # each level drained before the next; saturation = the best completion rate.
            levels = []
            for rate in [float(x) for x in args.ramp.split(",")]:
                sink: list[tuple[str, Outcome]] = []
                t_level = loop.time()
                await open_loop(session, serve.base, rate, args.ramp_level_s, body, None, f"ramp@{rate:g}",
                                args.client_timeout_s, sink)
                elapsed = loop.time() - t_level
                records += sink
                outs = [o for _, o in sink]
                stats = {"offered_per_s": rate, **_level_stats(outs, elapsed),
                         # steady state: completions in the last 3/4 of the sending window
                         "steady_completed_per_s": round(completion_rate(
                             outs, t_level + args.ramp_level_s / 4, t_level + args.ramp_level_s), 3)}
                levels.append(stats)
                print(f"ramp {rate:g} req/s: {stats['steady_completed_per_s']:.2f} completed/s in steady state, "
                      f"{stats['outcomes']}", file=sys.stderr, flush=True)
                await settle(serve, geometry)
                best_before = max((lv["steady_completed_per_s"] for lv in levels[:-1]), default=0.0)
                if stats["steady_completed_per_s"] < 0.8 * rate and stats["steady_completed_per_s"] < 1.1 * best_before:
                    break   # past the knee and no longer growing (bigger batches can still add throughput)
            saturation = max(lv["steady_completed_per_s"] for lv in levels)
            light = max(0.05, args.light_fraction * saturation)
            overload = args.factor * saturation
            result["ramp"] = levels
            result["saturation_per_s"] = saturation
            print(f"saturation {saturation:.2f} req/s -> overload {overload:.2f}, light {light:.2f}",
                  file=sys.stderr, flush=True)

            # Baseline latency at the light load.
            sink = []
            await open_loop(session, serve.base, light, args.baseline_s, body, None, "baseline", args.client_timeout_s,
                            sink)
            records += sink
            base_stats = _level_stats([o for _, o in sink], args.baseline_s)
            result["baseline"] = {"offered_per_s": light, **base_stats}
            await settle(serve, geometry)

            # Overload with the watchers, then recovery right after the drop.
            health = HealthProbe(serve.base)
            memory = MemorySampler(serve)
            t_over = loop.time()
            watchers = [asyncio.ensure_future(health.run()), asyncio.ensure_future(memory.run(t_over))]
            over_sink: list[tuple[str, Outcome]] = []
            over = asyncio.ensure_future(open_loop(session, serve.base, overload, args.duration_s, body, rng,
                                                   "overload", args.client_timeout_s, over_sink))
            await asyncio.sleep(args.duration_s)
            t_drop = loop.time()
            rec_sink: list[tuple[str, Outcome]] = []
            await open_loop(session, serve.base, light, args.recovery_s, body, None, "recovery",
                            args.client_timeout_s, rec_sink)
            await over
            health.stop()
            memory.stop()
            await asyncio.gather(*watchers)
            records += over_sink + rec_sink
            leak, settle_s = await settle(serve, geometry)
            over_out = [o for _, o in over_sink]
            ok_e2e = 1.5 * (base_stats["e2e_s"]["p90"] or 1.0)
            result["overload"] = {"offered_per_s": overload, **_level_stats(over_out, args.duration_s),
                                  "steady_completed_per_s": round(completion_rate(
                                      over_out, t_over + args.warmup_s, t_over + args.duration_s), 3),
                                  "retry_after_values": sorted({o.retry_after for o in over_out if o.retry_after})}
            result["recovery"] = {"offered_per_s": light, **_level_stats([o for _, o in rec_sink], args.recovery_s),
                                  "ok_e2e_threshold_s": round(ok_e2e, 3),
                                  "recovered_after_s": recovery_time([o for _, o in rec_sink], t_drop, ok_e2e)}
            result["health"] = health.summary()
            result["memory"] = memory.summary(args.warmup_s)
            result["memory_samples"] = [(round(t, 1), f, d) for t, f, d in memory.samples]
            result["leak_check"] = {**leak, "settle_s": round(settle_s, 2)}
    finally:
        rc = serve.stop()
    all_out = [o for _, o in records]
    result["all_outcomes"] = count_outcomes(all_out)
    result["lost"] = sum(o.lost for o in all_out)
    result["serve_exit_code"] = rc
    result["wall_s"] = round(time.time() - t_start, 1)
    result["loadavg_at_end"] = os.getloadavg()
    result["verdict"] = verdict(result)
    return result


def verdict(r: dict) -> dict:
    mem = r.get("memory", {})
    peak = max((m["peak_mib"] for m in mem.values()), default=0.0)
    growth = max((m["growth_after_warmup_mib"] for m in mem.values()), default=0.0)
    rec = r.get("recovery", {}).get("recovered_after_s")
    checks = {
        "no_request_lost": r["lost"] == 0,
        "health_answered_every_probe": r.get("health", {}).get("unanswered", 1) == 0
        and r.get("health", {}).get("by_status", {}).keys() <= {"200"},
        "memory_bounded": growth <= max(32.0, 0.1 * peak),
        "nothing_leaked": bool(r.get("leak_check", {}).get("clean")),
        "recovered": rec is not None,
        "serve_exit_0": r["serve_exit_code"] == 0,
    }
    return {**checks, "all_passed": all(checks.values())}


def markdown(r: dict) -> str:
    a = r["args"]
    v = r["verdict"]
    m = r["machine"]
    lines = [f"# Overload: blink serve --model {a['model']} at {a['factor']:g}x saturation, {a['machine']}, {a['date']}",
             "",
             f"{m['logical_cpus']} CPUs, load average at start {m['loadavg_at_start'][0]:.1f}, at end "
             f"{r['loadavg_at_end'][0]:.1f} (shared machine: latencies are indicative; the correctness checks are not "
             f"affected by contention). Requests: {a['prompt_tokens']} prompt tokens, {a['output_tokens']} output "
             f"tokens, streamed, ignore_eos. Server bounds: {a['slots']} ring slots, wait queue {a['max_queue']}, "
             f"queue timeout {a['queue_timeout_s']:g} s, request deadline {a['request_timeout_s']:g} s.",
             "", "## Verdict", "", "| check | result |", "|---|---|"]
    lines += [f"| {k.replace('_', ' ')} | {'PASS' if ok else 'FAIL'} |" for k, ok in v.items() if k != "all_passed"]
    lines += ["", "## Saturation ramp (open loop, evenly spaced arrivals, each level drained)", "",
              "| offered req/s | sent | completed/s (steady) | e2e p50 (s) | e2e p90 (s) | outcomes |",
              "|---:|---:|---:|---:|---:|---|"]
    for lv in r["ramp"]:
        lines.append(f"| {lv['offered_per_s']:g} | {lv['sent']} | {lv['steady_completed_per_s']:.2f} | {lv['e2e_s']['p50']} | "
                     f"{lv['e2e_s']['p90']} | {lv['outcomes']} |")
    o, b, rec = r["overload"], r["baseline"], r["recovery"]
    lines += ["", f"Saturation: **{r['saturation_per_s']:.2f} req/s** completed (best steady completion rate of the "
              f"ramp). Overload offered {o['offered_per_s']:.2f} req/s (Poisson) for {a['duration_s']:g} s; baseline and "
              f"recovery offer {b['offered_per_s']:.2f} req/s, evenly spaced. completed/s = OK requests / phase length.",
              "",
              "| phase | offered req/s | sent | completed/s | e2e p50 (s) | e2e p90 (s) | e2e p99 (s) | outcomes |",
              "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, ph in (("baseline", b), ("overload", o), ("recovery", rec)):
        e = ph["e2e_s"]
        lines.append(f"| {name} | {ph['offered_per_s']:.2f} | {ph['sent']} | {ph['completed_per_s']:.2f} | {e['p50']} | "
                     f"{e['p90']} | {e['p99']} | {ph['outcomes']} |")
    h = r["health"]
    lines += ["", f"- Requests lost (no answer within {a['client_timeout_s']:g} s, a 5xx other than 503/504, or a stream "
              f"cut without `[DONE]`): **{r['lost']}** of {sum(r['all_outcomes'].values())}.",
              f"- Completed during overload (steady state, after {a['warmup_s']:g} s): {o['steady_completed_per_s']:.2f} "
              f"req/s = {o['steady_completed_per_s'] / max(1e-9, r['saturation_per_s']):.2f}x the saturation rate (goodput "
              f"kept under 3x load); Retry-After values sent with 429/503: {', '.join(o['retry_after_values']) or 'none'} (s).",
              f"- /health during overload: {h['probes']} probes, statuses {h['by_status']}, latency p50 "
              f"{h['latency_p50_s'] * 1e3:.1f} ms, p99 {h['latency_p99_s'] * 1e3:.1f} ms, max {h['latency_max_s'] * 1e3:.0f} ms.",
              f"- Recovery: after the load dropped to {rec['offered_per_s']:.2f} req/s, every request sent "
              f"{rec['recovered_after_s']} s later or after completed within {rec['ok_e2e_threshold_s']} s "
              f"(1.5x the baseline e2e p90; recovery phase {a['recovery_s']:g} s)."]
    for name, mm in r["memory"].items():
        lines.append(f"- {name} resident memory: start {mm['start_mib']} MiB, after warm-up {mm['after_warmup_mib']} MiB, "
                     f"end {mm['end_mib']} MiB, peak {mm['peak_mib']} MiB (growth after warm-up "
                     f"{mm['growth_after_warmup_mib']} MiB).")
    lk = r["leak_check"]
    lines.append(f"- Leak check after the run (frontend /metrics, {lk['settle_s']} s to settle): slots {lk['slots_by_state']}, "
                 f"held {lk['held_slots']:g}, in flight {lk['inflight']:g}, queued {lk['queue_depth']:g}, arena tokens "
                 f"used {lk['prompt_arena_used_tokens']:g} prompt / {lk['output_arena_used_tokens']:g} output"
                 + (f"; KV blocks used {lk['kv_blocks_used']:g} of {lk['kv_blocks_total']} (ring header)."
                    if lk.get("kv_blocks_total") else "; KV blocks not reported by this daemon."))
    lines += ["", f"Reproduce: `.venv/bin/{r['command']}` ({r['wall_s']:.0f} s wall).", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    out = pathlib.Path(args.out) if args.out else RESULTS / f"{args.date}-{args.machine}-overload"
    return write_result(result, out, markdown)


if __name__ == "__main__":
    sys.exit(main())
