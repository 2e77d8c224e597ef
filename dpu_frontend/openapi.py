"""The served API as an OpenAPI 3.1 document, written by hand from what openai_api.py accepts.

    FrontendConfig + vocab size + context length -> document() -> GET /openapi.json

The request schemas say exactly what validation lets through (types, ranges,
the no-op values of parameters we cannot honour, additionalProperties: false
where unknown keys are rejected), so a schema-driven fuzzer (schemathesis)
can tell valid from invalid input; the responses list every status the server
may answer with and the error object's shape. Keep it in step with
openai_api.parse_completion / parse_chat.
"""
from __future__ import annotations

from typing import Any

from .config import FrontendConfig
from .openai_api import MAX_BAD_WORDS, MAX_CHOICES, MAX_I32, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_SEED, MIN_SEED

_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _error_response(description: str) -> dict:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def _token_ids(vocab_size: int, min_items: int) -> dict:
    return {"type": "array", "minItems": min_items,
            "items": {"type": "integer", "minimum": 0, "maximum": max(0, vocab_size - 1)}}


def _sampling(config: FrontendConfig, vocab_size: int, max_model_len: int | None) -> dict[str, Any]:
    """Properties both endpoints share: sampling, stopping, streaming, accepted no-ops."""
    max_tokens = {"type": "integer", "minimum": 1,
                  "maximum": min(x for x in (MAX_I32, config.max_tokens_limit, max_model_len) if x)}
    return {
        "model": _nullable({"type": "string", "description": "must be the served model's name"}),
        "max_tokens": _nullable(max_tokens),
        "max_completion_tokens": _nullable(max_tokens),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 1e4}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1, "maximum": MAX_I32}),
        "seed": _nullable({"type": "integer", "minimum": MIN_SEED, "maximum": MAX_SEED}),
        "ignore_eos": _nullable(_BOOL),
        "stop": _nullable({"anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "maxItems": config.max_stop_strings, "items": {"type": "string", "minLength": 1}}]}),
        "stop_token_ids": _nullable(_token_ids(vocab_size, 0)),
        "include_stop_str_in_output": _nullable(_BOOL),
        "skip_special_tokens": _nullable(_BOOL),
        "add_special_tokens": _nullable(_BOOL),
        "stream": _nullable(_BOOL),
        "stream_options": _nullable({
            "type": "object", "additionalProperties": False,
            "description": "only with stream: true",
            "properties": {"include_usage": _nullable(_BOOL), "continuous_usage_stats": _nullable(_BOOL)}}),
        "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 2}),
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "min_tokens": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_I32,
                                 "description": "at most max_tokens"}),
        "logit_bias": _nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                                 "propertyNames": {"pattern": "^[0-9]+$"},
                                 "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                                 "description": "token id (in the vocabulary) -> bias added to its logit"}),
        "allowed_token_ids": _nullable(_token_ids(vocab_size, 1)),
        "bad_words": _nullable({"type": "array", "maxItems": MAX_BAD_WORDS,
                                "items": {"type": "string", "minLength": 1, "pattern": "\\S"}}),
        "prompt_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_CHOICES}),
        "best_of": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_CHOICES,
                              "description": "at least n; more than n only without stream"}),
        "user": {"description": "accepted and ignored"},
        "metadata": {"description": "accepted and ignored"},
    }


def _completion_request(config: FrontendConfig, vocab_size: int, max_model_len: int | None) -> dict:
    text = {"type": "string", "minLength": 1}
    ids = _token_ids(vocab_size, 1)
    props = _sampling(config, vocab_size, max_model_len)
    props["prompt"] = {"anyOf": [text, ids, {"type": "array", "minItems": 1, "maxItems": 1,
                                             "items": {"anyOf": [text, ids]}}],
                       "description": "text, token ids, or a one-element list of either"}
    props["suffix"] = _nullable({"const": ""})
    props["echo"] = _nullable(_BOOL)
    props["logprobs"] = _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS})
    for name in ("max_tokens", "max_completion_tokens"):
        zero_ok = dict(props[name]["anyOf"][0], minimum=0, description="0 only with echo: the prompt alone")
        props[name] = _nullable(zero_ok)
    return {"type": "object", "required": ["prompt"], "additionalProperties": False, "properties": props}


def _chat_request(config: FrontendConfig, vocab_size: int, max_model_len: int | None) -> dict:
    part = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role", "content"], "additionalProperties": False,
               "properties": {
                   "role": {"enum": ["system", "developer", "user", "assistant"]},
                   "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]},
                   "name": _nullable({"type": "string"})}}
    props = _sampling(config, vocab_size, max_model_len)
    props["messages"] = {"type": "array", "minItems": 1, "items": message}
    props["add_generation_prompt"] = _nullable(_BOOL)
    props["continue_final_message"] = _nullable(_BOOL)
    props["chat_template_kwargs"] = _nullable({"type": "object"})
    props["logprobs"] = _nullable(_BOOL)
    props["top_logprobs"] = _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                                       "description": "needs logprobs: true"})
    props["tools"] = _nullable({"type": "array", "maxItems": 0})
    return {"type": "object", "required": ["messages"], "additionalProperties": False, "properties": props}


_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {k: _INT for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
_FINISH = {"enum": ["stop", "length", "abort", "error", None]}


def _reply(choice: dict) -> dict:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices"],
            "properties": {"id": {"type": "string"}, "object": {"type": "string"}, "created": _INT,
                           "model": {"type": "string"}, "usage": _USAGE,
                           "choices": {"type": "array", "items": choice}}}


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
    security = [{"bearer": []}] if config.api_key else []
    open_security = security if config.auth_all_routes else []
    text_choice = {"type": "object", "properties": {"index": _INT, "text": {"type": "string"},
                                                    "finish_reason": _FINISH}}
    chat_choice = {"type": "object", "properties": {
        "index": _INT, "finish_reason": _FINISH,
        "message": {"type": "object", "properties": {"role": {"const": "assistant"},
                                                     "content": {"type": "string"}}}}}
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
                "responses": _generation_responses("#/components/schemas/Completion")}},
            "/v1/chat/completions": {"post": {
                "operationId": "createChatCompletion", "security": security,
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}}}},
                "responses": _generation_responses("#/components/schemas/ChatCompletion")}},
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
            "schemas": {
                "CompletionRequest": _completion_request(config, vocab_size, max_model_len),
                "ChatCompletionRequest": _chat_request(config, vocab_size, max_model_len),
                "Completion": _reply(text_choice),
                "ChatCompletion": _reply(chat_choice),
                "ErrorResponse": {"type": "object", "required": ["error"], "properties": {"error": {
                    "type": "object", "required": ["message", "type", "code"],
                    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                   "param": {"type": ["string", "null"]}, "code": _INT}}}},
            },
        },
    }
