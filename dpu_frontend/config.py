"""Configuration of the HTTP frontend, and the one place it reads the environment.

`blink frontend` flags -> FrontendConfig (frozen) -> create_app(config). The ring
client keeps its own small config (ring_client.py); this one holds what the
HTTP layer decides: where to listen, which model name it answers to, how long a
request may wait for a slot, defaults for omitted parameters.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def cache_dir() -> pathlib.Path:
    """${BLINK_CACHE_DIR:-~/.cache/blink}: where prepared models live."""
    return pathlib.Path(os.environ.get("BLINK_CACHE_DIR") or "~/.cache/blink").expanduser()


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
    # Benchmarks only: each streamed chunk also carries "blink_timing" {t_last_ns: the daemon's
    # monotonic stamp of the newest token in it, n_tokens}. Off: the chunks are exactly vLLM's.
    expose_backend_timing: bool = False

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        for name in ("max_queue", "encode_in_thread_chars", "max_stop_strings"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("queue_timeout_s", "startup_timeout_s", "heartbeat_timeout_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_tokens_default is not None and self.max_tokens_default < 1:
            raise ValueError(f"max_tokens_default must be >= 1, got {self.max_tokens_default}")

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
