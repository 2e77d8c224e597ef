"""`blink serve`: the GPU daemon and the frontend as two child processes, one command,
each restarted when it dies while the other keeps running.

    prepare the default model (once, in a child: the torch side stays out of this
    process) -> spawn `blink gpu-daemon ...` and `blink frontend ...` (the `blink`
    script beside sys.executable, so each shows under its own name; each in its
    own session, dying with this process) -> wait until GET /health is 200 ->
    print the URL -> supervise:
        Ctrl-C / SIGTERM -> stop the frontend, then the daemon (SIGTERM, then
            SIGKILL after a grace period) -> exit 0
        a child exits before the first ready -> stop the other -> one line -> exit 1
        a child exits after it -> one line, restart it after its backoff
            (RestartPolicy: 0.5 s doubling to 30 s, back to 0.5 s once it lived a
            minute); the other keeps running: a new daemon bumps the backend epoch
            and sweeps the dead one's slots, a new frontend bumps the frontend epoch
            and the daemon aborts the dead one's requests (DESIGN.md §7)
        a child dies more than max_restarts times within window_s -> stop the
            other -> one line -> exit 1
        every (re)start -> supervisor_state.write: the frontend's /metrics reports
            the restart counts from that file ($BLINK_SUPERVISOR_STATE)

Binds 127.0.0.1 by default. The ring file is removed at exit if this command
created it.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import dataclasses
import http.client
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from shared_layout.stop_signals import stop_on_signals

from . import supervisor_state
from .config import (API_KEY_ENV, DEFAULT_HOST, DEFAULT_PORT, SUPERVISOR_STATE_ENV, FrontendConfig,
                     default_model_dir)
from .supervisor_state import DAEMON, FRONTEND, ChildState

# Daemon knobs passed through unchanged: (flag, type, help).
DAEMON_FLAGS = (
    ("--slots", int, "ring slots when creating the ring"),
    ("--prompt-arena-tokens", int, "prompt arena capacity in tokens"),
    ("--output-arena-tokens", int, "output arena capacity in tokens"),
    ("--max-batch-size", int, "requests decoding together at most"),
    ("--max-prefill-tokens", int, "prompt tokens prefilled in one step at most"),
    ("--block-size", int, "KV cache block size in tokens"),
    ("--kv-cache-mb", int, "KV cache memory budget in MiB"),
    ("--max-model-len", int, "context length (prompt + output) to serve"),
    ("--threads", int, "CPU threads for the cpu executor (default: all cores)"),
    ("--dtype", str, "weights/KV: auto | float32 | bfloat16 (auto: the cpu executor bf16 on CPUs with native "
                    "bf16, else float32; the cuda executors bf16)"),
    ("--kv-cache-dtype", str, "cpu executor KV cache: auto | float32 | bfloat16 (auto: the model's dtype; bf16 "
                              "for quantized weights computed in float32)"),
    ("--shutdown-grace-s", float, "on stop, in-flight requests get this long before they are aborted"),
    ("--step-ms", float, "--model null only: each engine step takes at least this long"),
    ("--scheduling-policy", str, "fcfs | priority | lvf: which waiting request runs first (default fcfs)"),
    ("--ttft-slo-ms", int, "TTFT target of a request that names none (default 5000), for lvf"),
    ("--tbt-slo-ms", int, "time-between-tokens target of a request that names none (default 100), for lvf"),
)
# Daemon on/off knobs (BooleanOptionalAction): passed as --FLAG / --no-FLAG when given.
DAEMON_SWITCHES = (
    ("--prefix-caching", "reuse the KV blocks of a prompt prefix another request computed "
                         "(default on; --no-prefix-caching turns it off)"),
)
# Frontend knobs passed through unchanged.
FRONTEND_FLAGS = (
    ("--max-queue", int, "requests waiting for a slot before 429"),
    ("--queue-timeout-s", float, "longest wait for a free slot before 429"),
    ("--max-tokens-default", int, "output budget when a request gives none"),
    ("--heartbeat-timeout-s", float, "backend heartbeat older than this makes /health 503"),
    ("--max-body-bytes", int, "larger request bodies get 413"),
    ("--max-prompt-tokens", int, "longer prompts get 400"),
    ("--max-tokens-limit", int, "a larger max_tokens gets 400"),
    ("--request-timeout-s", float, "per-request deadline (0: none)"),
    ("--stall-timeout-s", float, "a streaming client that takes no bytes this long loses its request"),
    ("--header-timeout-s", float, "a request's headers must arrive within this, else the connection is dropped"),
    ("--body-timeout-s", float, "a request's body must arrive within this after its headers, else 408"),
    ("--loop", str, "frontend event loop: auto (uvloop when installed) | asyncio | uvloop"),
)
FRONTEND_SWITCHES = (
    ("--auth-all-routes", "also require the API key on /health, /metrics and /openapi.json"),
    ("--log-prompts", "debug: log every request's prompt text"),
)
STOP_GRACE_S = 15.0
POLL_S = 0.1   # how often the children are checked (a restart waits at most this much longer)


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """When a dead child is started again, and when to give up."""
    backoff_initial_s: float = 0.5   # the first restart's delay; doubled for each quick death after it
    backoff_max_s: float = 30.0
    healthy_reset_s: float = 60.0    # a child that lived this long starts over at backoff_initial_s
    max_restarts: int = 10           # restarts of one child within window_s; one more death: give up
    window_s: float = 600.0

    def __post_init__(self):
        if not 0 <= self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("need 0 <= backoff_initial_s <= backoff_max_s")
        if self.max_restarts < 0 or self.window_s <= 0 or self.healthy_reset_s <= 0:
            raise ValueError("need max_restarts >= 0, window_s > 0, healthy_reset_s > 0")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--model", default="default",
                   help="default (embedded SmolLM2-135M-Instruct) | HF folder | .gguf file | null (echo, no compute)")
    p.add_argument("--executor", default="cpu", help="daemon executor: cpu | cuda | cuda-hostloop")
    p.add_argument("--served-model-name", default=None, help="model name clients send")
    p.add_argument("--ring", default="blink-ring", help="ring name (/dev/shm file)")
    p.add_argument("--ready-timeout-s", type=float, default=600.0,
                   help="give up if the server is not healthy after this long")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    group = p.add_argument_group("restarts (a child that dies after the first ready is started again)")
    group.add_argument("--max-restarts", type=int, default=RestartPolicy.max_restarts,
                       help="give up (exit 1) when one child dies more often than this within --restart-window-s "
                            f"(default {RestartPolicy.max_restarts}; 0: never restart)")
    group.add_argument("--restart-window-s", type=float, default=RestartPolicy.window_s,
                       help=f"see --max-restarts (default {RestartPolicy.window_s:g})")
    group.add_argument("--restart-backoff-s", type=float, default=RestartPolicy.backoff_initial_s,
                       help=f"delay of the first restart, doubled per quick death up to "
                            f"{RestartPolicy.backoff_max_s:g} s (default {RestartPolicy.backoff_initial_s:g})")
    group = p.add_argument_group("passed to blink gpu-daemon")
    for flag, kind, help_text in DAEMON_FLAGS:
        group.add_argument(flag, type=kind, default=None, help=help_text)
    for flag, help_text in DAEMON_SWITCHES:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
    group = p.add_argument_group("passed to blink frontend")
    for flag, kind, help_text in FRONTEND_FLAGS:
        group.add_argument(flag, type=kind, default=None, help=help_text)
    for flag, help_text in FRONTEND_SWITCHES:
        group.add_argument(flag, action="store_true", help=help_text)
    group.add_argument("--api-key", default=None,
                       help=f"require 'Authorization: Bearer KEY' on /v1/* (default ${API_KEY_ENV}); handed to "
                            f"the frontend through its environment, never its command line")


def blink_command() -> list[str]:
    """The `blink` script installed beside this interpreter, else the module."""
    script = pathlib.Path(sys.executable).parent / "blink"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "dpu_frontend.cli"]


def _passthrough(args: argparse.Namespace, flags) -> list[str]:
    out = []
    for flag, _, _ in flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            out += [flag, str(value)]
    return out


def _switches(args: argparse.Namespace, switches) -> list[str]:
    out = []
    for flag, _ in switches:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            out.append(flag if value else "--no-" + flag.lstrip("-"))
    return out


def daemon_argv(args: argparse.Namespace) -> list[str]:
    return [*blink_command(), "gpu-daemon", "--ring", args.ring, "--model", args.model,
            "--executor", args.executor, "--log-level", args.log_level, *_passthrough(args, DAEMON_FLAGS),
            *_switches(args, DAEMON_SWITCHES)]


def frontend_argv(args: argparse.Namespace) -> list[str]:
    argv = [*blink_command(), "frontend", "--ring", args.ring, "--model", args.model,
            "--host", args.host, "--port", str(args.port), "--log-level", args.log_level,
            # serve watches /health itself: the frontend binds at once and answers 503 until ready
            "--startup-timeout-s", "0", *_passthrough(args, FRONTEND_FLAGS)]
    if args.served_model_name:
        argv += ["--served-model-name", args.served_model_name]
    for flag, _ in FRONTEND_SWITCHES:
        if getattr(args, flag.lstrip("-").replace("-", "_")):
            argv.append(flag)
    return argv


def frontend_env(args: argparse.Namespace, state_path: pathlib.Path | None = None) -> dict[str, str] | None:
    """The frontend's environment: ours, plus the API key when --api-key was given (not in argv: ps shows argv),
    plus where the restart counts are kept."""
    env = {}
    if args.api_key:
        env[API_KEY_ENV] = args.api_key
    if state_path is not None:
        env[SUPERVISOR_STATE_ENV] = str(state_path)
    return {**os.environ, **env} if env else None


def restart_policy(args: argparse.Namespace) -> RestartPolicy:
    return RestartPolicy(backoff_initial_s=args.restart_backoff_s,
                         backoff_max_s=max(RestartPolicy.backoff_max_s, args.restart_backoff_s),
                         max_restarts=args.max_restarts, window_s=args.restart_window_s)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when `blink serve` dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


def prepare_default_model() -> None:
    """Convert the embedded GGUF into the cache once, in a child (it imports torch)."""
    folder = default_model_dir()
    if all((folder / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json")):
        return
    print(f"blink serve: preparing the default model in {folder} (once)", flush=True)
    code = "from gpu_backend.model.loader import prepare_default_model as p; p()"
    rc = subprocess.call([sys.executable, "-c", code])
    if rc != 0:
        raise RuntimeError(f"preparing the default model failed (exit code {rc})")


def _healthy(host: str, port: int, api_key: str | None = None) -> bool:
    probe_host = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
    conn = http.client.HTTPConnection(probe_host, port, timeout=2)
    try:
        conn.request("GET", "/health", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


class _Child:
    """One supervised child: its command, the running process, its restart bookkeeping."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None):
        self.name, self.argv, self.env = name, argv, env
        self.proc: subprocess.Popen | None = None
        self.started_s = 0.0                  # monotonic time of the latest start
        self.started_unix_s = 0.0
        self.restarts = 0
        self.delay_s = 0.0                    # backoff before the next restart
        self.due_s: float | None = None       # dead, to be started at this monotonic time
        self.deaths: collections.deque[float] = collections.deque()   # monotonic times, within the window

    def start(self) -> None:
        self.started_s = time.monotonic()
        self.due_s = None
        self.proc = subprocess.Popen(self.argv, start_new_session=True, preexec_fn=_die_with_parent, env=self.env)

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()


class _Children:
    """The two children, started in order and stopped in reverse; restart state for /metrics."""

    def __init__(self, policy: RestartPolicy, state_path: pathlib.Path | None = None):
        self.policy, self.state_path = policy, state_path
        self.procs: list[_Child] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        child = _Child(name, argv, env)
        child.delay_s = self.policy.backoff_initial_s
        self.procs.append(child)
        self._launch(child)

    def _launch(self, child: _Child) -> None:
        child.started_unix_s = time.time()
        child.start()
        self._write_state()   # a restarted frontend finds its own restart counted when it serves

    def _write_state(self) -> None:
        if self.state_path is None:
            return
        with contextlib.suppress(OSError):
            supervisor_state.write(self.state_path, {c.name: ChildState(c.restarts, c.started_unix_s,
                                                                        c.proc is None) for c in self.procs})

    def exited(self) -> tuple[str, int] | None:
        for child in self.procs:
            rc = child.exit_code()
            if rc is not None:
                return child.name, rc
        return None

    def reap(self, now_s: float) -> tuple[_Child, int, bool] | None:
        """A child that died since the last look: (child, exit code, give up?). A child that
        may restart gets its due time and the backoff after it."""
        for child in self.procs:
            rc = child.exit_code()
            if rc is None:
                continue
            child.proc = None
            p = self.policy
            while child.deaths and now_s - child.deaths[0] > p.window_s:
                child.deaths.popleft()
            if len(child.deaths) >= p.max_restarts:
                return child, rc, True
            if now_s - child.started_s >= p.healthy_reset_s:
                child.delay_s = p.backoff_initial_s
            child.deaths.append(now_s)
            child.due_s = now_s + child.delay_s
            self._write_state()   # the frontend's /health says the daemon is being restarted
            return child, rc, False
        return None

    def restart_due(self, now_s: float) -> list[_Child]:
        """Start every dead child whose backoff is over; returns them."""
        out = []
        for child in self.procs:
            if child.proc is None and child.due_s is not None and now_s >= child.due_s:
                child.restarts += 1
                child.delay_s = min(self.policy.backoff_max_s, child.delay_s * 2)
                self._launch(child)
                out.append(child)
        return out

    def stop(self) -> None:
        # Frontend first: it stops taking requests and cancels its in-flight ones; the daemon then drains.
        for child in reversed(self.procs):
            proc = child.proc
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _describe(rc: int) -> str:
    if rc < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-rc).name}"
    return f"exited with code {rc}"


def run(args: argparse.Namespace) -> int:
    from shared_layout.shm import shm_path
    try:
        ring_path = pathlib.Path(shm_path(args.ring))
        policy = restart_policy(args)
    except ValueError as e:
        print(f"blink serve: {e}", file=sys.stderr)
        return 2
    if not 0 < args.port < 65536:
        print(f"blink serve: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    stop = threading.Event()
    restore_signals = stop_on_signals(stop)      # SIGINT / SIGTERM set `stop` (no lock in the handler)
    ring_existed = ring_path.exists()
    state_dir = pathlib.Path(tempfile.mkdtemp(prefix="blink-serve-"))
    state_path = state_dir / "restarts.json"
    children = _Children(policy, state_path)
    try:
        if args.model == "default":
            prepare_default_model()
        if stop.is_set():
            return 0
        children.start(DAEMON, daemon_argv(args))
        children.start(FRONTEND, frontend_argv(args), frontend_env(args, state_path))
        return _supervise(args, children, stop)
    except RuntimeError as e:
        if stop.is_set():   # Ctrl-C during the model preparation: not a failure to report
            return 130
        print(f"blink serve: {e}", file=sys.stderr)
        return 1
    except OSError as e:    # a child could not be started at all (fork or exec failed)
        print(f"blink serve: cannot start a child process: {e}", file=sys.stderr)
        return 1
    finally:
        children.stop()
        shutil.rmtree(state_dir, ignore_errors=True)
        if not ring_existed:
            with contextlib.suppress(FileNotFoundError):
                ring_path.unlink()
        restore_signals()


def _other(name: str) -> str:
    return FRONTEND if name == DAEMON else DAEMON


def _say(line: str) -> None:
    print(f"blink serve: {line}", file=sys.stderr, flush=True)


def _supervise(args: argparse.Namespace, children: _Children, stop: threading.Event) -> int:
    deadline = time.monotonic() + args.ready_timeout_s
    ready = False
    while not stop.is_set():
        if not ready:
            dead = children.exited()
            if dead is not None:   # never served: a configuration error, restarting will not help
                name, rc = dead
                _say(f"{name} {_describe(rc)}; stopped the {_other(name)}")
                return 1
            key = (args.api_key or os.environ.get(API_KEY_ENV)) if args.auth_all_routes else None
            if _healthy(args.host, args.port, key):
                ready = True
                url = f"http://{args.host}:{args.port}"
                name = FrontendConfig(model=args.model, served_model_name=args.served_model_name).served_name()
                print(f"blink serve: ready: {url}/v1 (model {name}, executor {args.executor}); Ctrl-C stops",
                      flush=True)
            elif time.monotonic() > deadline:
                _say(f"not healthy after {args.ready_timeout_s:g} s; stopping")
                return 1
        else:
            now = time.monotonic()
            while (death := children.reap(now)) is not None:
                child, rc, give_up = death
                if give_up:
                    p = children.policy
                    _say(f"{child.name} {_describe(rc)}; it died {len(child.deaths) + 1} times within "
                         f"{p.window_s:g} s (--max-restarts {p.max_restarts}), giving up; stopped the "
                         f"{_other(child.name)}")
                    return 1
                _say(f"{child.name} {_describe(rc)}; restarting it in {child.delay_s:g} s, "
                     f"the {_other(child.name)} keeps running")
            for child in children.restart_due(now):
                _say(f"{child.name} restarted (pid {child.proc.pid}, restart {child.restarts})")
        stop.wait(0.2 if not ready else POLL_S)
    _say("stopping")
    return 0
