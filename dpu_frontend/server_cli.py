"""`blink frontend`: the OpenAI-compatible HTTP/SSE server over a ring.

    flags -> FrontendConfig -> create_app (tokenizer loaded, ring attached or
    awaited) -> http_server.run(serve(...), --loop: uvloop when installed, else asyncio's)
    -> http_server.serve (aiohttp behind a per-request header deadline;
    SIGINT/SIGTERM: stop listening, cancel what is in flight, detach)
"""
from __future__ import annotations

import argparse
import logging
import sys

from .config import API_KEY_ENV, DEFAULT_HOST, DEFAULT_MAX_BODY_BYTES, DEFAULT_PORT, FrontendConfig, api_key_from_env


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ring", default="blink-ring", help="ring name (the /dev/shm file the daemon made)")
    p.add_argument("--model", default="default",
                   help="default | null | HF model folder | .gguf file: the tokenizer and chat template")
    p.add_argument("--served-model-name", default=None,
                   help="model name clients send (default: SmolLM2-135M-Instruct for the default model, "
                        "else the folder or file name)")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--max-queue", type=int, default=1024, help="requests waiting for a slot before 429")
    p.add_argument("--queue-timeout-s", type=float, default=30.0,
                   help="longest wait for a free slot before 429 with Retry-After")
    p.add_argument("--max-tokens-default", type=int, default=None,
                   help="output budget when a request gives none (default: 16 for completions, "
                        "the rest of the context for chat)")
    p.add_argument("--startup-timeout-s", type=float, default=30.0,
                   help="wait this long for a READY backend at start, then serve 503 until it comes")
    p.add_argument("--heartbeat-timeout-s", type=float, default=2.0,
                   help="backend heartbeat older than this makes /health 503")
    g = p.add_argument_group("limits (overload and hostile input)")
    g.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"larger request bodies get 413 (default {DEFAULT_MAX_BODY_BYTES})")
    g.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longer prompts get 400 (default: the model's context)")
    g.add_argument("--max-tokens-limit", type=int, default=None,
                   help="a larger max_tokens gets 400; also caps the default (default: the rest of the context)")
    g.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="per-request deadline, arrival to last byte: 504 or an error event after it (0: none)")
    g.add_argument("--stall-timeout-s", type=float, default=30.0,
                   help="a streaming client that takes no bytes this long loses its request (0: never)")
    g.add_argument("--header-timeout-s", type=float, default=10.0,
                   help="a request's headers must arrive within this (from the connection's start, or the "
                        "next request's first byte), else the connection is dropped: slow-header "
                        "(slowloris) protection (0: never)")
    g.add_argument("--body-timeout-s", type=float, default=30.0,
                   help="a request's whole body must arrive within this after its headers, else 408 "
                        "(0: only --request-timeout-s)")
    g = p.add_argument_group("security")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}; prefer the "
                        f"variable, a command line shows in ps)")
    g.add_argument("--auth-all-routes", action="store_true",
                   help="also require the key on /health, /metrics and /openapi.json")
    g.add_argument("--log-prompts", action="store_true",
                   help="debug: log every request's prompt text (off: prompts and keys never reach the log)")
    p.add_argument("--expose-backend-timing", action="store_true",
                   help="benchmarks: add blink_timing {t_last_ns, n_tokens} (daemon clock) to each streamed chunk")
    from .transport import verbs
    verbs.add_arguments(p)   # --transport shm|verbs, --daemon HOST:PORT, RDMA device options
    p.add_argument("--loop", default="auto", choices=("auto", "asyncio", "uvloop"),
                   help="event loop: uvloop (faster per event), asyncio's own, or auto: uvloop when installed")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")


def config_from_args(args: argparse.Namespace) -> FrontendConfig:
    return FrontendConfig(
        ring_name=args.ring, model=args.model, served_model_name=args.served_model_name,
        host=args.host, port=args.port, max_queue=args.max_queue, queue_timeout_s=args.queue_timeout_s,
        max_tokens_default=args.max_tokens_default, startup_timeout_s=args.startup_timeout_s,
        heartbeat_timeout_s=args.heartbeat_timeout_s, expose_backend_timing=args.expose_backend_timing,
        max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit, request_timeout_s=args.request_timeout_s,
        stall_timeout_s=args.stall_timeout_s, header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s, api_key=args.api_key or api_key_from_env(),
        auth_all_routes=args.auth_all_routes, log_prompts=args.log_prompts)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from shared_layout.shm import shm_path

    from .app import create_app
    from .http_server import loop_factory, run as run_loop, serve
    from .tokenizer import TokenizerError
    try:
        loop_name, _ = loop_factory(args.loop)
        logging.getLogger(__name__).debug("event loop: %s (--loop %s)", loop_name, args.loop)
        shm_path(args.ring)
        config = config_from_args(args)
        from .transport import verbs
        factory = verbs.transport_factory_from_args(args)   # None: shared memory; exits with one line without RDMA
        app = create_app(config, transport_factory=factory)
    except (TokenizerError, ValueError) as e:
        print(f"blink frontend: {e}", file=sys.stderr)
        return 2

    def ready() -> None:
        logging.getLogger(__name__).info(
            "serving %s on http://%s:%d (ring %s, API key %s, %s loop)", config.served_name(), config.host,
            config.port, config.ring_name, "required" if config.api_key else "off", loop_name)

    try:
        run_loop(serve(app, config.host, config.port, header_timeout_s=config.header_timeout_s,
                       access_log=logging.getLogger("aiohttp.access") if args.access_log else None,
                       on_ready=ready), args.loop)
    except KeyboardInterrupt:
        pass
    except OSError as e:
        print(f"blink frontend: cannot listen on {config.host}:{config.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0
