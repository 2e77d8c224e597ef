"""The served API as an OpenAPI 3.1 document: the schemas come from protocol.py's models.

    FrontendConfig + vocab size + context length -> ApiLimits -> protocol.request_models()
        -> pydantic JSON schemas (requests: validation mode, exactly what parse_* accepts;
           responses and the error object) + the routes and statuses below -> document()
        -> GET /openapi.json

The request schemas say what validation lets through (types, ranges, the neutral values of
parameters we cannot honour, additionalProperties: false where unknown keys are rejected), so a
schema-driven fuzzer (schemathesis) can tell valid from invalid input; the responses list
every status the server may answer with. Only the routes and their statuses are written here.
"""
from __future__ import annotations

import functools
import json

from pydantic.json_schema import models_json_schema

from . import protocol
from .config import FrontendConfig
from .protocol import MAX_I32, ApiLimits


def _error_response(description: str) -> dict:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


@functools.lru_cache(maxsize=16)
def _schemas(limits: ApiLimits) -> str:
    """Every model's JSON schema, keyed by name, as JSON text (cached: one per distinct limits)."""
    models = protocol.request_models(limits)
    _, top = models_json_schema(
        [(models.completion, "validation"), (models.chat, "validation"),
         (protocol.CompletionResponse, "validation"), (protocol.ChatCompletionResponse, "validation"),
         (protocol.ErrorResponse, "validation")],
        ref_template="#/components/schemas/{model}")
    return json.dumps(top["$defs"])


def schemas(limits: ApiLimits) -> dict:
    return json.loads(_schemas(limits))


# One server-sent event (Open API before 3.2 has a text/event-stream `schema` describe each event, as
# schemathesis reads it): `data` holds one JSON chunk, or `[DONE]` at the end.
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                             "retry": {"type": "integer"}}}


def _generation_responses(reply_ref: str) -> dict:
    return {
        "200": {"description": "the completion (JSON), or server-sent events ending with `data: [DONE]` "
                               "when stream is true",
                "content": {"application/json": {"schema": {"$ref": reply_ref}},
                            "text/event-stream": {"schema": _SSE_EVENT}}},
        "400": _error_response("invalid request: the error names the parameter"),
        "401": _error_response("missing or wrong API key (when one is configured)"),
        "404": _error_response("unknown model name"),
        "408": _error_response("the body did not arrive within the body timeout or the request deadline"),
        "413": _error_response("request body larger than the server's limit"),
        "429": _error_response("server busy: wait queue full or no slot in time; see Retry-After"),
        "503": _error_response("no backend serving the ring (down, starting, restarted); see Retry-After"),
        "504": _error_response("the request deadline passed while generating"),
    }


def document(config: FrontendConfig, vocab_size: int, max_model_len: int | None = None) -> dict:
    """The OpenAPI 3.1 document for this server's settings and model."""
    limits = ApiLimits("", vocab_size, config.max_stop_strings,
                       min(x for x in (MAX_I32, config.max_tokens_limit, max_model_len) if x))
    security = [{"bearer": []}] if config.api_key else []
    open_security = security if config.auth_all_routes else []
    return {
        "openapi": "3.1.0",
        "info": {"title": "BLINK-py OpenAI-compatible API", "version": "1",
                 "description": "OpenAI /v1/completions and /v1/chat/completions (vLLM's extensions: "
                                "ignore_eos, top_k, stop_token_ids, ...) served over the BLINK ring."},
        "servers": [{"url": "/"}],
        "paths": {
            "/v1/completions": {"post": {
                "operationId": "createCompletion", "security": security,
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/CompletionRequest"}}}},
                "responses": _generation_responses("#/components/schemas/CompletionResponse")}},
            "/v1/chat/completions": {"post": {
                "operationId": "createChatCompletion", "security": security,
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}}}},
                "responses": _generation_responses("#/components/schemas/ChatCompletionResponse")}},
            "/v1/models": {"get": {
                "operationId": "listModels", "security": security,
                "responses": {"200": {"description": "the served model",
                                      "content": {"application/json": {"schema": {"type": "object"}}}},
                              "401": _error_response("missing or wrong API key")}}},
            "/health": {"get": {
                "operationId": "health", "security": open_security,
                "responses": {"200": {"description": "a READY backend with a fresh heartbeat",
                                      "content": {"application/json": {"schema": {"type": "object"}}}},
                              "401": _error_response("missing or wrong API key (auth_all_routes)"),
                              "503": _error_response("backend down, starting, stopping or silent")}}},
            "/metrics": {"get": {
                "operationId": "metrics", "security": open_security,
                "responses": {"200": {"description": "Prometheus text format 0.0.4",
                                      "content": {"text/plain": {"schema": {"type": "string"}}}},
                              "401": _error_response("missing or wrong API key (auth_all_routes)")}}},
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": schemas(limits),
        },
    }
