"""The OpenAI wire format as vLLM serves it: requests to what the service needs, and reply bodies. No I/O.

    JSON body -> parse_completion / parse_chat: the request models of protocol.py validate it
                 (pydantic; a ValidationError becomes an ApiError 400 naming the parameter)
              -> CompletionRequest | ChatRequest (frozen dataclasses: what the service reads;
                 SamplingOptions travels to the slot, structured outputs as one Constraint)
    tokens/text -> completion_chunk / chat_chunk / usage_chunk -> sse() bytes
                -> completion_body / chat_body for non-streaming replies

What is accepted, with which ranges and defaults, is declared once in protocol.py (the
same models give /openapi.json); this module only converts a validated request and checks
what needs the served model's name. The daemon applies the sampling surface (it travels in
the slot).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import time
import uuid
from http import HTTPStatus
from typing import Any

from pydantic import ValidationError

from . import protocol
from .protocol import MAX_I32, ApiLimits  # noqa: F401  (the service builds its limits through this module)
from .structured import request as structured
from .structured import tools as tool_calls
from .structured.request import Constraint

COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's (and vLLM's) default for /v1/completions


class ApiError(Exception):
    """An error reply: HTTP status plus the OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 retry_after_s: float | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.extra_headers = headers or {}

    @property
    def type(self) -> str:
        return _ERROR_TYPES.get(self.status, HTTPStatus(self.status).phrase.replace(" ", "") + "Error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return dict(self.extra_headers)
        return {**self.extra_headers, "Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 413: "RequestEntityTooLargeError", 429: "RateLimitError",
                500: "InternalServerError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


# -- parsed requests ----------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """What the request asks of generation; max_tokens None = endpoint default."""
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 = off (vLLM's -1 maps here)
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()     # strings; tokenized by the service (completions.py)
    logprobs: int | None = None         # top entries per generated token; None: no logprobs
    prompt_logprobs: int | None = None  # top entries per prompt token (echo with logprobs asks for them too)
    n: int = 1                          # choices returned
    constraint: Constraint | None = None   # structured output (response_format, structured_outputs, guided_*)
    best_of: int = 1                    # choices generated (>= n); the n with the highest cumulative logprob return
    priority: int = 0                   # lower runs first (the daemon's priority policy)
    ttft_slo_ms: int = 0                # 0: the daemon's default
    tbt_slo_ms: int = 0


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    stream: bool = False
    include_usage: bool = False         # a usage-only chunk before [DONE]
    continuous_usage: bool = False      # usage on every chunk (vLLM's continuous_usage_stats)


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompt: str | tuple[int, ...]       # text, or token ids
    sampling: SamplingOptions
    stream: StreamOptions
    add_special_tokens: bool = True
    echo: bool = False                  # the prompt opens the reply (with its logprobs when asked)


@dataclasses.dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[dict, ...] = ()   # an assistant's calls: {"id", "name", "arguments" (JSON text)}
    tool_call_id: str | None = None     # a tool result's call


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: tuple[ChatMessage, ...]
    sampling: SamplingOptions
    stream: StreamOptions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False    # the template already places BOS etc.
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()
    tools: tool_calls.ToolSpec | None = None
    echo: bool = False                  # the reply opens with the last message's content when roles match
    reply_role: str = "assistant"       # the reply message's role (the last message's without a generation prompt)


# -- validation -----------------------------------------------------------------

def _validate(model: type[protocol.OpenAIBaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        message, param = protocol.describe(e, model)
        raise bad_request(message, param) from None


def _check_model(model: str | None, limits: ApiLimits) -> None:
    if model is not None and model != limits.served_model:
        shown = model if len(model) <= 100 else model[:97] + "..."
        shown = shown.encode("utf-8", "backslashreplace").decode("utf-8")   # lone surrogates stay printable
        raise ApiError(404, f"The model `{shown}` does not exist.", "model")


def _sampling(r: protocol.SamplingRequest, body: dict, logprobs: int | None, echo: bool = False) -> SamplingOptions:
    prompt_logprobs = r.prompt_logprobs
    if echo and logprobs is not None and prompt_logprobs is None:
        prompt_logprobs = logprobs   # echo + logprobs: the prompt's tokens come with theirs (vLLM)
    stop = r.stop if r.stop is not None else ()
    return SamplingOptions(
        max_tokens=r.requested_max_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=0 if r.top_k == -1 else r.top_k,
        seed=r.seed,
        ignore_eos=r.ignore_eos,
        stop=(stop,) if isinstance(stop, str) else tuple(dict.fromkeys(stop)),
        stop_token_ids=tuple(dict.fromkeys(r.stop_token_ids or ())),
        include_stop_str_in_output=r.include_stop_str_in_output,
        skip_special_tokens=r.skip_special_tokens,
        presence_penalty=r.presence_penalty,
        frequency_penalty=r.frequency_penalty,
        repetition_penalty=r.repetition_penalty,
        min_p=r.min_p,
        min_tokens=r.min_tokens,
        logit_bias=r.logit_bias or (),
        allowed_token_ids=tuple(dict.fromkeys(r.allowed_token_ids or ())),
        bad_words=tuple(dict.fromkeys(r.bad_words or ())),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        n=r.n,
        best_of=r.best_of if r.best_of is not None else r.n,
        constraint=_constraint(body),
        priority=r.priority,
        ttft_slo_ms=r.ttft_slo_ms or 0,
        tbt_slo_ms=r.tbt_slo_ms or 0,
    )


def _constraint(body: dict) -> Constraint | None:
    """The structured-output constraint in canonical form (compiled later, by the service: it
    needs the vocabulary)."""
    if body.keys().isdisjoint(structured.KEYS):
        return None      # the common request: no constraint
    try:
        return structured.parse(body)
    except structured.ConstraintError as e:
        raise bad_request(str(e), e.param) from None


def _stream(r: protocol.SamplingRequest) -> StreamOptions:
    o = r.stream_options
    if o is None:
        return StreamOptions(r.stream)
    return StreamOptions(r.stream, o.include_usage, o.continuous_usage_stats)


# -- /v1/completions ------------------------------------------------------------

def parse_completion(body: Any, limits: ApiLimits) -> CompletionRequest:
    """Validate a /v1/completions body; ApiError (400/404) names the offending parameter."""
    r = _validate(protocol.request_models(limits).completion, body)
    _check_model(r.model, limits)
    prompt = r.prompt
    if isinstance(prompt, list):
        prompt = prompt[0] if isinstance(prompt[0], (str, list)) else prompt   # a one-element batch
        prompt = prompt if isinstance(prompt, str) else tuple(prompt)
    return CompletionRequest(
        model=r.model, prompt=prompt,
        sampling=_sampling(r, body, r.logprobs, r.echo),
        stream=_stream(r),
        add_special_tokens=r.add_special_tokens,
        echo=r.echo,
    )


# -- /v1/chat/completions -----------------------------------------------------

def parse_chat(body: Any, limits: ApiLimits) -> ChatRequest:
    """Validate a /v1/chat/completions body; ApiError (400/404) names the offending parameter."""
    r = _validate(protocol.request_models(limits).chat, body)
    _check_model(r.model, limits)
    try:
        tools = tool_calls.parse(body.get("tools"), body.get("tool_choice"), r.parallel_tool_calls)
    except structured.ConstraintError as e:
        raise bad_request(str(e), e.param) from None
    sampling = _sampling(r, body, (r.top_logprobs or 0) if r.logprobs else None)
    if tools is not None and tools.constraint is not None:
        if sampling.constraint is not None:
            raise bad_request("a forced tool choice cannot be combined with another structured-output constraint",
                              "tool_choice")
        if sampling.n > 1 or sampling.best_of > 1:
            raise bad_request("tool calls are served with n = 1", "n")
        sampling = dataclasses.replace(sampling, constraint=tools.constraint)
    elif tools is not None and tools.choice == "auto" and (sampling.n > 1 or sampling.best_of > 1):
        raise bad_request("tool calls are served with n = 1", "n")
    return ChatRequest(
        model=r.model,
        messages=tuple(_message(m) for m in r.messages),
        sampling=sampling,
        stream=_stream(r),
        add_generation_prompt=r.add_generation_prompt and not r.continue_final_message,
        continue_final_message=r.continue_final_message,
        add_special_tokens=r.add_special_tokens,
        chat_template_kwargs=tuple(sorted((r.chat_template_kwargs or {}).items())),
        tools=tools,
        echo=r.echo,
        reply_role=r.reply_role,
    )


def _message(m: protocol.ChatCompletionMessageParam) -> ChatMessage:
    if m.tool_calls is None and m.content.__class__ is str:
        return ChatMessage(m.role, m.content, (), m.tool_call_id)
    calls = tuple({"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                  for c in m.tool_calls or ())
    return ChatMessage(m.role, m.text(), tool_calls=calls, tool_call_id=m.tool_call_id)


def echo_prefix(req: ChatRequest) -> str:
    """What a chat reply opens with under echo (vLLM): the last message's content when its role is
    the reply's, else nothing."""
    if not req.echo or req.messages[-1].role != req.reply_role:
        return ""
    return req.messages[-1].content


# -- limits that need the tokenized prompt --------------------------------------

def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int,
                       default: int | None, param: str = "max_tokens") -> int:
    """The output budget, or a 400 when the prompt or prompt + max_tokens exceed the context."""
    if prompt_len >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your "
                          f"prompt has {prompt_len} tokens, which leaves no room for output.", "prompt")
    room = max_model_len - prompt_len
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise bad_request(f"'{param}' is too large: {requested}. This model's maximum context length is "
                          f"{max_model_len} tokens and your request has {prompt_len} input tokens "
                          f"({requested} > {max_model_len} - {prompt_len}).", param)
    return requested


# -- replies --------------------------------------------------------------------

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def request_id(prefix: str, header_value: str | None = None) -> str:
    """`cmpl-<hex>` / `chatcmpl-<hex>`; an X-Request-Id header's value when it is sane."""
    if header_value and _REQUEST_ID.match(header_value):
        return f"{prefix}-{header_value}"
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None = None,
                     stop_reason: int | str | None = None, usage_: dict | None = None,
                     logprobs: dict | None = None, index: int = 0) -> dict:
    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
             "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                          "stop_reason": stop_reason}]}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason: str | None = None,
               stop_reason: int | str | None = None, usage_: dict | None = None,
               logprobs: dict | None = None, index: int = 0) -> dict:
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                          "stop_reason": stop_reason}]}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def usage_chunk(obj: str, rid: str, created: int, model: str, usage_: dict) -> dict:
    """The final usage-only chunk (choices: []) sent when stream_options.include_usage is set."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_}


@dataclasses.dataclass(frozen=True)
class Choice:
    """One finished choice of a reply."""
    text: str
    finish_reason: str
    stop_reason: int | str | None = None
    logprobs: dict | None = None


def completion_body(rid: str, created: int, model: str, text: str, finish_reason: str,
                    stop_reason: int | str | None, usage_: dict, logprobs: dict | None = None,
                    prompt_logprobs: list | None = None) -> dict:
    return completion_body_n(rid, created, model, [Choice(text, finish_reason, stop_reason, logprobs)], usage_,
                             prompt_logprobs)


def completion_body_n(rid: str, created: int, model: str, choices: list[Choice], usage_: dict,
                      prompt_logprobs: list | None = None) -> dict:
    out = []
    for i, c in enumerate(choices):
        choice = {"index": i, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs     # vLLM's extension, on the choice
        out.append(choice)
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": out, "usage": usage_}


def chat_body(rid: str, created: int, model: str, text: str, finish_reason: str,
              stop_reason: int | str | None, usage_: dict, logprobs: dict | None = None,
              prompt_logprobs: list | None = None, role: str = "assistant") -> dict:
    return chat_body_n(rid, created, model, [Choice(text, finish_reason, stop_reason, logprobs)], usage_,
                       prompt_logprobs, role)


def chat_body_n(rid: str, created: int, model: str, choices: list[Choice], usage_: dict,
                prompt_logprobs: list | None = None, role: str = "assistant") -> dict:
    body = {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": i, "message": {"role": role, "content": c.text},
                         "logprobs": c.logprobs, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                        for i, c in enumerate(choices)],
            "usage": usage_}
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs       # vLLM's extension, on the response
    return body


def models_body(model: str, max_model_len: int | None, created: int | None = None) -> dict:
    created = int(time.time()) if created is None else created
    card = {"id": model, "object": "model", "created": created, "owned_by": "blink", "root": model,
            "parent": None}
    if max_model_len:
        card["max_model_len"] = max_model_len
    return {"object": "list", "data": [card]}


_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
loads = json.loads


def dumps(obj: Any) -> str:
    """Compact JSON, UTF-8 text kept as is (what the chunks and bodies are written with)."""
    return _dumps(obj)


def sse(obj: dict) -> bytes:
    """One server-sent event: `data: {json}\\n\\n`."""
    return b"data: " + _dumps(obj).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class DeltaEncoder:
    """The hot path of streaming: a mid-stream text delta as SSE bytes, byte for byte what
    sse(completion_chunk(...)) / sse(chat_chunk(..., {"content": text})) give, with only the text
    JSON-encoded per event (the rest of the chunk is encoded once per request)."""

    def __init__(self, chat: bool, rid: str, created: int, model: str):
        marker = "\ue000blink-delta\ue000"   # private-use characters: in no id or model name
        if chat:
            template = sse(chat_chunk(rid, created, model, {"content": marker}))
        else:
            template = sse(completion_chunk(rid, created, model, marker))
        head, tail = template.split(_dumps(marker).encode(), 1)
        self._head = head
        self._tail = tail
        self._timed_tail = tail[:-3]   # without the closing "}\n\n"

    def encode(self, text: str) -> bytes:
        return self._head + _dumps(text).encode() + self._tail

    def encode_timed(self, text: str, t_last_ns: int, t_frontend_ns: int, n_tokens: int) -> bytes:
        """With the benchmark-only blink_timing field appended (see FrontendConfig.expose_backend_timing)."""
        return (self._head + _dumps(text).encode() + self._timed_tail
                + b',"blink_timing":{"t_last_ns":%d,"t_frontend_ns":%d,"n_tokens":%d}}\n\n'
                % (t_last_ns, t_frontend_ns, n_tokens))
