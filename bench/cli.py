"""`blink bench`: the interference benchmark runner.

    flags (+ a preset) -> BenchPlan -> sweep.Runner: for each system (blink, vLLM CPU,
    llama.cpp, or any --url), isolated and under each --interferer, a sweep of
    offered loads -> report.write_all(): NAME.json / .csv / .md and PNG plots

Examples:
    blink bench --preset smoke --model null                 # seconds, echo daemon
    blink bench --systems blink,vllm,llamacpp --interferer pbzip2:1@1 --server-cpus 0
    blink bench --url http://127.0.0.1:8000 --url-model SmolLM2-135M-Instruct --preset cpu2
    blink bench --check                                     # what can run here
"""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import socket
import sys
import tempfile

# Sweeps. `paper`: §6.1 (13 levels 1..32 req/s, 60 s each, ShareGPT-like); the
# others fit a 2-core CPU machine with SmolLM2-135M.
PRESETS = {
    "paper": {"mode": "poisson", "levels": "1,2,3,4,5,6,8,10,12,16,20,24,32", "duration_s": 60.0,
              "workload": "sharegpt", "timeout_s": 300.0, "drain_s": None, "warmup": 8},
    "cpu2": {"mode": "concurrency", "levels": "1,2,4,8", "duration_s": 25.0, "workload": "cpu2",
             "timeout_s": 120.0, "drain_s": 30.0, "warmup": 4},
    "cpu2-poisson": {"mode": "poisson", "levels": "0.25,0.5,1,1.5,2,3", "duration_s": 30.0, "workload": "cpu2",
                     "timeout_s": 120.0, "drain_s": 30.0, "warmup": 4},
    "smoke": {"mode": "concurrency", "levels": "1,4", "duration_s": 2.0, "workload": "smoke",
              "timeout_s": 30.0, "drain_s": 10.0, "warmup": 2},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="cpu2", choices=sorted(PRESETS),
                   help="sweep preset (default cpu2: concurrency 1,2,4,8 x 25 s); flags below override it")
    p.add_argument("--check", action="store_true", help="say which systems and interferers can run here, then exit")
    g = p.add_argument_group("what to drive")
    g.add_argument("--systems", default="blink", help="comma list of blink, vllm, llamacpp (started and stopped "
                                                      "here, in this order; the first defines the operating range)")
    g.add_argument("--url", default=None, help="drive this running OpenAI-compatible endpoint instead")
    g.add_argument("--url-model", default=None, help="model name for --url (default: the first in /v1/models)")
    g.add_argument("--model", default="default", help="default (SmolLM2-135M-Instruct) | null (blink's echo daemon)")
    g.add_argument("--server-threads", type=int, default=None,
                   help="compute threads for every server (default: number of server CPUs)")
    g.add_argument("--blink-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `blink serve` (repeatable, e.g. --blink-arg=--max-batch-size=16)")
    g.add_argument("--max-model-len", type=int, default=2048, help="context length the servers are started with")
    g.add_argument("--ready-timeout-s", type=float, default=600.0, help="wait this long for a server to be ready")
    g = p.add_argument_group("load")
    g.add_argument("--mode", choices=("poisson", "constant", "concurrency"), default=None)
    g.add_argument("--levels", default=None, help="comma list of offered loads (req/s, or concurrencies)")
    g.add_argument("--duration-s", type=float, default=None, help="seconds per level")
    g.add_argument("--timeout-s", type=float, default=None, help="per-request timeout, counted as a failure")
    g.add_argument("--drain-s", type=float, default=None,
                   help="after each level's duration, wait this long for running requests, then cut them "
                        "(counted as timeouts); a negative value waits up to --timeout-s")
    g.add_argument("--warmup-requests", type=int, default=None, help="unmeasured requests before each sweep")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of Poisson gaps (1 = Poisson)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--repeats", type=int, default=1,
                   help="rounds over the conditions per system, alternating isolated and colocated on the same "
                        "server; the summary gives each round's colocated/isolated ratio and their spread")
    g = p.add_argument_group("workload")
    g.add_argument("--workload", default=None, help="sharegpt | sharegpt-small | cpu2 | smoke")
    g.add_argument("--input-len", default=None, help="N, uniform:LO:HI, normal:MEAN:STD or lognormal:MEAN:STD")
    g.add_argument("--output-len", default=None, help="same forms; sent as max_tokens with ignore_eos")
    g.add_argument("--dataset", default=None, help="ShareGPT-format JSON or JSONL file")
    g.add_argument("--slo", default=None, help="goodput SLOs in ms, e.g. ttft:2000,tpot:100")
    g = p.add_argument_group("interference and placement")
    g.add_argument("--interferer", action="append", default=[], metavar="SPEC",
                   help="a colocated condition: KIND:THREADS[@CPUS], several joined with + run together; "
                        "kinds pbzip2, stress-ng, compile, pyhog (repeatable; isolated always runs first)")
    g.add_argument("--interferer-cpus", default=None, help="default CPUs for interferers (e.g. 1)")
    g.add_argument("--server-cpus", default=None, help="CPUs for every server process (taskset-style list)")
    g.add_argument("--client-cpus", default=None, help="CPUs for this load generator")
    g.add_argument("--no-isolated", action="store_true", help="skip the isolated sweep")
    g.add_argument("--quiet-busy", type=float, default=None,
                   help="before each system, wait until every core is less busy than this (e.g. 0.15)")
    g.add_argument("--quiet-wait-s", type=float, default=600.0,
                   help="longest total quiet wait over the run (default 600)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default="bench/out", help="output folder (default bench/out)")
    g.add_argument("--name", default=None, help="file name stem (default DATE-HOST-bench)")
    g.add_argument("--notes", default="", help="text put at the top of the markdown summary")
    g.add_argument("--work-dir", default=str(pathlib.Path(tempfile.gettempdir()) / "blink-bench"),
                   help="interferer inputs and server logs (default: <tmp>/blink-bench)")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def _fail(msg: str) -> int:
    print(f"blink bench: {msg}", file=sys.stderr)
    return 2


def _levels(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--levels '{text}': expected numbers separated by commas") from None
    if not vals:
        raise ValueError("--levels is empty")
    return vals


def _drain(flag: float | None, preset: float | None) -> float | None:
    if flag is None:
        return preset
    return None if flag < 0 else flag


def _parse_condition(text: str, default_cpus):
    from .interference import InterfererSpec, parse_cpus
    from .sweep import Condition
    specs = []
    for part in text.split("+"):
        part = part.strip()
        body, at, cpus = part.partition("@")
        kind, colon, threads = body.partition(":")
        try:
            n = int(threads) if colon else 1
        except ValueError:
            raise ValueError(f"--interferer '{part}': threads must be a whole number") from None
        specs.append(InterfererSpec(kind.strip(), n, parse_cpus(cpus) if at else default_cpus))
    return Condition(tuple(specs))


def check() -> int:
    from .interference import KINDS, missing_reason, tool_version
    from .servers import SYSTEMS, ServerError, server_spec
    print("systems:")
    for s in SYSTEMS:
        try:
            spec = server_spec(s, model="default", cpus=None, threads=2)
            print(f"  {s:9s} ok       {spec.version}")
        except ServerError as e:
            print(f"  {s:9s} MISSING  {e}")
    print("interferers:")
    for k in KINDS:
        why = missing_reason(k)
        print(f"  {k:9s} {'MISSING  ' + why if why else 'ok       ' + tool_version(k)}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.check:
        return check()
    from .interference import InterferenceError, parse_cpus
    from .load import LoadConfig
    from .metrics import parse_slo
    from .sweep import BenchPlan, Condition
    from .workload import WorkloadError, load_tokenizer, spec_from_args
    preset = PRESETS[args.preset]
    try:
        server_cpus = parse_cpus(args.server_cpus)
        client_cpus = parse_cpus(args.client_cpus)
        interferer_cpus = parse_cpus(args.interferer_cpus)
        conditions = [] if args.no_isolated else [Condition()]
        conditions += [_parse_condition(c, interferer_cpus) for c in args.interferer]
        if not conditions:
            return _fail("nothing to run: --no-isolated and no --interferer")
        load = LoadConfig(mode=args.mode or preset["mode"], levels=_levels(args.levels or preset["levels"]),
                          duration_s=args.duration_s or preset["duration_s"],
                          timeout_s=args.timeout_s or preset["timeout_s"],
                          drain_s=_drain(args.drain_s, preset["drain_s"]),
                          warmup_requests=preset["warmup"] if args.warmup_requests is None else args.warmup_requests,
                          burstiness=args.burstiness, seed=args.seed)
        workload = spec_from_args(args.workload or preset["workload"], args.input_len, args.output_len,
                                  args.dataset, args.seed)
        slo = parse_slo(args.slo)
        systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
        if not systems and not args.url:
            return _fail("--systems is empty")
        if args.model not in ("default", "null"):
            return _fail(f"--model must be default or null (got {args.model})")
        if args.model == "null" and any(s != "blink" for s in systems) and not args.url:
            return _fail("--model null is blink's echo daemon; peers need --model default")
        ncpu = len(server_cpus) if server_cpus else len(os.sched_getaffinity(0))
        threads = args.server_threads or ncpu
        if threads < 1:
            return _fail("--server-threads must be >= 1")
        if args.repeats < 1:
            return _fail("--repeats must be >= 1")
    except (ValueError, InterferenceError, WorkloadError) as e:
        return _fail(str(e))
    url_model = args.url_model
    if args.url and not url_model:
        url_model = _first_model(args.url)
        if url_model is None:
            return _fail(f"{args.url}/v1/models lists no model (or does not answer); give --url-model")
    out_dir = pathlib.Path(args.out)
    name = args.name or f"{datetime.date.today().isoformat()}-{socket.gethostname()}-bench"
    plan = BenchPlan(systems=systems, conditions=tuple(conditions), load=load, workload=workload, slo=slo,
                     model=args.model, server_cpus=server_cpus, client_cpus=client_cpus, server_threads=threads,
                     ready_timeout_s=args.ready_timeout_s, url=args.url, url_model=url_model,
                     blink_args=tuple(args.blink_arg), max_model_len=args.max_model_len,
                     workdir=pathlib.Path(args.work_dir), quiet_busy=args.quiet_busy,
                     quiet_wait_s=args.quiet_wait_s, repeats=args.repeats)
    try:
        tok = load_tokenizer("default")
    except WorkloadError as e:
        return _fail(f"cannot load the model's tokenizer: {e}")
    if client_cpus:
        os.sched_setaffinity(0, client_cpus)
    from .report import write_all
    from .sweep import Runner
    runner = Runner(plan, tok, out_dir=out_dir)
    try:
        runner.prepare_workload()
    except WorkloadError as e:
        return _fail(str(e))
    bandwidth = None
    if "blink" in systems and args.model == "default" and not args.url:
        # before the sweep, on the machine as the servers find it (the quiet check ran just now)
        from .bandwidth import probe
        bandwidth = probe(threads)
    results = runner.run()
    if bandwidth is not None:
        results["meta"]["bandwidth"] = bandwidth
    if not any(r["levels"] for r in results["runs"]):
        reasons = "; ".join(s["reason"].splitlines()[0] for s in results["skipped"]) or \
            "; ".join(r["error"] or "" for r in results["runs"])
        print(f"blink bench: nothing was measured ({reasons})", file=sys.stderr)
        write_all(results, out_dir, name, args.notes, plots=False)
        return 1
    paths = write_all(results, out_dir, name, args.notes, plots=not args.no_plots)
    for p in paths:
        print(p)
    return 0


def _first_model(url: str) -> str | None:
    import json
    from .servers import http_get
    try:
        status, body = http_get(url.rstrip("/") + "/v1/models")
        data = json.loads(body).get("data") or []
        return data[0]["id"] if status == 200 and data else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
