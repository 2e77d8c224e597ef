"""Co-located CPU load ("noisy neighbours") and CPU placement.

    InterfererSpec (kind, threads, cpus) -> missing_reason() (tool absent? say so)
        -> start_interferer() -> Interferer (one process group, pinned with
           sched_setaffinity before exec, like taskset -c) -> .stop()

Kinds, each running in a loop until stopped, as the paper's interferers run
through the whole sweep (§6.1, appendix A):
- pbzip2:   `pbzip2 -p<threads>` compressing a generated file (text-like, 48 MiB)
- stress-ng: `stress-ng --cpu <threads>` (all CPU methods in turn)
- compile:  `make -j<threads>` building a generated C project with -O2, cleaned
            and rebuilt forever (the paper builds LLVM with ninja -j45)
- pyhog:    <threads> pure-Python processes churning lists and dicts (no tool needed)
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

KINDS = ("pbzip2", "stress-ng", "compile", "pyhog")
_TOOLS = {"pbzip2": ("pbzip2",), "stress-ng": ("stress-ng",), "compile": ("make", "cc"), "pyhog": ()}
_INSTALL_HINT = {"pbzip2": "apt-get install pbzip2", "stress-ng": "apt-get install stress-ng",
                 "compile": "apt-get install make gcc"}


# The CPUs this process could use when it started, before the bench pinned itself
# (--client-cpus): an unpinned server or interferer gets all of them back.
ALL_CPUS = tuple(sorted(os.sched_getaffinity(0)))


class InterferenceError(RuntimeError):
    """An interferer cannot run here (tool missing, bad CPU list)."""


def parse_cpus(spec: str | None) -> tuple[int, ...] | None:
    """'0', '0-1', '0,2-3' -> CPU ids (checked against this machine); None or 'all' -> no pinning."""
    if spec is None or spec.strip() in ("", "all"):
        return None
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            lo, sep, hi = part.strip().partition("-")
            a, b = int(lo), int(hi) if sep else int(lo)
            if a > b:
                raise ValueError
            cpus.update(range(a, b + 1))
    except ValueError:
        raise InterferenceError(f"bad CPU list '{spec}' (expected e.g. 0, 0-1 or 0,2-3)") from None
    usable = set(ALL_CPUS)
    bad = sorted(cpus - usable)
    if bad:
        raise InterferenceError(f"CPU list '{spec}' names CPUs {bad} that this process cannot use "
                                f"(usable: {format_cpus(usable)})")
    return tuple(sorted(cpus))


def format_cpus(cpus) -> str:
    if cpus is None:
        return "all"
    cpus = sorted(cpus)
    out, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out)


def pin_preexec(cpus: tuple[int, ...] | None):
    """A subprocess preexec_fn that pins the child (and all it spawns) to `cpus` (None: ALL_CPUS)."""
    target = cpus if cpus is not None else ALL_CPUS

    def pin() -> None:
        os.sched_setaffinity(0, target)
    return pin


@dataclasses.dataclass(frozen=True)
class InterfererSpec:
    kind: str
    threads: int = 1
    cpus: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InterferenceError(f"unknown interferer '{self.kind}' (choose from {', '.join(KINDS)})")
        if self.threads < 1:
            raise InterferenceError(f"interferer threads must be >= 1, got {self.threads}")

    @property
    def label(self) -> str:
        return f"{self.kind}x{self.threads}@cpu{format_cpus(self.cpus)}"


def missing_reason(kind: str) -> str | None:
    """None when the interferer can run here, else a plain sentence saying what is missing."""
    missing = [t for t in _TOOLS.get(kind, ()) if shutil.which(t) is None]
    if missing:
        return f"interferer '{kind}' needs {', '.join(missing)}, which is not installed ({_INSTALL_HINT[kind]})"
    return None


def tool_version(kind: str) -> str:
    cmds = {"pbzip2": ["pbzip2", "-V"], "stress-ng": ["stress-ng", "--version"], "compile": ["cc", "--version"]}
    if kind == "pyhog":
        return f"python {sys.version.split()[0]}"
    try:
        out = subprocess.run(cmds[kind], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    text = (out.stdout + out.stderr).strip().splitlines()
    return text[0].strip() if text else "unknown"


@dataclasses.dataclass
class Interferer:
    spec: InterfererSpec
    proc: subprocess.Popen
    command: str
    version: str
    started_unix: float

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM to the whole process group, SIGKILL to whatever is left after `grace_s`."""
        stop_group(self.proc, grace_s)

    def describe(self) -> dict:
        return {"kind": self.spec.kind, "threads": self.spec.threads, "cpus": format_cpus(self.spec.cpus),
                "command": self.command, "version": self.version, "pid": self.proc.pid}


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`."""
    out = []
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(d.name))
    return out


def stop_group(proc: subprocess.Popen, grace_s: float, kill_wait_s: float = 5.0) -> None:
    """Stop a process started with start_new_session=True and everything in its group.

    SIGTERM to the group, wait up to grace_s for the leader and the members, then
    SIGKILL the group. Members may outlive their leader (a shell loop's current
    job, engine subprocesses), so the group, not the leader, decides when it is over.
    """
    pgid = proc.pid
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if proc.poll() is not None and not group_members(pgid):
                return
            time.sleep(0.05)
    proc.poll()


def start_interferer(spec: InterfererSpec, workdir: pathlib.Path) -> Interferer:
    """Start the interferer in its own process group, pinned to spec.cpus."""
    if (why := missing_reason(spec.kind)) is not None:
        raise InterferenceError(why)
    workdir.mkdir(parents=True, exist_ok=True)
    if spec.kind == "pbzip2":
        data = _pbzip2_input(workdir)
        cmd = f"while :; do pbzip2 -c -9 -p{spec.threads} {data} > /dev/null || exit 1; done"
    elif spec.kind == "stress-ng":
        cmd = f"exec stress-ng --cpu {spec.threads} --cpu-method all --timeout 86400s --quiet"
    elif spec.kind == "compile":
        src = _compile_project(workdir)
        cmd = f"cd {src} && while :; do make -s clean && make -s -j{spec.threads} all || exit 1; done"
    else:
        cmd = f"exec {sys.executable} -m bench.hog {spec.threads}"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(pathlib.Path(__file__).resolve().parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(["bash", "-c", cmd], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=pin_preexec(spec.cpus), env=env)
    it = Interferer(spec, proc, cmd, tool_version(spec.kind), time.time())
    time.sleep(0.3)
    if not it.alive():
        raise InterferenceError(f"interferer '{spec.kind}' exited at once (code {proc.returncode}): {cmd}")
    return it


def _pbzip2_input(workdir: pathlib.Path, size_bytes: int = 48 << 20, block_bytes: int = 4 << 20) -> pathlib.Path:
    """A text-like file that compresses like real data (words with random structure).

    One 4 MiB block, repeated: bzip2 works on 900 kB blocks, so the repetition
    does not make compression any cheaper, and the file is written in a fraction of a second.
    """
    path = workdir / "pbzip2-input.txt"
    if path.is_file() and path.stat().st_size == size_bytes:
        return path
    rng = np.random.default_rng(1234)
    words = [w.encode() for w in (
        "the of and to in is that for it as with was on be by this are from or have an not which at "
        "request token server latency queue batch prefill decode kernel memory cache thread core load "
        "0 1 2 3 4 5 6 7 8 9 alpha beta gamma delta omega").split()]
    idx = rng.integers(0, len(words), size=block_bytes // 4)
    noise = rng.integers(97, 123, size=len(idx))
    block = b" ".join(words[i] + (bytes([n]) if n % 7 == 0 else b"") for i, n in zip(idx, noise))[:block_bytes]
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        for _ in range(size_bytes // len(block)):
            f.write(block)
        f.write(block[:size_bytes % len(block)])
    tmp.replace(path)
    return path


def _compile_project(workdir: pathlib.Path, files: int = 48) -> pathlib.Path:
    """A generated C project: `files` units of arithmetic-heavy functions, built with -O2."""
    src = workdir / "compile-project"
    if (src / "Makefile").is_file():
        return src
    src.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        body = []
        for f in range(24):
            body.append(f"""
double unit{i}_f{f}(const double *x, int n) {{
    double acc = {f}.0;
    for (int k = 0; k < n; ++k) {{
        double v = x[k] * {i + 1}.5 + acc;
        if (v > {f * 3 + 1}.0) acc += v / (1.0 + k); else acc -= v * 0.5;
        switch (k % 5) {{ case 0: acc *= 1.0001; break; case 1: acc += {f}; break;
                          case 2: acc -= {i}; break; case 3: acc /= 1.0002; break; default: acc += v; }}
    }}
    return acc;
}}""")
        (src / f"unit{i}.c").write_text("\n".join(body) + "\n")
    objs = " ".join(f"unit{i}.o" for i in range(files))
    (src / "Makefile").write_text(
        f"OBJS = {objs}\nCFLAGS = -O2 -funroll-loops\n\nall: libunits.a\n\n"
        f"libunits.a: $(OBJS)\n\tar rcs $@ $(OBJS)\n\n%.o: %.c\n\t$(CC) $(CFLAGS) -c $< -o $@\n\n"
        f"clean:\n\trm -f *.o libunits.a\n")
    return src
