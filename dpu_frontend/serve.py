"""`blink serve`: the GPU daemon and the frontend as two child processes, one command.

    prepare the default model (once, in a child: the torch side stays out of this
    process) -> spawn `blink gpu-daemon ...` and `blink frontend ...` (the `blink`
    script beside sys.executable, so each shows under its own name; each in its
    own session, dying with this process) -> wait until GET /health is 200 ->
    print the URL -> supervise:
        Ctrl-C / SIGTERM -> stop the frontend, then the daemon (SIGTERM, then
            SIGKILL after a grace period) -> exit 0
        a child exits   -> stop the other -> one line naming it -> exit 1

Binds 127.0.0.1 by default. The ring file is removed at exit if this command
created it.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import http.client
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

from .config import API_KEY_ENV, DEFAULT_HOST, DEFAULT_PORT, FrontendConfig, default_model_dir

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
    ("--dtype", str, "cpu executor weights/KV: auto | float32 | bfloat16 (auto: bf16 on CPUs with native bf16)"),
    ("--shutdown-grace-s", float, "on stop, in-flight requests get this long before they are aborted"),
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
    group = p.add_argument_group("passed to blink gpu-daemon")
    for flag, kind, help_text in DAEMON_FLAGS:
        group.add_argument(flag, type=kind, default=None, help=help_text)
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


def daemon_argv(args: argparse.Namespace) -> list[str]:
    return [*blink_command(), "gpu-daemon", "--ring", args.ring, "--model", args.model,
            "--executor", args.executor, "--log-level", args.log_level, *_passthrough(args, DAEMON_FLAGS)]


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


def frontend_env(args: argparse.Namespace) -> dict[str, str] | None:
    """The frontend's environment: ours, plus the API key when --api-key was given (not in argv: ps shows argv)."""
    if not args.api_key:
        return None
    return {**os.environ, API_KEY_ENV: args.api_key}


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


class _Children:
    """The two children, started in order and stopped in reverse."""

    def __init__(self):
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        proc = subprocess.Popen(argv, start_new_session=True, preexec_fn=_die_with_parent, env=env)
        self.procs.append((name, proc))

    def exited(self) -> tuple[str, int] | None:
        for name, proc in self.procs:
            rc = proc.poll()
            if rc is not None:
                return name, rc
        return None

    def stop(self) -> None:
        # Frontend first: it stops taking requests and cancels its in-flight ones; the daemon then drains.
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
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
    except ValueError as e:
        print(f"blink serve: {e}", file=sys.stderr)
        return 2
    if not 0 < args.port < 65536:
        print(f"blink serve: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    stop = threading.Event()
    signals = {signal.SIGINT: "interrupt", signal.SIGTERM: "SIGTERM"}
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in signals}
    ring_existed = ring_path.exists()
    children = _Children()
    try:
        if args.model == "default":
            prepare_default_model()
        if stop.is_set():
            return 0
        children.start("gpu-daemon", daemon_argv(args))
        children.start("frontend", frontend_argv(args), frontend_env(args))
        return _supervise(args, children, stop)
    except RuntimeError as e:
        if stop.is_set():   # Ctrl-C during the model preparation: not a failure to report
            return 130
        print(f"blink serve: {e}", file=sys.stderr)
        return 1
    finally:
        children.stop()
        if not ring_existed:
            with contextlib.suppress(FileNotFoundError):
                ring_path.unlink()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _supervise(args: argparse.Namespace, children: _Children, stop: threading.Event) -> int:
    deadline = time.monotonic() + args.ready_timeout_s
    ready = False
    while not stop.is_set():
        dead = children.exited()
        if dead is not None:
            name, rc = dead
            other = "frontend" if name == "gpu-daemon" else "gpu-daemon"
            print(f"blink serve: {name} {_describe(rc)}; stopped the {other}", file=sys.stderr, flush=True)
            return 1
        if not ready:
            key = (args.api_key or os.environ.get(API_KEY_ENV)) if args.auth_all_routes else None
            if _healthy(args.host, args.port, key):
                ready = True
                url = f"http://{args.host}:{args.port}"
                name = FrontendConfig(model=args.model, served_model_name=args.served_model_name).served_name()
                print(f"blink serve: ready: {url}/v1 (model {name}, executor {args.executor}); Ctrl-C stops",
                      flush=True)
            elif time.monotonic() > deadline:
                print(f"blink serve: not healthy after {args.ready_timeout_s:g} s; stopping", file=sys.stderr,
                      flush=True)
                return 1
        stop.wait(0.2 if not ready else 0.5)
    print("blink serve: stopping", file=sys.stderr, flush=True)
    return 0
