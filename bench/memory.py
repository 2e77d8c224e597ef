"""A served system's peak resident memory: the summed RSS of every process of its server.

Owns the sampling (plain /proc, no psutil) and the JSON-ready dict the sweep stores;
report.memory_lines() renders it.

    start_server() -> RunningServer (its own session: start_new_session=True)
      -> RssSampler(server.proc.pid).start()      a first sample at once, then a daemon
         thread every `period_s` (0.5 s):
           members = processes whose session id is the server's pid (every process it
                     starts, unless one leaves with setsid) plus their /proc/<pid>/stat
                     ppid-descendants (those that did leave), each counted once, keyed
                     by (pid, start time) so a reused pid is a new process
           sum of VmRSS (/proc/<pid>/status) over the members -> keep the largest sum,
           its time and the per-process breakdown at that moment; remember each
           member's last VmHWM (its own high-water mark)
      -> .mark("ready") after wait_ready: the sum at that moment (idle, model loaded)
      -> .stop() before server.stop(): a last sample ("end"), the thread joined
         -> dict: peak_rss_mib, peak_at_s (after the sampler started, ~ the server's
            start), processes_at_peak [{pid, name, rss_mib}], hwm_sum_mib (sum over
            every process seen, exited ones at their last reading: each process's own
            peak, not simultaneous, so an upper bound of the true peak sum),
            processes_hwm, marks, samples, period_s

What it misses and over-counts: a spike shorter than the period between two samples
(VmHWM bounds it); pages shared between the processes (the shared-memory ring between
blink's frontend and daemon, a model file mapped by several workers, libraries) count
once per process that has them resident, as the kernel's per-process RSS does.

Cost: each tick lists /proc and reads the stat file of processes not seen before (a
process found outside the tree is remembered and not read again), then stat + status of
the few members: about a millisecond a tick on a desktop's few hundred processes.
"""
from __future__ import annotations

import os
import threading
import time

PROC = "/proc"
MIB = 1024.0   # /proc status values are in kB (KiB)


def _stat(pid: int) -> tuple[str, int, int, int, int] | None:
    """(state, ppid, pgrp, session, start time in ticks) of a process, None if it is gone."""
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    try:
        f = text.rsplit(b")", 1)[1].split()   # comm may hold spaces and parentheses
        return f[0].decode(), int(f[1]), int(f[2]), int(f[3]), int(f[19])
    except (IndexError, ValueError):
        return None


def _status(pid: int) -> tuple[str, int | None, int | None] | None:
    """(Name, VmRSS kB, VmHWM kB) from /proc/<pid>/status; the Vm fields are None for a zombie."""
    try:
        with open(f"{PROC}/{pid}/status", "rb") as f:
            text = f.read()
    except OSError:
        return None
    name, rss, hwm = "?", None, None
    try:
        for line in text.split(b"\n"):
            if line.startswith(b"Name:"):
                name = line[5:].strip().decode(errors="replace")
            elif line.startswith(b"VmHWM:"):
                hwm = int(line.split()[1])
            elif line.startswith(b"VmRSS:"):
                rss = int(line.split()[1])
                break                          # VmRSS follows VmHWM; nothing after it is needed
    except (IndexError, ValueError):
        return None
    return name, rss, hwm


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"{PROC}/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def label(comm: str, argv: list[str]) -> str:
    """A short readable name for a process: what a Python interpreter runs ('blink gpu-daemon',
    'python3 -m vllm.entrypoints.openai.api_server'), a retitled process's title
    ('VLLM::EngineCore', which comm cuts at 15 characters), else comm ('llama-server')."""
    if not argv:
        return comm
    a0 = argv[0].strip()
    if os.path.basename(a0).startswith("python"):
        args = argv[1:]
        for i, a in enumerate(args):
            nxt = args[i + 1] if i + 1 < len(args) else ""
            if a == "-m":
                return f"{comm} -m {nxt}"
            if a == "-c":
                return f"{comm} (multiprocessing child)" if "multiprocessing" in nxt else f"{comm} -c"
            if a.startswith("-"):
                continue
            word = os.path.basename(a)
            if nxt and not nxt.startswith("-") and "/" not in nxt and len(nxt) <= 16:
                word += " " + nxt
            return word
        return comm
    if comm.startswith("python") or (len(comm) == 15 and a0.startswith(comm)):
        return a0.split()[0][:48] if a0 else comm   # setproctitle: the title is argv[0]
    return comm


class RssSampler:
    """Samples the summed VmRSS of the process tree rooted at `root_pid` (started with
    start_new_session=True, so its session id is root_pid) in a background thread."""

    def __init__(self, root_pid: int, period_s: float = 0.5):
        self.root = root_pid
        self.period_s = period_s
        self._lock = threading.Lock()            # one sample at a time (thread and mark())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._outside: set[int] = set()          # pids seen outside the tree: not read again
        self._names: dict[tuple[int, int], str] = {}
        self._hwm: dict[tuple[int, int], int] = {}   # (pid, start) -> last VmHWM kB
        self._alive_at_end: set[tuple[int, int]] = set()
        self.samples = 0
        self.errors: list[str] = []
        self.peak_kb = -1
        self.peak_at_s: float | None = None
        self.peak_procs: list[dict] = []
        self.last_kb = 0
        self.marks: dict[str, dict] = {}

    # -- membership ---------------------------------------------------------------
    def _scan(self) -> dict[int, int]:
        """The tree's live, non-zombie members now: pid -> start time."""
        try:
            pids = {int(n) for n in os.listdir(PROC) if n.isdigit()}
        except OSError as e:
            self._note(f"listdir {PROC}: {e}")
            return {}
        self._outside &= pids                     # forget exited pids
        members: dict[int, int] = {}
        pending: dict[int, tuple[int, int]] = {}  # pid -> (ppid, start) of candidates by parent
        for pid in pids:
            if pid in self._outside:
                continue
            st = _stat(pid)
            if st is None:
                continue
            state, ppid, _pgrp, sid, start = st
            if state in ("Z", "X"):
                continue
            if pid == self.root or sid == self.root:
                members[pid] = start
            else:
                pending[pid] = (ppid, start)
        grew = True
        while grew and pending:                   # descendants that left the session (setsid)
            grew = False
            for pid, (ppid, start) in list(pending.items()):
                if ppid in members:
                    members[pid] = start
                    del pending[pid]
                    grew = True
        self._outside.update(pending)
        return members

    # -- sampling -----------------------------------------------------------------
    def sample(self) -> int:
        """One sample now; returns the summed VmRSS in kB."""
        with self._lock:
            return self._sample()

    def _sample(self) -> int:
        t = time.monotonic() - self._t0
        members = self._scan()
        total, procs, alive = 0, [], set()
        for pid, start in members.items():
            s = _status(pid)
            if s is None or s[1] is None:
                continue
            name, rss, hwm = s
            key = (pid, start)
            if key not in self._names:
                self._names[key] = label(name, _cmdline(pid))
            if hwm is not None:
                self._hwm[key] = hwm
            alive.add(key)
            total += rss
            procs.append((pid, self._names[key], rss))
        self.samples += 1
        self.last_kb = total
        self._alive_at_end = alive
        if total > self.peak_kb:
            self.peak_kb, self.peak_at_s = total, t
            self.peak_procs = [{"pid": pid, "name": name, "rss_mib": round(rss / MIB, 1)}
                               for pid, name, rss in sorted(procs, key=lambda p: -p[2])]
        return total

    def _note(self, msg: str) -> None:
        if len(self.errors) < 5:
            self.errors.append(msg)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.sample()
            except Exception as e:                # never take the benchmark down
                self._note(f"{type(e).__name__}: {e}")

    def start(self) -> "RssSampler":
        self._t0 = time.monotonic()
        self.mark("start")
        self._thread = threading.Thread(target=self._loop, name=f"rss-sampler-{self.root}", daemon=True)
        self._thread.start()
        return self

    def mark(self, what: str) -> None:
        """Record the summed RSS at this moment under `what` (e.g. 'ready')."""
        with self._lock:
            try:
                kb = self._sample()
            except Exception as e:                # never take the benchmark (or the server's stop) down
                self._note(f"{type(e).__name__}: {e}")
                return
            self.marks[what] = {"t_s": round(time.monotonic() - self._t0, 2), "rss_mib": round(kb / MIB, 1)}

    def stop(self) -> dict:
        """Stop the thread, take a last sample ('end'), and return the JSON-ready result."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0 + self.period_s)
        self.mark("end")
        return self.result()

    def result(self) -> dict:
        with self._lock:
            hwm = [{"pid": pid, "name": self._names.get((pid, start), "?"), "hwm_mib": round(kb / MIB, 1),
                    "alive": (pid, start) in self._alive_at_end}
                   for (pid, start), kb in sorted(self._hwm.items(), key=lambda kv: -kv[1])]
            return {"peak_rss_mib": round(self.peak_kb / MIB, 1) if self.peak_kb >= 0 else None,
                    "peak_at_s": None if self.peak_at_s is None else round(self.peak_at_s, 2),
                    "processes_at_peak": list(self.peak_procs),
                    "hwm_sum_mib": round(sum(self._hwm.values()) / MIB, 1) if self._hwm else None,
                    "processes_hwm": hwm,
                    "marks": dict(self.marks),
                    "samples": self.samples, "period_s": self.period_s,
                    "source": "sum of VmRSS over the server's session and its descendants, /proc every period_s",
                    "errors": list(self.errors)}


def summary(mem: dict | None) -> str:
    """One log line."""
    if not mem or mem.get("peak_rss_mib") is None:
        return "peak RSS not measured"
    return (f"peak RSS {mem['peak_rss_mib']:.1f} MiB at {mem['peak_at_s']:.1f} s "
            f"({len(mem['processes_at_peak'])} processes), sum of VmHWM {mem['hwm_sum_mib'] or 0:.1f} MiB")
