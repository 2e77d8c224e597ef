"""The aiohttp application: routes, error handling, and the ring client's lifetime.

    create_app(config) -> web.Application
        POST /v1/completions, /v1/chat/completions -> completions.GenerationService
        GET  /v1/models, /health (200 | 503), /metrics (Prometheus text; with
             `blink serve`, its restart counts from supervisor_state.py),
             /openapi.json (the API as an OpenAPI 3.1 document, openapi.py)
        header deadline middleware (outermost; http_server.py): tells the connection
            its request's headers arrived, so a slow-header client is cut off
        error middleware: ApiError -> {"error": {...}} with its status; anything
            unexpected -> 500 JSON, logged without the request body
        API key middleware (auth.py) when config.api_key is set: 401 without it
        cleanup_ctx: RingClient.start() (waits up to startup_timeout_s for a READY
            backend, then serves 503s until one comes) ... RingClient.close()

A ring client and a tokenizer may be passed in (tests, benchmarks); otherwise
the app opens the ring named in the config over shared memory and loads the
tokenizer of `config.model`.
"""
from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from . import openai_api as api
from . import openapi, supervisor_state
from .auth import api_key_middleware
from .completions import CHAT, COMPLETIONS, STREAM_STARTED, Endpoint, GenerationService, code_trace, handle_generation
from .config import FrontendConfig, supervisor_state_path
from .http_server import header_deadline_middleware
from .limits import RequestLimits
from .metrics import FrontendMetrics
from .openai_api import ApiError
from .ring_client import RingClient, RingClientConfig
from .tokenizer import ModelTokenizer, load_tokenizer

log = logging.getLogger(__name__)

CONFIG = web.AppKey("config", FrontendConfig)
SERVICE = web.AppKey("service", GenerationService)
CLIENT = web.AppKey("client", RingClient)
METRICS = web.AppKey("metrics", FrontendMetrics)
OWNS_CLIENT = web.AppKey("owns_client", bool)
STARTED_AT = web.AppKey("started_at", int)
SUPERVISOR_STATE = web.AppKey("supervisor_state", object)   # pathlib.Path | None

_ENDPOINT_BY_PATH = {"/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT}
_OUTCOME_BY_STATUS = {400: "invalid", 401: "unauthorized", 404: "invalid", 405: "invalid", 408: "timeout",
                      413: "invalid", 429: "rate_limited", 503: "unavailable", 504: "timeout"}


def ring_client_for(config: FrontendConfig, transport_factory=None) -> RingClient:
    """A RingClient over `transport_factory` (RDMA), else the shared-memory ring named in `config`."""
    from .transport.shm import ShmTransport
    name = config.ring_name
    return RingClient(transport_factory or (lambda: ShmTransport.open(name)),
                      RingClientConfig(health_window_s=config.heartbeat_timeout_s, max_queue=max(1, config.max_queue)))


def create_app(config: FrontendConfig, *, client: RingClient | None = None,
               tokenizer: ModelTokenizer | None = None, transport_factory=None) -> web.Application:
    """The frontend app. A passed `client` is started and closed by its owner, not here."""
    tokenizer = tokenizer or load_tokenizer(config.model, config.encode_in_thread_chars)
    model = config.served_name()
    metrics = FrontendMetrics(model)
    owns = client is None
    client = client or ring_client_for(config, transport_factory)
    middlewares = [header_deadline_middleware, _errors]
    if config.api_key:
        middlewares.append(api_key_middleware(config.api_key, config.auth_all_routes))
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_bytes)
    app[CONFIG] = config
    app[CLIENT] = client
    app[OWNS_CLIENT] = owns
    app[METRICS] = metrics
    app[STARTED_AT] = int(time.time())
    app[SUPERVISOR_STATE] = supervisor_state_path()
    app[SERVICE] = GenerationService(client, tokenizer, metrics, model, config.queue_timeout_s,
                                     config.max_tokens_default, config.max_stop_strings,
                                     config.expose_backend_timing, RequestLimits.from_config(config),
                                     config.log_prompts)
    app.router.add_post("/v1/completions", _endpoint(COMPLETIONS))
    app.router.add_post("/v1/chat/completions", _endpoint(CHAT))
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/openapi.json", _openapi)
    app.cleanup_ctx.append(_client_lifetime)
    return app


async def _client_lifetime(app: web.Application):
    client, config = app[CLIENT], app[CONFIG]
    if app[OWNS_CLIENT]:
        await client.start()
        deadline = time.monotonic() + config.startup_timeout_s
        while not client.health().healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        h = client.health()
        if h.healthy:
            log.info("backend ready (epoch %d, context %d tokens)", h.backend_epoch, client.model_max_len)
        else:
            log.warning("no ready backend after %.0f s (%s); serving 503 until one comes",
                        config.startup_timeout_s, h.message or h.status)
    yield
    if app[OWNS_CLIENT]:
        await client.close()


def _endpoint(endpoint: Endpoint):
    async def handler(request: web.Request) -> web.StreamResponse:
        return await handle_generation(request, request.app[SERVICE], endpoint)
    handler.__name__ = f"post_{endpoint.name}"
    return handler


async def _models(request: web.Request) -> web.Response:
    app = request.app
    body = api.models_body(app[SERVICE].model, app[CLIENT].model_max_len or None, app[STARTED_AT])
    return web.json_response(body, dumps=api.dumps)


async def _health(request: web.Request) -> web.Response:
    h = request.app[CLIENT].health()
    if not h.healthy:
        children = supervisor_state.read(request.app[SUPERVISOR_STATE]) or {}
        daemon = children.get(supervisor_state.DAEMON)
        restarting = (f"; blink serve is restarting the gpu-daemon (restart {daemon.restarts + 1})"
                      if daemon is not None and daemon.restarting else "")
        raise ApiError(503, f"backend not healthy: {h.message or h.status}{restarting}", retry_after_s=1.0)
    return web.json_response({"status": "ok", "backend_status": h.status, "backend_epoch": h.backend_epoch,
                              "heartbeat_age_s": h.heartbeat_age_s})


async def _openapi(request: web.Request) -> web.Response:
    app = request.app
    doc = openapi.document(app[CONFIG], app[SERVICE].limits.vocab_size, app[CLIENT].model_max_len or None)
    return web.json_response(doc, dumps=api.dumps)


async def _metrics(request: web.Request) -> web.Response:
    app = request.app
    client = app[CLIENT]
    text = app[METRICS].render(client.stats(), client.health(), supervisor_state.read(app[SUPERVISOR_STATE]))
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


@web.middleware
async def _errors(request: web.Request, handler):
    """Every failure becomes the OpenAI error object; nothing leaks a traceback."""
    endpoint = _ENDPOINT_BY_PATH.get(request.path)
    try:
        return await handler(request)
    except ApiError as e:
        err = e
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = ApiError(e.status, _http_message(request, e))
    except asyncio.CancelledError:
        raise
    except Exception as e:
        # The message may quote the prompt; the type and the traceback (code only) do not.
        log.error("unhandled %s in %s %s\n%s", type(e).__name__, request.method, request.path, code_trace(e))
        started = request.get(STREAM_STARTED)
        if started is not None:
            return started   # headers and some events are out; aiohttp ends the stream
        err = ApiError(500, f"internal server error ({type(e).__name__}); see the server log")
    if endpoint is not None:
        request.app[METRICS].outcome(endpoint.name, _OUTCOME_BY_STATUS.get(err.status, "internal_error"))
    return web.json_response(err.body(), status=err.status, headers=err.headers(), dumps=api.dumps)


def _http_message(request: web.Request, e: web.HTTPException) -> str:
    if e.status == 404:
        return f"no route {request.method} {request.path}"
    if e.status == 405:
        return f"method {request.method} not allowed on {request.path}"
    if e.status == 413:
        return f"request body too large (limit {request.app[CONFIG].max_body_bytes} bytes)"
    return e.reason or str(e.status)
