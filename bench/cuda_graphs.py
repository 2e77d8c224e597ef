"""CUDA graphs A/B benchmark (paper Fig. 3 style; needs a GPU of compute
capability >= 9.0): the same captured model graphs served by the persistent
GPU scheduler (`--executor cuda`) and by the host loop (`--executor
cuda-hostloop`), on N x I -> O workloads, isolated, with every host core but
the daemon's busy (memory and cache pressure only), and with every host core busy,
the daemon's too (co-located tenants: the host loop's own thread is contended;
the persistent scheduler's token path has no host thread), in one run.

    for executor in (cuda, cuda-hostloop):
      blink gpu-daemon --executor E --model M (pinned to one core) -> READY
        (setup time, and the graph cache's report: graphs, capture and
        instantiation time, memory, node types, read from its log)
      for condition in (isolated, interference: stress-ng / pbzip2 / make / a
                        Python hog on every other core, all_cores: the same on
                        every core, the daemon's included):
        for N x I -> O in the workloads, `repeats` times:
          write N requests (I random prompt tokens, O output tokens, ignore_eos)
          into the ring, publish them all, wait for every slot to complete;
          every run's prompts are its own (a seed per run: no prompt, and no
          prompt's first block, repeats within an executor's daemon, whose prefix
          cache would otherwise serve a later condition's prefill from an earlier
          one's blocks), the same sequence for both executors
          makespan = last backend t_last_ns - publish time (backend clocks: no
          client-side polling noise); tokens; GPU energy from NVML where readable;
          the host loop's run in parts, from the `engine period` line its engine
          logs once the ring is quiet (BLINK_ENGINE_PERIODS=1): its own Python,
          the runner's staging, the launch call, the wait for the step
    -> ratios measured in this run: host-loop / persistent makespan per workload,
       and each executor's interfered / isolated throughput under each condition

Model: `random:smollm2` by default (SmolLM2-135M's shape with random weights and an
untied head; the embedded GGUF is 98 MB, over what the lent GPU machine can be sent), in the
executors' default dtype (bfloat16: executors.CUDA_AUTO_DTYPE) unless --dtype says float32.
Speed does not depend on the weights; outputs are not checked for quality here.

    python -m bench.cuda_graphs [--machine h100] [--out DIR] [--quick]
      -> DIR/2026-11-22-<machine>-cuda_graphs-bf16.json + .md  (DIR: $OUT if set, else bench/results;
         -cuda_graphs, no suffix, with --dtype float32)
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import operator
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from gpu_backend.executors import cuda_dtype_name

from .machine_label import machine_label

DATE = time.strftime("%Y-%m-%d", time.gmtime())    # the run's day: results are committed under it
REPO = pathlib.Path(__file__).resolve().parents[1]
WORKLOADS = ((64, 128, 32), (64, 512, 128), (256, 128, 128))
INTERFERERS = ("stress-ng", "pbzip2", "compile", "pyhog")
DAEMON_CPU = 0
TARGET_SHORT_OUTPUT_RATIO = 1.7       # host-loop / persistent makespan on the short-output workload (issue 17: Fig. 3)
TARGET_RETENTION = 0.97               # persistent interfered / isolated throughput
CONDITIONS = ("isolated", "interference", "all_cores")
DTYPE_TAGS = {"bfloat16": "bf16"}     # result files' suffix where the model is not float32
INTERFERED = CONDITIONS[1:]


class BenchError(RuntimeError):
    pass


# -- the GPU's energy counter ----------------------------------------------------------------

class Energy:
    """NVML's total energy counter (mJ, Volta and newer); None when it cannot be read."""

    def __init__(self):
        self.handle, self.why = None, None
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        except Exception as e:  # no nvidia-ml-py, no permission, unsupported GPU
            self.handle, self.why = None, f"NVML energy not readable ({type(e).__name__}: {e})"

    def device_name(self) -> str:
        if self.handle is None:
            return "unknown"
        name = self.nvml.nvmlDeviceGetName(self.handle)
        return name.decode() if isinstance(name, bytes) else str(name)

    def read_mj(self) -> int | None:
        if self.handle is None:
            return None
        try:
            return int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        except Exception:
            return None


class Clocks:
    """The clocks a run went at (`with`): NVML's SM and memory clocks and its clock-event (throttle)
    reasons, sampled every `period_s` on a thread while it runs (its own NVML handle: the energy
    counter may be unreadable where the clocks are not), and the daemon's CPU's frequency where the
    kernel shows it, read at the start and the end only (reading it can interrupt that CPU, the one
    being timed). For the host loop's two levels (~136 / ~177 ms a run on the H200, steady within a
    daemon): a GPU or a CPU held at another clock would show here."""

    def __init__(self, cpu: int = DAEMON_CPU, period_s: float = 0.02):
        import threading
        self.nvml, self.handle = _nvml_handle()
        self.cpu_freq = pathlib.Path(f"/sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_cur_freq")
        self.period_s, self.samples, self.cpu_mhz = period_s, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-clocks", daemon=True)

    def sample(self) -> dict:
        out = {}
        if self.handle is not None:
            nv = self.nvml
            try:
                out["sm_mhz"] = int(nv.nvmlDeviceGetClockInfo(self.handle, nv.NVML_CLOCK_SM))
                out["mem_mhz"] = int(nv.nvmlDeviceGetClockInfo(self.handle, nv.NVML_CLOCK_MEM))
                reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                    nv.nvmlDeviceGetCurrentClocksThrottleReasons
                out["reasons"] = int(reasons(self.handle))
            except Exception:   # a field this driver or card does not give
                pass
        return out

    def _read_cpu(self):
        try:
            self.cpu_mhz.append(int(self.cpu_freq.read_text()) // 1000)
        except (OSError, ValueError):
            pass

    def _run(self):
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.period_s)

    def __enter__(self):
        self._read_cpu()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._read_cpu()

    def summary(self) -> dict:
        """Median (and least) of each GPU clock over the samples; the clock-event reasons seen, OR-ed;
        the daemon CPU's frequency at the start and the end (median, least)."""
        out = {"samples": len(self.samples)}
        for k, vals in (("sm_mhz", [s["sm_mhz"] for s in self.samples if "sm_mhz" in s]),
                        ("mem_mhz", [s["mem_mhz"] for s in self.samples if "mem_mhz" in s]),
                        ("cpu_mhz", self.cpu_mhz)):
            if vals:
                out[k] = int(statistics.median(vals))
                out[f"{k}_min"] = min(vals)
        reasons = [s["reasons"] for s in self.samples if "reasons" in s]
        if reasons:
            out["reasons"] = hex(functools.reduce(operator.or_, reasons, 0))
        return out


@functools.cache
def _nvml_handle():
    """(pynvml, the handle of GPU 0), or (None, None) where NVML cannot be opened."""
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:   # no nvidia-ml-py, no driver, no permission
        return None, None


# -- the daemon ----------------------------------------------------------------------------

class Daemon:
    def __init__(self, executor: str, model: str, ring_name: str, args, log_dir: pathlib.Path):
        from shared_layout import Ring
        from shared_layout.shm import ShmRegion
        self.executor, self.ring_name = executor, ring_name
        self.log_path = log_dir / f"daemon-{executor}.log"
        from gpu_backend.cuda.child_env import child_env
        env = child_env(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",     # one core: no CPU thread pool to oversubscribe it
                        BLINK_ENGINE_PERIODS="1")    # the host loop's engine logs each run's parts (engine.py)
        if args.buckets:
            env["BLINK_GRAPH_BUCKETS"] = args.buckets
        cmd = [sys.executable, "-m", "dpu_frontend.cli", "gpu-daemon", "--executor", executor, "--model", model,
               "--ring", ring_name, "--slots", str(args.slots), "--prompt-arena-tokens", str(1 << 18),
               "--output-arena-tokens", str(1 << 18), "--max-batch-size", str(args.max_batch_size),
               "--max-prefill-tokens", str(args.max_prefill_tokens), "--max-model-len", str(args.max_model_len),
               "--kv-cache-mb", str(args.kv_cache_mb), "--dtype", args.dtype]
        self.cmd = " ".join(cmd)
        self.t_spawn = time.monotonic()
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     preexec_fn=lambda: os.sched_setaffinity(0, {DAEMON_CPU}))
        deadline = time.monotonic() + args.startup_timeout_s
        from shared_layout.states import BackendStatus
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"{executor} daemon exited ({self.proc.returncode}): {self.tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise BenchError(f"{executor} daemon not READY in {args.startup_timeout_s} s: {self.tail()}")
            if ShmRegion.exists(ring_name):
                try:
                    self.region = ShmRegion.open(ring_name)
                    self.ring = Ring.attach(self.region.buf)
                    if self.ring.get("backend_status") == BackendStatus.READY:
                        break
                except Exception:   # the file exists but is not formatted yet
                    pass
            time.sleep(0.05)
        self.setup_s = time.monotonic() - self.t_spawn

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text()[-n:]
        except OSError:
            return ""

    def report(self) -> dict:
        m = re.search(r"graph cache report (\{.*\})", self.log_path.read_text())
        return json.loads(m.group(1)) if m else {}

    def periods(self) -> list[dict]:
        """The `engine period` lines the daemon logged so far (an Engine's busy periods: EngineConfig.period_log;
        the persistent executor has no host engine and logs none)."""
        try:
            text = self.log_path.read_text()
        except OSError:
            return []
        return [json.loads(m) for m in re.findall(r"engine period (\{.*\})", text)]

    def period_after(self, seen: int, timeout_s: float = 2.0) -> dict | None:
        """The busy periods logged after the first `seen`, summed (one run_workload: the engine logs its period
        once the ring is quiet, a moment after the last token); None where none comes."""
        if self.executor == "cuda":
            return None
        deadline = time.monotonic() + timeout_s
        while len(new := self.periods()[seen:]) == 0:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.005)
        return {k: round(sum(p.get(k, 0) for p in new), 3) for k in new[0]}

    def stop(self) -> None:
        import signal
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        region = getattr(self, "region", None)
        if region is not None:
            region.close()
        try:
            os.unlink(f"/dev/shm/{self.ring_name}")     # the daemon leaves its ring for a frontend; nobody needs it now
        except FileNotFoundError:
            pass


# -- one workload ----------------------------------------------------------------------------

def workload_prompts(seed: int, n: int, prompt_len: int, vocab: int) -> list[np.ndarray]:
    """The N random prompts of one run (token ids >= 3: no special tokens)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, prompt_len).astype(np.int32) for _ in range(n)]


def run_workload(ring, n: int, prompt_len: int, out_len: int, energy: Energy, seed: int,
                 timeout_s: float = 300.0) -> dict:
    """N requests published together; makespan from the publish to the last backend token."""
    from shared_layout import SlotRequest, SlotState, fence, submit_writes
    geom = ring.geom
    if n > geom.slot_count or n * prompt_len > geom.prompt_arena_tokens or n * out_len > geom.output_arena_tokens:
        raise BenchError(f"workload {n}x{prompt_len}->{out_len} does not fit the ring {geom}")
    epoch = ring.get("frontend_epoch")
    mv = memoryview(ring.buf).cast("B")
    states = []
    for i, prompt in enumerate(workload_prompts(seed, n, prompt_len, ring.get("model_vocab_size"))):
        req = SlotRequest(seq=seed * 100_000 + i + 1, prompt_offset=i * prompt_len, prompt_len=prompt_len,
                          output_offset=i * out_len, max_tokens=out_len, ignore_eos=True, epoch=epoch)
        writes = submit_writes(geom, i, req, prompt)
        for off, data in writes[:-1]:
            mv[off:off + len(data)] = data
        states.append(writes[-1])
    fence()   # every prompt and request before any state word
    clocks = Clocks()
    e0 = energy.read_mj()
    with clocks:
        t0 = time.monotonic_ns()
        for off, data in states:
            mv[off:off + len(data)] = data
        fence()   # the state words before the frontend doorbell that announces them
        ring.set("frontend_doorbell", ring.get("frontend_doorbell") + 1)
        deadline = time.monotonic() + timeout_s
        while not (ring.state[:n] == SlotState.DECODE_COMPLETED).all():
            if time.monotonic() > deadline:
                raise BenchError(f"workload {n}x{prompt_len}->{out_len} did not complete in {timeout_s} s")
            time.sleep(0.0005)
        t_seen = time.monotonic_ns()
    e1 = energy.read_mj()
    fence()
    slots = ring.slots[:n]
    t_last = int(slots["t_last_ns"].max())
    tokens = int(slots["generated"].sum())
    finishes = {(int(f), int(e)) for f, e in zip(slots["finish_reason"], slots["error_code"])}
    if tokens != n * out_len:
        raise BenchError(f"{tokens} tokens of {n * out_len} ((finish reason, error code): {finishes})")
    for i in range(n):
        ring.state[i] = SlotState.EMPTY      # DECODE_COMPLETED -> EMPTY: hand the slots back
    makespan_ns = (t_last - t0) if t0 < t_last <= t_seen + 10**9 else (t_seen - t0)
    out = {"makespan_ms": makespan_ns / 1e6, "seen_ms": (t_seen - t0) / 1e6, "tokens": tokens,
           "tokens_per_s": tokens / (makespan_ns / 1e9), "clocks": clocks.summary()}
    if e0 is not None and e1 is not None:
        out["energy_j"] = (e1 - e0) / 1e3
        out["j_per_token"] = out["energy_j"] / tokens
    return out


def run_seeds(workloads, repeats: int) -> dict[tuple[str, tuple[int, int, int], int], int]:
    """The seed of each run_workload call of a daemon, (condition, workload, run) -> seed, run 0 being the
    warm-up: every run its own. A run whose prompts repeat an earlier run's (the same seed) is served from
    the prefix cache: on the H200 (2026-11-27) the conditions after the first reused the first one's seeds,
    their prefill hit 68% of its tokens, and they looked 1.4x faster than isolated."""
    seeds = itertools.count(1)
    return {(c, w, r): next(seeds) for c in CONDITIONS for w in workloads for r in range(1 + repeats)}


def interferer_kind(requested: str | None) -> tuple[str | None, str]:
    from bench.interference import missing_reason
    for kind in ([requested] if requested else INTERFERERS):
        why = missing_reason(kind)
        if why is None:
            return kind, ""
    return None, why


def run(args) -> dict:
    from bench.interference import InterfererSpec, start_interferer
    from gpu_backend.cuda import driver
    why = driver.unavailable_reason()
    if why is not None:
        raise BenchError(f"needs a GPU of compute capability >= 9.0 ({why})")
    cpus = sorted(os.sched_getaffinity(0))
    if DAEMON_CPU not in cpus or len(cpus) < 2:
        raise BenchError(f"needs CPU {DAEMON_CPU} and at least one other (have {cpus})")
    others = tuple(c for c in cpus if c != DAEMON_CPU)
    os.sched_setaffinity(0, set(others))          # the client stays off the daemon's core
    kind, why_not = interferer_kind(args.interferer)
    energy = Energy()
    workloads = [tuple(int(x) for x in w.split("x")) for w in args.workloads.split(",")]
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    res = {"date": DATE, "machine": args.machine, "model": args.model,
           "dtype": cuda_dtype_name(args.dtype), "dtype_option": args.dtype,
           "daemon_cpu": DAEMON_CPU, "interferer_cpus": list(others), "interferer": kind or why_not,
           "energy": "nvml" if energy.handle is not None else energy.why, "config": {
               "max_batch_size": args.max_batch_size, "max_prefill_tokens": args.max_prefill_tokens,
               "max_model_len": args.max_model_len, "kv_cache_mb": args.kv_cache_mb, "slots": args.slots,
               "buckets": args.buckets or "default", "repeats": args.repeats}, "executors": {}}
    res["device"] = energy.device_name()            # no CUDA context in this process: it only writes the ring
    with tempfile.TemporaryDirectory(prefix="blink-cuda-graphs-") as work:
        for executor in ("cuda", "cuda-hostloop"):
            ring_name = f"blink-bench-graphs-{os.getpid()}-{executor}"
            print(f"== {executor}: starting the daemon", flush=True)
            daemon = Daemon(executor, args.model, ring_name, args, pathlib.Path(work))
            entry = {"setup_s": round(daemon.setup_s, 2), "command": daemon.cmd, "report": daemon.report(),
                     "runs": {}}
            print(f"   READY after {daemon.setup_s:.1f} s", flush=True)
            seeds = run_seeds(workloads, args.repeats)     # both executors: the same prompts, none repeated
            try:
                for condition in CONDITIONS:
                    hog = None
                    if condition in INTERFERED:
                        if kind is None:
                            entry["runs"][condition] = {"skipped": why_not}
                            continue
                        on = others if condition == "interference" else tuple(cpus)
                        hog = start_interferer(InterfererSpec(kind, len(on), on), pathlib.Path(work))
                        time.sleep(args.settle_s)
                    runs = {}
                    try:
                        for n, i, o in workloads:
                            name = f"{n}x{i}->{o}"
                            seed = {r: seeds[condition, (n, i, o), r] for r in range(1 + args.repeats)}
                            run_workload(daemon.ring, n, i, o, energy, seed=seed[0])          # warm-up
                            reps, periods = [], []
                            for r in range(1, 1 + args.repeats):
                                seen = len(daemon.periods())
                                reps.append(run_workload(daemon.ring, n, i, o, energy, seed=seed[r]))
                                periods.append(daemon.period_after(seen))
                            ms = [r["makespan_ms"] for r in reps]
                            runs[name] = {"makespan_ms": round(statistics.median(ms), 3),
                                          "makespan_ms_all": [round(x, 3) for x in ms],
                                          "tokens_per_s": round(n * o / (statistics.median(ms) / 1e3), 1)}
                            if all(periods):
                                runs[name]["host_periods"] = periods
                            runs[name]["clocks"] = [r["clocks"] for r in reps]
                            if all("j_per_token" in r for r in reps):
                                runs[name]["j_per_token"] = round(statistics.median(r["j_per_token"] for r in reps), 6)
                            print(f"   {condition:12s} {name:14s} {runs[name]['makespan_ms']:9.2f} ms "
                                  f"{runs[name]['tokens_per_s']:10.1f} tok/s", flush=True)
                    finally:
                        if hog is not None:
                            hog.stop()
                    entry["runs"][condition] = runs
            finally:
                daemon.stop()
                entry["log_tail"] = daemon.tail(1500)
            res["executors"][executor] = entry
    res["ratios"] = ratios(res, workloads)
    return res


def ratios(res: dict, workloads) -> dict:
    out = {}
    ex = res["executors"]
    for n, i, o in workloads:
        name = f"{n}x{i}->{o}"
        r = {}
        for cond in CONDITIONS:
            try:
                r[f"hostloop_over_persistent_{cond}"] = round(
                    ex["cuda-hostloop"]["runs"][cond][name]["makespan_ms"] / ex["cuda"]["runs"][cond][name]["makespan_ms"], 3)
            except (KeyError, ZeroDivisionError):
                pass
        for e in ("cuda", "cuda-hostloop"):
            for cond in INTERFERED:
                suffix = "" if cond == "interference" else f"_{cond}"
                try:
                    r[f"{e}_retention{suffix}"] = round(ex[e]["runs"]["isolated"][name]["makespan_ms"]
                                                        / ex[e]["runs"][cond][name]["makespan_ms"], 3)
                except (KeyError, ZeroDivisionError):
                    pass
        out[name] = r
    short = min(workloads, key=lambda w: w[2])
    sname = f"{short[0]}x{short[1]}->{short[2]}"
    ratio = out.get(sname, {}).get("hostloop_over_persistent_isolated")
    retention = [out[k][f"cuda_retention{sfx}"] for k in out for sfx in ("", "_all_cores")
                 if out[k].get(f"cuda_retention{sfx}") is not None]
    host_all = [out[k]["cuda-hostloop_retention_all_cores"] for k in out
                if out[k].get("cuda-hostloop_retention_all_cores") is not None]
    out["targets"] = {"short_output_workload": sname,
                      "hostloop_over_persistent": ratio, "target": TARGET_SHORT_OUTPUT_RATIO,
                      "met": ratio is not None and ratio >= TARGET_SHORT_OUTPUT_RATIO,
                      "persistent_min_retention": min(retention) if retention else None,
                      "retention_target": TARGET_RETENTION,
                      "retention_met": bool(retention) and min(retention) >= TARGET_RETENTION,
                      "hostloop_min_retention_all_cores": min(host_all) if host_all else None}
    return out


def dtype_suffix(dtype: str) -> str:
    """The result files' suffix for the model's dtype ("auto" resolved as the executors resolve it)."""
    dtype = cuda_dtype_name(dtype)
    return "" if dtype == "float32" else "-" + DTYPE_TAGS.get(dtype, dtype)


def write_results(res: dict, out_dir: pathlib.Path, machine: str) -> pathlib.Path:
    stem = out_dir / f"{DATE}-{machine}-cuda_graphs{dtype_suffix(res.get('dtype', 'float32'))}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=2))
    ex = res["executors"]
    lines = [f"# CUDA graphs: persistent scheduler vs host loop, {machine} ({res.get('device')})", "",
             f"Model {res['model']} ({res['dtype']}); daemon pinned to CPU {res['daemon_cpu']}; interference: "
             f"{res['interferer']} on CPUs {res['interferer_cpus'][0]}-{res['interferer_cpus'][-1]}; energy: "
             f"{res['energy']}. Medians of {res['config']['repeats']} runs after a warm-up; every ratio is "
             "within this one run.", "",
             "| workload | condition | persistent ms | host loop ms | host/persistent | persistent J/tok | "
             "host loop J/tok |", "|---|---|---|---|---|---|---|"]
    for name, r in res["ratios"].items():
        if name == "targets":
            continue
        for cond in CONDITIONS:
            p = ex.get("cuda", {}).get("runs", {}).get(cond, {}).get(name)
            h = ex.get("cuda-hostloop", {}).get("runs", {}).get(cond, {}).get(name)
            if not p or not h:
                continue
            lines.append(f"| {name} | {cond} | {p['makespan_ms']} | {h['makespan_ms']} | "
                         f"{r.get(f'hostloop_over_persistent_{cond}', '-')}x | {p.get('j_per_token', '-')} | "
                         f"{h.get('j_per_token', '-')} |")
    lines += ["", "Interfered / isolated throughput (interference: every other core busy; all_cores: the daemon's "
              "core too):", "",
              "| workload | persistent, interference | host loop | persistent, all_cores | host loop |",
              "|---|---|---|---|---|"]
    for name, r in res["ratios"].items():
        if name != "targets":
            lines.append(f"| {name} | {r.get('cuda_retention', '-')} | {r.get('cuda-hostloop_retention', '-')} | "
                         f"{r.get('cuda_retention_all_cores', '-')} | {r.get('cuda-hostloop_retention_all_cores', '-')} |")
    t = res["ratios"]["targets"]
    lines += ["", f"Targets: host-loop/persistent makespan on {t['short_output_workload']} = "
                  f"{t['hostloop_over_persistent']} (target >= {t['target']}: {'met' if t['met'] else 'NOT met'}); "
                  f"persistent retention under interference min {t['persistent_min_retention']} (target >= "
                  f"{t['retention_target']}: {'met' if t['retention_met'] else 'NOT met'}); the host loop's with every "
                  f"core busy: {t.get('hostloop_min_retention_all_cores')}.", "",
              "| executor | setup s (spawn -> READY) | graphs | step kernels | nodes per graph | capture + instantiate s | "
              "graph cache MiB | estimate MiB | KV pool MiB |", "|---|---|---|---|---|---|---|---|---|"]
    for name, e in ex.items():
        g = e.get("report", {}).get("graphs", {})
        mem, est, tim = g.get("memory", {}), g.get("estimate", {}), g.get("timing", {})
        npg = g.get("nodes_per_graph", {})
        lines.append(f"| {name} | {e['setup_s']} | {g.get('buckets', {}).get('graphs', '-')} | {g.get('kernels', '-')} | "
                     f"{npg.get('min', '-')}-{npg.get('max', '-')} | {round(tim.get('total_s', 0), 1)} | {round(mem.get('graph_cache_bytes', 0) / 2**20)} | "
                     f"{round(est.get('total_bytes', 0) / 2**20)} | {round(mem.get('kv_pool_bytes', 0) / 2**20)} |")
    lines += host_loop_parts(ex)
    lines += run_clocks(ex)
    lines += ["", "Reproduce: `scripts/gpu_check.sh` (or `python -m bench.cuda_graphs`).", ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
    return stem


def host_loop_parts(ex: dict) -> list[str]:
    """Markdown: each host-loop run's busy period in parts (the engine's `engine period` lines), us a step."""
    rows = []
    for cond, by_name in ex.get("cuda-hostloop", {}).get("runs", {}).items():
        for name, r in by_name.items():
            for ms, p in zip(r.get("makespan_ms_all", []), r.get("host_periods", [])):
                steps = max(1, p.get("steps", 0))
                us = {k: round(1e3 * p.get(f"{k}_ms", 0) / steps, 1) for k in ("wall", "engine", "launch", "wait")}
                stage = round(1e3 * (p.get("runner_ms", 0) - p.get("launch_ms", 0) - p.get("wait_ms", 0)) / steps, 1)
                rows.append(f"| {name} | {cond} | {ms} | {p.get('steps')} | {us['wall']} | {us['engine']} | {stage} | "
                            f"{us['launch']} | {us['wait']} |")
    if not rows:
        return []
    return ["", "The host loop's runs in parts, us a step (the engine's busy period: its Python intake, reap, "
            "scheduler and publish / the runner's staging of rows and request copies / the copies and launch call / "
            "the wait for the step's tokens):", "",
            "| workload | condition | makespan ms | steps | busy us/step | engine | staging | launch | wait |",
            "|---|---|---|---|---|---|---|---|---|"] + rows


def run_clocks(ex: dict) -> list[str]:
    """Markdown: each run's makespan beside the clocks it went at (Clocks.summary)."""
    rows = []
    for executor, e in ex.items():
        for cond, by_name in e.get("runs", {}).items():
            for name, r in by_name.items():
                for ms, c in zip(r.get("makespan_ms_all", []), r.get("clocks", [])):
                    def mhz(k):
                        return f"{c[k]} ({c[f'{k}_min']})" if k in c else "-"
                    rows.append(f"| {executor} | {name} | {cond} | {ms} | {mhz('sm_mhz')} | {mhz('mem_mhz')} | "
                                f"{c.get('reasons', '-')} | {mhz('cpu_mhz')} | {c.get('samples', 0)} |")
    if not rows:
        return []
    return ["", "The clocks each run went at (median, least in brackets), the GPU's sampled every 20 ms: its SM and "
            "memory clocks and NVML's clock-event reasons OR-ed over the run (0x1: idle; 0x2: applications "
            "clocks setting; 0x4: software power cap; 0x8: hardware slowdown; 0x20 / 0x40: software / hardware "
            "thermal; 0x80: power brake), and the daemon's CPU at the run's start and end:", "",
            "| executor | workload | condition | makespan ms | SM MHz | memory MHz | reasons | daemon CPU MHz | samples |",
            "|---|---|---|---|---|---|---|---|---|"] + rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machine", default="auto", help="result files' label; auto: the card's model (h100, h200)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "bench" / "results"))
    ap.add_argument("--model", default="random:smollm2")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="the daemons' --dtype (both executors alike); auto: theirs, bfloat16")
    ap.add_argument("--workloads", default=",".join(f"{n}x{i}x{o}" for n, i, o in WORKLOADS),
                    help="comma-separated NxIxO (requests x prompt tokens x output tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-batch-size", type=int, default=256)
    ap.add_argument("--max-prefill-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-mb", type=int, default=16384)
    ap.add_argument("--slots", type=int, default=1024)
    ap.add_argument("--buckets", default=None, help="JSON BucketConfig overrides (BLINK_GRAPH_BUCKETS)")
    ap.add_argument("--interferer", default=None, choices=INTERFERERS, help="default: the first one installed")
    ap.add_argument("--settle-s", type=float, default=2.0)
    ap.add_argument("--startup-timeout-s", type=float, default=400.0)
    ap.add_argument("--quick", action="store_true", help="one repeat, small workloads (a smoke run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.workloads = 1, "16x64x16,16x64x64"
    try:
        res = run(args)
    except BenchError as e:
        print(f"bench.cuda_graphs: {e}")
        return 2
    args.machine = res["machine"] = machine_label(args.machine, res.get("device"))
    stem = write_results(res, pathlib.Path(args.out), args.machine)
    print(stem.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
