"""What a run records about where it ran: machine, OS, tools, load, per-core busy time.

    machine_info() -> {hostname, cpu model, cores, memory, kernel, python, load average, ...}
    cpu_times() before and after a level -> cpu_busy(before, after) -> busy fraction per core
    wait_quiet(): sample every core's busy fraction until all are below a bound (or time is up)
"""
from __future__ import annotations

import os
import platform
import socket
import sys
import time


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return None


def machine_info() -> dict:
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"hostname": socket.gethostname(), "cpu_model": _cpu_model(), "logical_cpus": os.cpu_count(),
            "usable_cpus": sorted(os.sched_getaffinity(0)), "mem_total_gib": _mem_total_gib(),
            "kernel": platform.release(), "os": platform.platform(), "python": sys.version.split()[0],
            "loadavg_at_start": load}


def cpu_times() -> dict[int, tuple[int, int]]:
    """{cpu: (busy jiffies, total jiffies)} from /proc/stat; {} where it is unavailable."""
    out: dict[int, tuple[int, int]] = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("cpu") and line[3:4].isdigit():
                    parts = line.split()
                    vals = [int(v) for v in parts[1:]]
                    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
                    out[int(parts[0][3:])] = (sum(vals) - idle, sum(vals))
    except OSError:
        return {}
    return out


def cpu_busy(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]) -> dict[str, float]:
    """Busy fraction of each core between two cpu_times() samples."""
    out = {}
    for cpu, (b1, t1) in after.items():
        b0, t0 = before.get(cpu, (0, 0))
        out[str(cpu)] = round((b1 - b0) / (t1 - t0), 3) if t1 > t0 else float("nan")
    return out


def wait_quiet(max_busy: float, budget_s: float, window_s: float = 3.0,
               cores: set[int] | None = None) -> tuple[float, dict[str, float]]:
    """Wait until every core (of `cores`; None: all) was under max_busy over one window, at most budget_s.

    Returns (seconds waited, the last window's busy fractions of the cores watched).
    """
    t0 = time.monotonic()
    while True:
        before = cpu_times()
        time.sleep(window_s)
        busy = {k: v for k, v in cpu_busy(before, cpu_times()).items() if cores is None or int(k) in cores}
        waited = time.monotonic() - t0
        if not busy or max(busy.values()) < max_busy or waited >= budget_s:
            return waited, busy
