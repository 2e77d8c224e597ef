"""Outputs of a run: JSON (every request), CSV (one row per level), markdown summary, PNG plots.

    results dict (sweep.Runner.run) -> write_all(results, out_dir, name)
        NAME.json.gz  everything, NaN as null (gzip: every request's record, ~10x smaller; results
                   are committed and the tree travels to a lent GPU machine within 64 MiB)
        NAME.csv   system, condition, offered load, throughput, latency percentiles, stages
        NAME.md    setup, Table 6/7-style summary with colocated/isolated ratios, their spread
                   over repeats (--repeats), per-level tables, memory bandwidth, each server's
                   peak resident memory (memory.py)
        NAME-latency.png, NAME-throughput.png  (plots.py)
"""
from __future__ import annotations

import csv
import gzip
import json
import math
import pathlib

from .stages import STAGES, missing_stages
from .sweep import nan_to_none

CSV_FIELDS = ("system", "condition", "repeat", "offered", "requests", "completed", "failed", "timeouts", "duration_s",
              "request_throughput", "output_throughput", "total_token_throughput", "goodput",
              "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "ttft_p95_ms", "ttft_p99_ms", "ttft_p99.9_ms",
              "tpot_mean_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_p95_ms", "tpot_p99_ms", "tpot_p99.9_ms",
              "itl_mean_ms", "itl_p50_ms", "itl_p90_ms", "itl_p95_ms", "itl_p99_ms", "itl_p99.9_ms",
              "e2e_mean_ms", "e2e_p50_ms", "e2e_p90_ms", "e2e_p95_ms", "e2e_p99_ms", "e2e_p99.9_ms",
              *(f"stage_{s}_ms" for s in STAGES), "cpu_busy")


def csv_rows(results: dict) -> list[dict]:
    rows = []
    for run in results["runs"]:
        for lv in run["levels"]:
            s = lv["summary"]
            row = {"system": run["system"], "condition": run["condition"], "repeat": run.get("repeat", 0),
                   "offered": lv["offered"]}
            for k in CSV_FIELDS[4:13]:
                row[k] = s.get(k)
            for metric in ("ttft", "tpot", "itl", "e2e"):
                for stat in ("mean", "p50", "p90", "p95", "p99", "p99.9"):
                    row[f"{metric}_{stat}_ms"] = s[metric].get(f"{stat}_ms")
            st = lv.get("stages") or {}
            for stage in STAGES:
                row[f"stage_{stage}_ms"] = (st.get(stage) or {}).get("mean_ms")
            row["cpu_busy"] = " ".join(f"cpu{k}={v}" for k, v in (lv.get("cpu_busy") or {}).items())
            rows.append(row)
    return rows


def write_csv(results: dict, path: pathlib.Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for row in csv_rows(results):
            w.writerow({k: _cell(v) for k, v in row.items()})


def _cell(v):
    if isinstance(v, float):
        return "" if not math.isfinite(v) else f"{v:.4g}"
    return "" if v is None else v


def _f(v, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return f"{v:.{digits}f}"


def _x(v) -> str:
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.2f}x"


def markdown(results: dict, name: str, notes: str = "") -> str:
    meta, an = results["meta"], results.get("analysis") or {}
    m = meta["machine"]
    load, wl, pl = meta["load"], meta["workload"], meta["placement"]
    unit = "concurrent requests" if load["mode"] == "concurrency" else "req/s"
    lines = [f"# Interference benchmark: {name}", ""]
    if notes:
        lines += [notes.strip(), ""]
    lines += [
        "## Setup", "",
        f"- Date: {meta['started']} to {meta.get('finished', '?')}",
        f"- Machine: {m['cpu_model']}, {m['logical_cpus']} logical CPUs, {m['mem_total_gib']} GiB, "
        f"{m['os']}, Python {m['python']}; load average at start {m.get('loadavg_at_start')}",
        f"- Model: {meta['model']}; workload {wl['name']} (input {wl['input_len']}, output {wl['output_len']} "
        f"tokens, fixed with ignore_eos), seed {wl['seed']}",
        f"- Load: {load['mode']}, levels {', '.join(f'{x:g}' for x in load['levels'])} {unit}, "
        f"{load['duration_s']:g} s per level, {load['warmup_requests']} warm-up requests, "
        f"per-request timeout {load['timeout_s']:g} s (counted as a failure)"
        + (f", requests still running {load['drain_s']:g} s after a level's end are cut (counted as timeouts)"
           if load.get("drain_s") is not None else ""),
        prompt_line(results),
        f"- Placement: server CPUs {pl['server_cpus']} ({pl['server_threads']} threads), "
        f"client CPUs {pl['client_cpus']}",
        f"- Command: `{' '.join(meta.get('argv') or [])}`", ""]
    systems = {}
    for run in results["runs"]:
        systems.setdefault(run["system"], run["server"])
    if systems:
        lines += ["### Systems", ""]
        for sysname, srv in systems.items():
            lines.append(f"- **{sysname}**: {srv['version']}; `{srv['command']}`"
                         + (f"; request extras {srv['request_extras']}" if srv.get("request_extras") else ""))
        lines.append("")
    inter = {i["kind"]: i for run in results["runs"] for i in run.get("interferers", [])}
    if inter:
        lines += ["### Interferers", ""]
        for i in inter.values():
            lines.append(f"- **{i['kind']}** x{i['threads']} on CPUs {i['cpus']} ({i['version']}): `{i['command']}`")
        lines.append("")
    if results.get("skipped"):
        lines += ["### Not run", ""]
        for s in results["skipped"]:
            what = s.get("system") or s.get("condition")
            lines.append(f"- {what}: {s['reason'].splitlines()[0]}")
        lines.append("")
    repeated = any(r.get("repeat", 0) for r in results["runs"])
    ref = an.get("reference")
    if ref:
        fit = ref.get("fit") or {}
        lines += ["## Summary (paper Tables 6 and 7)", "",
                  f"Operating range from the two-segment fit of **{ref['system']}** ({ref['condition']}): "
                  f"knee at {_f(fit.get('knee'), 2)} {unit} "
                  f"({'saturated' if fit.get('saturated') else 'no plateau inside the sweep'}), "
                  f"so levels {', '.join(f'{x:g}' for x in ref['operating_levels'])}; throughput is read at "
                  f"{ref['saturation_level']:g} {unit}. Geometric means over those levels; "
                  f"[brackets] = colocated / isolated of the same system.", "",
                  "| system | condition | geo P99 TTFT (ms) | geo P99 TPOT (ms) | req/s at sat. | tok/s at sat. |",
                  "|---|---|---|---|---|---|"]
        for row in an["table"]:
            r = row.get("ratio") or {}
            br = (lambda k: f" [{_x(r.get(k))}]" if r else "")
            lines.append(f"| {row['system']} | {row['condition']}{_rep(row, repeated)} | {_f(row['geo_p99_ttft_ms'])}{br('geo_p99_ttft_ms')} "
                         f"| {_f(row['geo_p99_tpot_ms'])}{br('geo_p99_tpot_ms')} "
                         f"| {_f(row['tput_at_sat_rps'], 3)}{br('tput_at_sat_rps')} "
                         f"| {_f(row['tok_tput_at_sat'])}{br('tok_tput_at_sat')} |")
        lines.append("")
    if repeated and an.get("degradation"):
        lines += degradation_lines(an, unit)
    if an.get("fits"):
        lines += ["### Saturation fits (every curve)", "", "| run | knee | plateau req/s | saturated |", "|---|---|---|---|"]
        for key, fit in an["fits"].items():
            lines.append(f"| {key} | {_f(fit['knee'], 2)} | {_f(fit['plateau'], 3)} | {fit['saturated']} |")
        lines.append("")
    lines += ["## Per level", ""]
    for run in results["runs"]:
        lines += [f"### {run['system']} / {run['condition']}{_rep(run, repeated)}", ""]
        q = run.get("quiet_before_system")
        if q:
            lines += [f"Before this system started: waited {q['waited_s']:g} s for quiet, CPU busy then "
                      f"{', '.join(f'{k}: {v:.0%}' for k, v in q['busy'].items())}"
                      f"{'' if q['quiet'] else ' (not quiet: went on)'}.", ""]
        qs = run.get("quiet_before_sweep")
        if qs:
            lines += [f"Before this sweep: waited {qs['waited_s']:g} s for the idle cores "
                      f"({', '.join(f'{k}: {v:.0%}' for k, v in qs['busy'].items())})"
                      f"{'' if qs['quiet'] else ' (not quiet: went on)'}.", ""]
        flagged = [lv["offered"] for lv in run["levels"] if lv.get("foreign_load")]
        if flagged:
            lines += [f"**Foreign load** (a core running nothing of this benchmark was busy) during levels "
                      f"{', '.join(f'{x:g}' for x in flagged)}: other processes shared the machine.", ""]
        if run.get("error"):
            lines += [f"Error: {run['error']}", ""]
        if not run["levels"]:
            continue
        lines += [f"| {unit} | done/sent | fail (timeout) | req/s | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms "
                  f"| ITL p50/p99 ms | E2E p50/p99 ms | goodput | CPU busy | load 1m |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for lv in run["levels"]:
            s = lv["summary"]
            busy = " ".join(f"{k}:{v:.0%}" for k, v in (lv.get("cpu_busy") or {}).items()
                            if isinstance(v, float) and math.isfinite(v))
            if lv.get("foreign_load"):
                busy += " **foreign load**"
            lines.append(
                f"| {lv['offered']:g} | {s['completed']}/{s['requests']} | {s['failed']} ({s['timeouts']}) "
                f"| {_f(s['request_throughput'], 3)} | {_f(s['output_throughput'])} "
                f"| {_f(s['ttft']['p50_ms'])} / {_f(s['ttft']['p99_ms'])} "
                f"| {_f(s['tpot']['p50_ms'])} / {_f(s['tpot']['p99_ms'])} "
                f"| {_f(s['itl']['p50_ms'])} / {_f(s['itl']['p99_ms'])} "
                f"| {_f(s['e2e']['p50_ms'])} / {_f(s['e2e']['p99_ms'])} "
                f"| {_f(s['goodput'], 3) if s['goodput'] is not None else '-'} | {busy} "
                f"| {_f(lv.get('loadavg_1m'), 2)} |")
        lines.append("")
        budgets = [lv["stages"] for lv in run["levels"] if lv.get("stages")]
        if budgets:
            shown = [k for k in STAGES if any(b.get(k) for b in budgets)]
            lines += ["Server-side stage budget (mean ms per request, from /metrics):", "",
                      f"| {unit} | " + " | ".join(shown) + " |", "|---|" + "---|" * len(shown)]
            for lv in run["levels"]:
                st = lv.get("stages") or {}
                lines.append(f"| {lv['offered']:g} | " + " | ".join(_f((st.get(k) or {}).get("mean_ms"), 2)
                                                              for k in shown) + " |")
            missing = missing_stages(budgets)
            if missing:
                lines.append("")
                lines.append(f"Not exposed by this server's /metrics: {', '.join(missing)}.")
            lines.append("")
    lines += bandwidth_lines(results)
    lines += memory_lines(results)
    for note in an.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines).rstrip() + "\n"


def _rep(row: dict, repeated: bool) -> str:
    return f" #{row.get('repeat', 0) + 1}" if repeated else ""


def _spread(d: dict | None) -> str:
    if not d or not d.get("values"):
        return "-"
    if len(d["values"]) == 1:
        return f"{d['median']:.2f}x"
    return f"{d['median']:.2f}x ({d['min']:.2f}-{d['max']:.2f})"


def degradation_lines(an: dict, unit: str) -> list[str]:
    """Colocated / isolated over the repeats: median (min-max) per system, level and condition."""
    deg = an["degradation"]
    levels = sorted({float(k) for d in deg for k in d["tok_ratio_by_level"]})
    lines = ["## Colocated / isolated over repeats", "",
             "Each repeat runs the isolated sweep, then the colocated one, on the same server; a ratio compares "
             "the two sweeps of one repeat. Median (min-max) over the repeats. Output-token throughput: below "
             "1.00x the interference slowed the system. TPOT p50: above 1.00x it did.", "",
             "| system | condition | repeats | tok/s, geo. mean over levels | "
             + " | ".join(f"tok/s at {lv:g}" for lv in levels) + " | "
             + " | ".join(f"TPOT p50 at {lv:g}" for lv in levels) + " |",
             "|---|---|---:|---|" + "---|" * (2 * len(levels))]
    for d in deg:
        tok = {float(k): v for k, v in d["tok_ratio_by_level"].items()}
        tpot = {float(k): v for k, v in d["tpot_p50_ratio_by_level"].items()}
        lines.append(f"| {d['system']} | {d['condition']} | {d['repeats']} | {_spread(d['tok_ratio_geo'])} | "
                     + " | ".join(_spread(tok.get(lv)) for lv in levels) + " | "
                     + " | ".join(_spread(tpot.get(lv)) for lv in levels) + " |")
    lines.append("")
    for cond, best in (an.get("least_degraded") or {}).items():
        if not best:
            continue
        if best["runner_up"] is None:
            lines.append(f"- {cond}: only {best['system']} was measured.")
        elif best["clear"]:
            lines.append(f"- {cond}: **{best['system']}** degrades least (median {best['median']:.2f}x), clear of "
                         f"the spread: its worst repeat is above every other system's best.")
        else:
            lines.append(f"- {cond}: {best['system']} has the highest median ({best['median']:.2f}x), but not clear "
                         f"of the spread: {best['runner_up']}'s best repeat reaches its worst, so the order "
                         f"between them is within run-to-run noise.")
    lines.append("")
    return lines


def bandwidth_lines(results: dict) -> list[str]:
    """blink's 1-stream decode (isolated, 1 / TPOT p50) as a fraction of the triad bound, where the
    run probed it (bench/bandwidth.py: blink on the default model)."""
    from .bandwidth import decode_fraction
    bw = results["meta"].get("bandwidth")
    if not bw:
        return []
    lines = ["## Memory bandwidth", "",
             f"Triad {bw['triad_gb_s']:.1f} GB/s with {bw['threads']} threads before the sweep; blink streams "
             f"{bw['weight_bytes_per_token'] / 1e6:.1f} MB of weights a decode step, so one stream's bound is "
             f"{bw['decode_bound_tok_s']:.0f} tok/s."]
    for run in results["runs"]:
        one = [lv for lv in run["levels"] if lv["offered"] == 1 and lv["summary"]["tpot"]["p50_ms"]]
        if run["system"] == "blink" and not run.get("colocated") and one:
            tok_s, frac = decode_fraction(bw, one[0]["summary"]["tpot"]["p50_ms"])
            lines.append(f"blink's 1-stream decode (1 / TPOT p50, {run['condition']}) {tok_s:.1f} tok/s: "
                         f"{frac:.2f} of the bound (issue 21 asks for >= 0.6).")
    return lines + [""]


PEER_NAMES = {"vllm": "vLLM", "llamaserver": "llama-server", "llamacpp": "llama-cpp-python"}


def memory_lines(results: dict) -> list[str]:
    """Each server's peak summed RSS over its life (bench/memory.py: run["memory"], the same dict
    in each of a system's runs), the processes at that peak, the sum of their VmHWM, and blink's
    peak as a fraction of each peer's. Nothing for results from before the measurement; a system
    without it (--url, or an older run merged in) gets a note instead of a row."""
    runs = results.get("runs") or []
    if not any("memory" in r for r in runs):
        return []
    mems: dict[str, dict | None] = {}
    why: dict[str, str] = {}
    for run in runs:
        mem = run.get("memory")
        if mem and mem.get("peak_rss_mib") is not None:
            mems.setdefault(run["system"], mem)
        elif run["system"] not in why:
            why[run["system"]] = ("not measured: bench did not start this server (--url)" if "memory" in run
                                  else "not recorded (results from before the memory measurement)")
    period = next((m.get("period_s") for m in mems.values()), 0.5)
    lines = ["## Memory", "",
             f"Peak of the summed resident memory (VmRSS) of every process of the server (its session and "
             f"their descendants), sampled every {period:g} s from its start to its stop (loading and every "
             f"sweep); pages shared between its processes count once per process that has them resident. "
             f"Sum of VmHWM: each process's own peak, reached at different times, so an upper bound of the "
             f"peak.", ""]
    if mems:
        lines += ["| system | peak RSS (MiB) | at (s after start) | processes at the peak (MiB) | when ready (MiB) "
                  "| sum of VmHWM (MiB) |", "|---|---:|---:|---|---:|---:|"]
        for system, m in mems.items():
            procs = ", ".join(f"{p['name']} {p['rss_mib']:.1f}" for p in m.get("processes_at_peak") or [])
            ready = ((m.get("marks") or {}).get("ready") or {}).get("rss_mib")
            lines.append(f"| {system} | {_f(m['peak_rss_mib'])} | {_f(m.get('peak_at_s'))} | {procs or '-'} "
                         f"| {_f(ready)} | {_f(m.get('hwm_sum_mib'))} |")
        lines.append("")
    for system, reason in why.items():
        if system not in mems:
            lines.append(f"- {system}: {reason}.")
    blink = mems.get("blink")
    if blink:
        for system, m in mems.items():
            if system == "blink" or not m["peak_rss_mib"]:
                continue
            hwm = (f" (sum of VmHWM: {blink['hwm_sum_mib'] / m['hwm_sum_mib']:.2f})"
                   if blink.get("hwm_sum_mib") and m.get("hwm_sum_mib") else "")
            lines.append(f"- blink peak RSS / {PEER_NAMES.get(system, system)}'s: "
                         f"{blink['peak_rss_mib'] / m['peak_rss_mib']:.2f}{hwm}")
    return lines + [""]


def write_all(results: dict, out_dir: pathlib.Path, name: str, notes: str = "", plots: bool = True) -> list[pathlib.Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    jp = out_dir / f"{name}.json.gz"
    text = json.dumps(nan_to_none(results), indent=1, allow_nan=False) + "\n"
    with open(jp, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as gz:
        gz.write(text.encode())
    paths.append(jp)
    cp = out_dir / f"{name}.csv"
    write_csv(results, cp)
    paths.append(cp)
    mp = out_dir / f"{name}.md"
    if plots:
        from .plots import plot_all
        pngs = plot_all(results, out_dir, name)
        paths += pngs
        notes = (notes + "\n\n" if notes else "") + "\n".join(f"![{p.stem}]({p.name})" for p in pngs)
    mp.write_text(markdown(results, name, notes))
    paths.insert(2, mp)
    return paths


def prompt_line(results: dict) -> str:
    """Whether any system saw a prompt twice (a free prefix-cache hit for servers that cache)."""
    windows = [lv["prompts"] for r in results.get("runs", []) for lv in r.get("levels", []) if lv.get("prompts")]
    if not windows:
        return "- Prompts: drawn from a pool and cycled (older run: repeats were possible)"
    pool = max(w["pool"] for w in windows)
    used = max(w["end"] for w in windows)
    if any(w["reused"] for w in windows):
        return (f"- Prompts: {pool} distinct, but a system's run needed up to {used}: some prompts were sent "
                "twice, which servers with prefix caching answer partly from cache")
    return (f"- Prompts: every request of a system's run had its own prompt (at most {used} of a pool of "
            f"{pool}), the same sequence for every system; no prefix-cache hits are possible")

