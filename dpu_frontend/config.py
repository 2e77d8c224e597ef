"""Configuration of the HTTP frontend, and the one place it reads the environment.

`blink frontend` flags -> FrontendConfig (frozen) -> create_app(config). The ring
client keeps its own small config (ring_client.py); this one holds what the
HTTP layer decides: where to listen, which model name it answers to, how long a
request may wait for a slot, defaults for omitted parameters, the limits that
keep an overloaded or hostile client from exhausting the server, and the API key.

Environment: BLINK_CACHE_DIR (prepared models), BLINK_API_KEY (the API key when
no --api-key is given; preferred, since a command line shows in `ps`),
BLINK_SUPERVISOR_STATE (set by `blink serve`: its restart counts, supervisor_state.py).
"""
from __future__ import annotations

import dataclasses
import os
import pathlib

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
API_KEY_ENV = "BLINK_API_KEY"
SUPERVISOR_STATE_ENV = "BLINK_SUPERVISOR_STATE"
DEFAULT_MAX_BODY_BYTES = 4 << 20   # a 128k-token prompt as JSON text fits many times over


def cache_dir() -> pathlib.Path:
    """${BLINK_CACHE_DIR:-~/.cache/blink}: where prepared models live."""
    return pathlib.Path(os.environ.get("BLINK_CACHE_DIR") or "~/.cache/blink").expanduser()


def api_key_from_env() -> str | None:
    """$BLINK_API_KEY, or None when unset or empty."""
    return os.environ.get(API_KEY_ENV) or None


def supervisor_state_path() -> pathlib.Path | None:
    """$BLINK_SUPERVISOR_STATE: the file where `blink serve` keeps its restart counts (None: unsupervised)."""
    value = os.environ.get(SUPERVISOR_STATE_ENV)
    return pathlib.Path(value) if value else None


def default_model_dir() -> pathlib.Path:
    """The default model as an HF folder, once `prepare_default_model()` made it.

    Same path as gpu_backend.model.loader.default_model_dir(); computed here so
    the frontend never imports the torch side.
    """
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


@dataclasses.dataclass(frozen=True)
class FrontendConfig:
    """What the HTTP layer needs; one instance per process."""
    ring_name: str = "blink-ring"
    model: str = "default"               # default | null | HF folder | .gguf file (tokenizer + chat template)
    served_model_name: str | None = None  # None: derived from `model` (served_name())
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    max_queue: int = 1024                # requests waiting for a slot before 429
    queue_timeout_s: float = 30.0        # longest wait for a slot before 429
    max_tokens_default: int | None = None  # None: completions 16, chat the rest of the context
    startup_timeout_s: float = 30.0      # wait this long for a READY backend, then serve 503s
    heartbeat_timeout_s: float = 2.0     # backend heartbeat older than this: /health 503
    encode_in_thread_chars: int = 4096   # prompts longer than this are tokenized off the event loop
    max_stop_strings: int = 32
    # Limits (overload and hostile input). None: only the model's context bounds it.
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES   # larger bodies: 413
    max_prompt_tokens: int | None = None   # longer prompts: 400
    max_tokens_limit: int | None = None    # a larger max_tokens: 400; also caps the default
    request_timeout_s: float = 600.0       # per-request deadline, arrival to last byte (0: none)
    stall_timeout_s: float = 30.0          # a client that takes no bytes this long: request cancelled (0: never)
    header_timeout_s: float = 10.0         # a request's headers must arrive within this: else dropped (0: never)
    body_timeout_s: float = 30.0           # a request's body must arrive within this after its headers: 408 (0: never)
    # Security. api_key None: no authentication.
    api_key: str | None = dataclasses.field(default=None, repr=False)   # never in reprs or logs
    auth_all_routes: bool = False          # also require the key on /health, /metrics, /openapi.json
    log_prompts: bool = False              # debug only: log each request's prompt text
    # Benchmarks only: each streamed chunk also carries "blink_timing" {t_last_ns: the daemon's
    # monotonic stamp of the newest token in it, n_tokens}. Off: the chunks are exactly vLLM's.
    expose_backend_timing: bool = False

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        for name in ("max_queue", "encode_in_thread_chars", "max_stop_strings"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("queue_timeout_s", "startup_timeout_s", "heartbeat_timeout_s", "request_timeout_s",
                     "stall_timeout_s", "header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_tokens_default", "max_prompt_tokens", "max_tokens_limit"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.api_key is not None and (not self.api_key or self.api_key != self.api_key.strip()
                                         or not (self.api_key.isascii() and self.api_key.isprintable())):
            raise ValueError("api_key must be non-empty printable ASCII without surrounding spaces")

    def served_name(self) -> str:
        """The model name clients send and /v1/models lists."""
        if self.served_model_name:
            return self.served_model_name
        if self.model in ("default", ""):
            return DEFAULT_MODEL_NAME
        if self.model == "null":
            return "null"
        p = pathlib.Path(self.model.rstrip("/"))
        return p.stem if p.suffix == ".gguf" else p.name
