"""One benchmark run: every system, isolated and under each interference condition.

    BenchPlan (systems, conditions, load, workload, placement)
      for each system: start its server pinned to the server CPUs -> ready (its processes'
        summed RSS is sampled from start to stop: memory.py, each run's "memory")
        for each repeat (--repeats): for each condition (isolated first): start the
          interferer(s) pinned to their CPUs
          warm-up -> for each offered level: scrape /metrics, sample per-core
          busy time, run_level(), scrape again -> level dict
          stop the interferer(s)
        stop the server
      -> results dict (JSON-ready: every request's timings) -> analyze()

Repeats alternate the conditions on the same running server (isolated, colocated,
isolated, colocated, ...), so each colocated sweep is compared with the isolated sweep
just before it; analyze() reports the colocated/isolated ratios of every repeat and
their spread, which says whether two systems' degradations differ by more than the
run-to-run noise.

A system that is not installed, or fails to start, is recorded with its reason
and skipped; so is an interferer whose tool is missing. Nothing is silently dropped.
"""
from __future__ import annotations

import asyncio
import dataclasses
import datetime
import math
import os
import pathlib
import sys
import tempfile
import time
from typing import Callable

from . import analysis, stages
from .client import Endpoint
from .interference import (ALL_CPUS, InterferenceError, InterfererSpec, format_cpus, missing_reason,
                           start_interferer)
from .load import LoadConfig, LevelResult, new_session, run_level, warm_up
from .machine import cpu_busy, cpu_times, machine_info, wait_quiet
from .memory import RssSampler, summary as memory_summary
from .metrics import RequestRecord, Slo, summarize
from .progress import Progress
from .servers import RunningServer, ServerError, ServerSpec, http_get, server_spec, start_server, wait_ready
from .workload import WorkRequest, WorkloadSpec, build_requests


@dataclasses.dataclass(frozen=True)
class Condition:
    """'isolated', or one or more interferers running together."""
    interferers: tuple[InterfererSpec, ...] = ()

    @property
    def label(self) -> str:
        return "isolated" if not self.interferers else "colocated:" + "+".join(i.label for i in self.interferers)

    @property
    def colocated(self) -> bool:
        return bool(self.interferers)


@dataclasses.dataclass(frozen=True)
class BenchPlan:
    systems: tuple[str, ...]
    conditions: tuple[Condition, ...]
    load: LoadConfig
    workload: WorkloadSpec
    slo: Slo
    model: str = "default"                 # default | null (blink's echo daemon)
    server_cpus: tuple[int, ...] | None = None
    client_cpus: tuple[int, ...] | None = None
    server_threads: int = 2
    ready_timeout_s: float = 600.0
    url: str | None = None                 # drive this endpoint instead of starting systems
    url_model: str | None = None
    blink_args: tuple[str, ...] = ()
    max_model_len: int = 2048
    pool_size: int = 2048                  # distinct prompts prepared; a system's run uses each once
                                           # (cycled only beyond), so no server gets prefix-cache hits
    quiet_busy: float | None = None        # before each system, wait until every core is below this busy
    quiet_wait_s: float = 0.0              # ... for at most this long in the whole run
    foreign_busy: float = 0.25             # an idle core busier than this in an isolated level is flagged
    workdir: pathlib.Path = pathlib.Path(tempfile.gettempdir()) / "blink-bench"   # interferer inputs, server logs
    repeats: int = 1                       # rounds over the conditions per system (on the same server)

    def __post_init__(self):
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1 (got {self.repeats})")


def record_dict(r: RequestRecord) -> dict:
    ms = (lambda v: None if v is None else round(v * 1000.0, 3))
    return {"t_send_s": round(r.t_send_s, 6), "prompt_tokens": r.prompt_tokens,
            "server_prompt_tokens": r.server_prompt_tokens, "max_tokens": r.max_tokens,
            "output_tokens": r.output_tokens, "ttft_ms": ms(r.ttft_s), "tpot_ms": ms(r.tpot_s),
            "e2e_ms": ms(r.e2e_s), "itl_ms": [round(g * 1000.0, 3) for g in r.itl_s],
            "success": r.success, "timed_out": r.timed_out, "error": r.error, "finish_reason": r.finish_reason}


def _scrape(base_url: str, path: str | None) -> dict | None:
    if not path:
        return None
    try:
        status, body = http_get(base_url + path, timeout_s=5.0)
    except OSError:
        return None
    return stages.parse_histograms(body.decode(errors="replace")) if status == 200 else None


class Runner:
    def __init__(self, plan: BenchPlan, tokenizer, log: Callable[[str], None] = None, out_dir: pathlib.Path = None):
        self.plan = plan
        self.tok = tokenizer
        self.log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        self.out_dir = out_dir or pathlib.Path("bench/out")
        self.pool: list[WorkRequest] = []
        self.quiet_waited_s = 0.0
        self.cursor = 0          # next unused prompt of the pool in the current system's run

    def _count_tokens(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def prepare_workload(self) -> None:
        n = max(self.plan.load.requests_for(lv) for lv in self.plan.load.levels) + self.plan.load.warmup_requests
        t0 = time.monotonic()
        self.pool = build_requests(self.plan.workload, self.tok, max(n, self.plan.pool_size))
        self.log(f"workload {self.plan.workload.name}: {len(self.pool)} distinct prompts in "
                 f"{time.monotonic() - t0:.1f} s (mean {sum(r.prompt_tokens for r in self.pool) / len(self.pool):.0f} "
                 f"prompt / {sum(r.output_tokens for r in self.pool) / len(self.pool):.0f} output tokens)")

    def run(self) -> dict:
        plan = self.plan
        if not self.pool:
            self.prepare_workload()
        started = datetime.datetime.now().astimezone()
        results = {"meta": {
            "started": started.isoformat(timespec="seconds"), "machine": machine_info(),
            "load": dataclasses.asdict(plan.load), "workload": plan.workload.describe(),
            "slo": dataclasses.asdict(plan.slo), "model": plan.model,
            "placement": {"server_cpus": format_cpus(plan.server_cpus), "client_cpus": format_cpus(plan.client_cpus),
                          "server_threads": plan.server_threads},
            "argv": sys.argv}, "runs": [], "skipped": []}
        usable_conditions = []
        for cond in plan.conditions:
            reasons = [r for i in cond.interferers if (r := missing_reason(i.kind))]
            if reasons:
                self.log(f"SKIPPED condition {cond.label}: " + "; ".join(reasons))
                results["skipped"].append({"condition": cond.label, "reason": "; ".join(reasons)})
            else:
                usable_conditions.append(cond)
        targets = [("url", None)] if plan.url else [(s, None) for s in plan.systems]
        for system, _ in targets:
            try:
                spec = self._spec(system)
            except ServerError as e:
                self.log(f"SKIPPED system {system}: {e}")
                results["skipped"].append({"system": system, "reason": str(e)})
                continue
            results["runs"] += self._run_system(spec, usable_conditions, results["skipped"])
        results["meta"]["finished"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        results["analysis"] = analyze(results)
        return results

    def _spec(self, system: str) -> ServerSpec:
        plan = self.plan
        if system == "url":
            return ServerSpec("url", (), (), plan.url.rstrip("/"), plan.url_model or "", "external endpoint",
                              metrics_path="/metrics")
        return server_spec(system, model=plan.model, cpus=plan.server_cpus, threads=plan.server_threads,
                           max_model_len=plan.max_model_len, blink_args=plan.blink_args)

    def _idle_cores(self) -> set[int] | None:
        """Cores that run nothing of this benchmark in an isolated sweep (None: cannot tell)."""
        plan = self.plan
        if plan.server_cpus is None or plan.client_cpus is None:
            return None
        return set(ALL_CPUS) - set(plan.server_cpus) - set(plan.client_cpus) or None

    def _wait_quiet(self, cores: set[int] | None = None) -> dict | None:
        plan = self.plan
        if plan.quiet_busy is None:
            return None
        left = max(0.0, plan.quiet_wait_s - self.quiet_waited_s)
        waited, busy = wait_quiet(plan.quiet_busy, left, cores=cores)
        self.quiet_waited_s += waited
        quiet = bool(busy) and max(busy.values()) < plan.quiet_busy
        self.log(f"quiet wait: {waited:.0f} s, CPU busy {busy} ({'quiet' if quiet else 'NOT quiet, going on'})")
        return {"waited_s": round(waited, 1), "busy": busy, "quiet": quiet, "max_busy": plan.quiet_busy}

    def _run_system(self, spec: ServerSpec, conditions: list[Condition], skipped: list) -> list[dict]:
        server: RunningServer | None = None
        sampler: RssSampler | None = None
        mem = None                 # stays None for --url: no server process of ours to sample
        runs = []
        quiet = self._wait_quiet()
        # Every system sees the same prompt sequence, each prompt once (isolated and colocated
        # sweeps, all levels): a repeated prompt would be a free prefix-cache hit for the
        # servers that cache prefixes (vLLM, llama-server) and measure that cache, not serving.
        self.cursor = 0
        try:
            if spec.system != "url":
                log_path = self.plan.workdir / "logs" / f"{spec.system}-{int(time.time())}.log"
                self.log(f"starting {spec.system} ({spec.version}) on CPUs {format_cpus(spec.cpus)}: "
                         f"{' '.join(spec.argv)}")
                server = start_server(spec, log_path)
                # Summed RSS of the server's processes from its start (loading counts) to just
                # before it is stopped: bench/memory.py.
                sampler = RssSampler(server.proc.pid).start()
                server.ready_s = wait_ready(server, spec.base_url, spec.model_name, self.plan.ready_timeout_s,
                                            spec.health_path)
                sampler.mark("ready")
                self.log(f"{spec.system} ready after {server.ready_s:.1f} s")
            for rep in range(self.plan.repeats):
                for cond in conditions:
                    # An isolated sweep also waits for the cores it leaves idle to be idle.
                    before = (self._wait_quiet(self._idle_cores()) if not cond.colocated and self._idle_cores()
                              else None)
                    if self.plan.repeats > 1:
                        self.log(f"{spec.system}: repeat {rep + 1}/{self.plan.repeats}, {cond.label}")
                    runs.append(self._run_condition(spec, server, cond))
                    runs[-1]["repeat"] = rep
                    runs[-1]["quiet_before_system"] = quiet
                    runs[-1]["quiet_before_sweep"] = before
        except ServerError as e:
            self.log(f"SKIPPED system {spec.system}: {e}")
            skipped.append({"system": spec.system, "reason": str(e)})
        finally:
            if sampler is not None:
                mem = sampler.stop()
                self.log(f"{spec.system}: {memory_summary(mem)}")
            if server is not None:
                server.stop()
            for r in runs:         # the server's whole life: the same dict in each of its runs
                r["memory"] = mem
        return runs

    def _run_condition(self, spec: ServerSpec, server: RunningServer | None, cond: Condition) -> dict:
        plan = self.plan
        ep = Endpoint(spec.base_url, spec.model_name, spec.extra_body, spec.usage_in_stream)
        run = {"system": spec.system, "condition": cond.label, "colocated": cond.colocated,
               "server": {**spec.describe(), "ready_s": server.ready_s if server else None,
                          "log": str(server.log_path) if server else None},
               "interferers": [], "levels": [], "error": None}
        running = []
        try:
            for ispec in cond.interferers:
                it = start_interferer(ispec, plan.workdir)
                running.append(it)
                run["interferers"].append(it.describe())
                self.log(f"interferer {ispec.label} running: {it.command}")
            if running:
                time.sleep(2.0)  # let the neighbours reach their steady state before measuring
            asyncio.run(self._drive(spec, ep, server, cond, run))
        except InterferenceError as e:
            run["error"] = str(e)
            self.log(f"condition {cond.label} failed: {e}")
        finally:
            for it in running:
                if not it.alive():
                    run["error"] = (run["error"] or "") + f" interferer {it.spec.kind} died during the run"
                it.stop()
        return run

    async def _drive(self, spec, ep: Endpoint, server, cond: Condition, run: dict) -> None:
        plan = self.plan
        async with new_session() as session:
            t0 = time.monotonic()
            warm = await warm_up(session, ep, plan.load, self._window(), self._count_tokens)
            self.cursor += len(warm)
            run["warmup"] = {"requests": len(warm), "failed": sum(1 for r in warm if not r.success),
                             "seconds": round(time.monotonic() - t0, 2),
                             "errors": sorted({r.error for r in warm if r.error})[:3]}
            if warm and all(not r.success for r in warm):
                run["error"] = f"every warm-up request failed: {run['warmup']['errors']}"
                self.log(f"{spec.system} {cond.label}: {run['error']}")
                return
            for i, level in enumerate(plan.load.levels):
                if server is not None and not server.alive():
                    run["error"] = f"server exited (code {server.proc.returncode}) before level {level}"
                    self.log(f"{spec.system}: {run['error']}; log tail:\n{server.log_tail()}")
                    return
                run["levels"].append(await self._level(session, spec, ep, cond, i, level))

    async def _level(self, session, spec, ep, cond, i: int, level: float) -> dict:
        plan = self.plan
        work = self._window()        # the unused prompts first: levels and sweeps never replay each other
        start = self.cursor
        total = None if plan.load.mode == "concurrency" else plan.load.requests_for(level)
        unit = "conc" if plan.load.mode == "concurrency" else "req/s"
        bar = Progress(f"{spec.system} {cond.label[:28]} {i + 1}/{len(plan.load.levels)} {level:g} {unit}", total)
        before = await asyncio.to_thread(_scrape, spec.base_url, spec.metrics_path)
        cpu0 = cpu_times()
        res: LevelResult = await run_level(session, ep, plan.load, level, work, self._count_tokens,
                                           on_done=lambda r: bar.update(r.success))
        cpu1 = cpu_times()
        after = await asyncio.to_thread(_scrape, spec.base_url, spec.metrics_path)
        bar.close()
        # Requests cut at the level's end may not be in records: skip one in-flight window more.
        self.cursor += len(res.records) + math.ceil(level)
        summary = summarize(res.records, res.duration_s, plan.slo)
        busy = cpu_busy(cpu0, cpu1)
        return {"offered": level, "t_start_unix": res.t_start_unix, "summary": summary.as_dict(),
                "foreign_load": self._foreign(busy, cond),
                "stages": stages.stage_budget(before, after) if before is not None and after is not None else None,
                "cpu_busy": busy, "loadavg_1m": round(os.getloadavg()[0], 2),
                "prompts": {"first": start, "end": self.cursor, "pool": len(self.pool),
                            "reused": self.cursor > len(self.pool)},
                "requests": [record_dict(r) for r in res.records]}


    def _window(self) -> list[WorkRequest]:
        """The pool rotated to start at the first unused prompt (cycled only once it runs out)."""
        c = self.cursor % len(self.pool)
        return self.pool[c:] + self.pool[:c]

    def _foreign(self, busy: dict[str, float], cond: Condition) -> bool | None:
        """In an isolated level, was a core that runs nothing of this benchmark busy? None: cannot tell."""
        plan = self.plan
        if cond.colocated or plan.server_cpus is None or plan.client_cpus is None:
            return None
        idle_cores = self._idle_cores() or set()
        idle = [v for k, v in busy.items() if int(k) in idle_cores and math.isfinite(v)]
        return any(v > plan.foreign_busy for v in idle) if idle else None


def _points(run: dict) -> list[analysis.LevelPoint]:
    return [analysis.LevelPoint(lv["offered"], lv["summary"]["ttft"]["p99_ms"], lv["summary"]["tpot"]["p99_ms"],
                                lv["summary"]["request_throughput"], lv["summary"]["output_throughput"])
            for lv in run["levels"]]


def analyze(results: dict) -> dict:
    """Saturation fits, the reference operating range, Table 6/7 rows and colocated/isolated ratios."""
    runs = [r for r in results["runs"] if r["levels"]]
    out: dict = {"fits": {}, "reference": None, "table": [], "notes": [], "degradation": [], "least_degraded": {}}
    repeated = any(r.get("repeat", 0) for r in runs)
    for r in runs:
        pts = _points(r)
        if len(pts) >= 3:
            fit = analysis.fit_saturation([p.offered for p in pts], [p.request_throughput for p in pts])
            out["fits"][_run_key(r, repeated)] = fit.as_dict()
    out["degradation"] = degradation(runs)
    for cond in sorted({d["condition"] for d in out["degradation"]}):
        out["least_degraded"][cond] = analysis.least_degraded(
            {d["system"]: d["tok_ratio_geo"] for d in out["degradation"] if d["condition"] == cond})
    iso = [r for r in runs if not r["colocated"]]
    if not iso:
        out["notes"].append("no isolated run: no operating range")
        return out
    ref = iso[0]  # the first system in --systems (blink by default) defines the operating range
    pts = _points(ref)
    levels = [p.offered for p in pts]
    if len(pts) >= 3:
        fit = analysis.fit_saturation(levels, [p.request_throughput for p in pts])
        operating = analysis.operating_levels(levels, fit)
        fit_d = fit.as_dict()
    else:
        # Two points fit any hinge: too few for a knee, so every level counts.
        operating, fit_d = levels, None
        out["notes"].append("fewer than 3 load levels: no saturation fit, the operating range is every level")
    sat_level = max(operating)
    out["reference"] = {"system": ref["system"], "condition": ref["condition"], "fit": fit_d,
                        "operating_levels": operating, "saturation_level": sat_level}
    iso_rows = {}
    for r in runs:
        row = {"system": r["system"], "condition": r["condition"], "repeat": r.get("repeat", 0),
               **analysis.summary_row(_points(r), operating, sat_level)}
        if not r["colocated"]:
            iso_rows[(r["system"], row["repeat"])] = row
        out["table"].append(row)
    for row in out["table"]:
        base = iso_rows.get((row["system"], row["repeat"]))
        if row["condition"] != "isolated" and base is not None:
            row["ratio"] = {k: analysis.ratio(row[k], base[k])
                            for k in ("geo_p99_ttft_ms", "geo_p99_tpot_ms", "tput_at_sat_rps", "tok_tput_at_sat")}
    return out


def _run_key(run: dict, repeated: bool) -> str:
    key = f"{run['system']}/{run['condition']}"
    return f"{key} #{run.get('repeat', 0) + 1}" if repeated else key


def degradation(runs: list[dict]) -> list[dict]:
    """Per system and colocated condition: colocated/isolated output-token throughput and TPOT p50
    at each level, one ratio per repeat (each colocated sweep against the isolated sweep of the same
    repeat), with median, min and max; and per repeat the geometric mean of the throughput ratios
    over the levels (`tok_ratio_geo`), the one number the systems are ranked by."""
    iso = {(r["system"], r.get("repeat", 0)): r for r in runs if not r["colocated"]}
    groups: dict[tuple[str, str], dict] = {}
    for r in runs:
        base = iso.get((r["system"], r.get("repeat", 0))) if r["colocated"] else None
        if base is None:
            continue
        before = {lv["offered"]: lv["summary"] for lv in base["levels"]}
        g = groups.setdefault((r["system"], r["condition"]), {"tok": {}, "tpot": {}, "geo": []})
        ratios = []
        for lv in r["levels"]:
            s0, s1 = before.get(lv["offered"]), lv["summary"]
            if s0 is None:
                continue
            t = analysis.ratio(s1["output_throughput"], s0["output_throughput"])
            g["tok"].setdefault(lv["offered"], []).append(t)
            g["tpot"].setdefault(lv["offered"], []).append(
                analysis.ratio(s1["tpot"].get("p50_ms"), s0["tpot"].get("p50_ms")))
            ratios.append(t)
        g["geo"].append(analysis.geomean(ratios))
    return [{"system": system, "condition": cond, "repeats": len(g["geo"]),
             "tok_ratio_geo": analysis.spread(g["geo"]),
             "tok_ratio_by_level": {lvl: analysis.spread(v) for lvl, v in sorted(g["tok"].items())},
             "tpot_p50_ratio_by_level": {lvl: analysis.spread(v) for lvl, v in sorted(g["tpot"].items())}}
            for (system, cond), g in groups.items()]


def nan_to_none(x):
    """JSON has no NaN: replace it (recursively) by null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): nan_to_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [nan_to_none(v) for v in x]
    return x
