"""The OpenAI wire format as vLLM serves it: request validation and response bodies. No I/O.

    JSON body -> parse_completion / parse_chat -> CompletionRequest | ChatRequest
                 (every key read or rejected; ApiError names the parameter)
    tokens/text -> completion_chunk / chat_chunk / usage_chunk -> sse() bytes
                -> completion_body / chat_body for non-streaming replies

The sampling surface (penalties, logit_bias, min_p, min_tokens, allowed ids, bad
words, logprobs, prompt_logprobs, echo, structured outputs: structured/request.py)
is read with vLLM's names, ranges and defaults; the daemon applies it (it travels in
the slot). Parameters we cannot honour (beam search, audio, ...) are rejected with a 400 that
names them, never ignored; their no-op values (tools=[], use_beam_search=false,
...) are accepted so stock clients work.
Keys nobody knows are rejected the way OpenAI does ("Unrecognized request
argument"). `null` means "not given" for every optional parameter.
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

from .structured import request as structured
from .structured import tools as tool_calls
from .structured.request import Constraint

MAX_SEED = (1 << 64) - 1
MIN_SEED = -(1 << 63)
MAX_I32 = (1 << 31) - 1
COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's (and vLLM's) default for /v1/completions
MAX_LOGPROBS = 20                     # logprobs / top_logprobs / prompt_logprobs at most (vLLM's max_logprobs)
MAX_LOGIT_BIAS = 1024                 # logit_bias entries at most
MAX_BAD_WORDS = 64
MAX_CHOICES = 64                      # n and best_of at most


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


@dataclasses.dataclass(frozen=True)
class ApiLimits:
    """What validation needs to know about the served model."""
    served_model: str
    vocab_size: int
    max_stop_strings: int = 32


# -- field readers --------------------------------------------------------------

def _same(value: Any, allowed: Any) -> bool:
    """Equality that does not let True pass for 1 or 0.0 for False."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return type(value) is type(allowed) and value == allowed
    return value == allowed


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# Parameters we understand but cannot honour: name -> (no-op values accepted, what is unsupported).
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1, 1.0), "length_penalty is not supported"),
    "truncate_prompt_tokens": ((), "truncate_prompt_tokens is not supported"),
    "priority": ((0,), "request priorities are not supported"),
    "spaces_between_special_tokens": ((True,), "spaces_between_special_tokens=false is not supported"),
    "return_tokens_as_token_ids": ((False,), "return_tokens_as_token_ids is not supported"),
    "return_token_ids": ((False,), "return_token_ids is not supported"),
    "store": ((False,), "store=true is not supported"),
    "detokenize": ((True,), "detokenize=false is not supported"),
}
_UNSUPPORTED_COMPLETION = {
    "suffix": (("",), "suffix is not supported"),
}
_UNSUPPORTED_CHAT = {
    "echo": ((False,), "echo is not supported on chat completions"),
    "functions": (([],), "functions are not supported"),
    "function_call": (("none",), "function_call is not supported"),
    "audio": ((), "audio output is not supported"),
    "modalities": ((["text"],), "only the text modality is supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "reasoning_effort": ((), "reasoning_effort is not supported"),
    "web_search_options": ((), "web search is not supported"),
}
# Accepted and deliberately without effect: they describe the caller, not the generation.
_IGNORED = ("user", "metadata", "service_tier", "request_id", "parallel_tool_calls")   # the last: read on chat


class _Fields:
    """Reads a JSON object key by key; `finish()` rejects whatever nobody read."""

    def __init__(self, body: Any):
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        self.body = body
        self.seen: set[str] = set()

    def get(self, name: str) -> Any:
        self.seen.add(name)
        return self.body.get(name)

    def int(self, name: str, lo: int, hi: int, default: int | None = None) -> int | None:
        v = self.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad_request(f"'{name}' must be an integer, got {_show(v)}", name)
        if not lo <= v <= hi:
            raise bad_request(f"'{name}' must be in [{lo}, {hi}], got {v}", name)
        return v

    def float(self, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
        v = self.get(name)
        if v is None:
            return default
        if not _is_number(v) or not math.isfinite(v):
            raise bad_request(f"'{name}' must be a finite number, got {_show(v)}", name)
        if v < lo or v > hi or (lo_open and v == lo):
            interval = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
            raise bad_request(f"'{name}' must be in {interval}, got {v}", name)
        return float(v)

    def bool(self, name: str, default: bool) -> bool:
        v = self.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise bad_request(f"'{name}' must be a boolean, got {_show(v)}", name)
        return v

    def unsupported(self, table: dict[str, tuple[tuple[Any, ...], str]]) -> None:
        if self.body.keys().isdisjoint(table):
            return   # the common case: none of them sent (the names not sent need no marking as read)
        for name, (allowed, why) in table.items():
            if name not in self.body:
                continue
            v = self.get(name)
            if v is not None and not any(_same(v, a) for a in allowed):
                raise bad_request(f"unsupported parameter '{name}' = {_show(v)}: {why}", name)

    def finish(self) -> None:
        for name in _IGNORED:
            self.seen.add(name)
        unknown = [k for k in self.body if k not in self.seen]
        if unknown:
            raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])


def _show(v: Any) -> str:
    """A short quote of a client's value for an error message (never fails: any depth, any number)."""
    try:
        s = json.dumps(v, ensure_ascii=True) if not isinstance(v, (bytes, bytearray)) else repr(v)
    except (ValueError, RecursionError):   # too deep, or an int beyond the digit limit
        s = f"a {type(v).__name__} that cannot be shown"
    return s if len(s) <= 60 else s[:57] + "..."


def _model(f: _Fields, limits: ApiLimits) -> str | None:
    model = f.get("model")
    if model is None:
        return None
    if not isinstance(model, str):
        raise bad_request(f"'model' must be a string, got {_show(model)}", "model")
    if model != limits.served_model:
        shown = model if len(model) <= 100 else model[:97] + "..."
        shown = shown.encode("utf-8", "backslashreplace").decode("utf-8")   # lone surrogates stay printable
        raise ApiError(404, f"The model `{shown}` does not exist.", "model")
    return model


def _stop_strings(f: _Fields, limits: ApiLimits) -> tuple[str, ...]:
    v = f.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request(f"'stop' must be a string or a list of strings, got {_show(v)}", "stop")
    if any(s == "" for s in items):
        raise bad_request("'stop' strings must not be empty", "stop")
    if len(items) > limits.max_stop_strings:
        raise bad_request(f"'stop' has {len(items)} strings, at most {limits.max_stop_strings} are allowed",
                          "stop")
    return tuple(dict.fromkeys(items))


def _token_ids(v: Any, name: str, limits: ApiLimits, allow_empty: bool) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise bad_request(f"'{name}' must be a list of integer token ids", name)
    if not v and not allow_empty:
        raise bad_request(f"'{name}' must not be empty", name)
    for t in v:
        if not 0 <= t < limits.vocab_size:
            raise bad_request(f"'{name}' holds token id {t}, outside the vocabulary [0, {limits.vocab_size})",
                              name)
    return tuple(v)


# The sampling surface beyond the basics: read only when the request sends one of them (the
# common request sends none, and then costs one set test here).
_SURFACE = frozenset(("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
                      "logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs", "n", "best_of"))


def _sampling(f: _Fields, limits: ApiLimits, max_tokens: int | None, logprobs: int | None,
              echo: bool = False) -> SamplingOptions:
    top_k = f.int("top_k", -1, MAX_I32, 0)
    stop_ids = f.get("stop_token_ids")
    more = {} if f.body.keys().isdisjoint(_SURFACE) else _surface(f, limits, max_tokens)
    if not f.body.keys().isdisjoint(structured.KEYS):
        more["constraint"] = _constraint(f)
    if echo and logprobs is not None and more.get("prompt_logprobs") is None:
        more["prompt_logprobs"] = logprobs   # echo + logprobs: the prompt's tokens come with theirs (vLLM)
    return SamplingOptions(
        logprobs=logprobs,
        max_tokens=max_tokens,
        temperature=f.float("temperature", 1.0, 0.0, 1e4),
        top_p=f.float("top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=0 if top_k == -1 else top_k,
        seed=f.int("seed", MIN_SEED, MAX_SEED),
        ignore_eos=f.bool("ignore_eos", False),
        stop=_stop_strings(f, limits),
        stop_token_ids=() if stop_ids is None else tuple(dict.fromkeys(
            _token_ids(stop_ids, "stop_token_ids", limits, allow_empty=True))),
        include_stop_str_in_output=f.bool("include_stop_str_in_output", False),
        skip_special_tokens=f.bool("skip_special_tokens", True),
        **more,
    )


def _surface(f: _Fields, limits: ApiLimits, max_tokens: int | None) -> dict[str, Any]:
    """The _SURFACE parameters as SamplingOptions fields."""
    allowed = f.get("allowed_token_ids")
    min_tokens = f.int("min_tokens", 0, MAX_I32, 0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({min_tokens}) must not exceed 'max_tokens' ({max_tokens})", "min_tokens")
    n = f.int("n", 1, MAX_CHOICES, 1)
    best_of = f.int("best_of", 1, MAX_CHOICES, n)
    if best_of < n:
        raise bad_request(f"'best_of' ({best_of}) must be at least 'n' ({n})", "best_of")
    if best_of > n and f.body.get("stream") is True:
        raise bad_request("'best_of' greater than 'n' cannot be streamed (the best choices are known at the end)",
                          "best_of")
    return dict(
        presence_penalty=f.float("presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=f.float("frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=f.float("repetition_penalty", 1.0, 0.0, 2.0, lo_open=True),
        min_p=f.float("min_p", 0.0, 0.0, 1.0),
        min_tokens=min_tokens,
        logit_bias=_logit_bias(f.get("logit_bias"), limits),
        allowed_token_ids=() if allowed is None else tuple(dict.fromkeys(
            _token_ids(allowed, "allowed_token_ids", limits, allow_empty=False))),
        bad_words=_bad_words(f.get("bad_words")),
        prompt_logprobs=f.int("prompt_logprobs", 0, MAX_LOGPROBS),
        n=n,
        best_of=best_of,
    )


def _constraint(f: _Fields) -> Constraint | None:
    """The structured-output constraint (compiled later, by the service: it needs the vocabulary)."""
    for name in structured.KEYS:
        f.get(name)
    try:
        return structured.parse(f.body)
    except structured.ConstraintError as e:
        raise bad_request(str(e), e.param) from None


def _logit_bias(v: Any, limits: ApiLimits) -> tuple[tuple[int, float], ...]:
    """{"token id": bias} -> ((id, bias), ...); ids in the vocabulary, biases in [-100, 100]."""
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise bad_request(f"'logit_bias' must be an object mapping token ids to biases, got {_show(v)}", "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' has {len(v)} entries, at most {MAX_LOGIT_BIAS} are allowed", "logit_bias")
    out = {}
    for key, bias in v.items():
        try:
            tid = int(key)
        except ValueError:
            raise bad_request(f"'logit_bias' key {_show(key)} is not a token id", "logit_bias") from None
        if not 0 <= tid < limits.vocab_size:
            raise bad_request(f"'logit_bias' key {tid} is outside the vocabulary [0, {limits.vocab_size})",
                              "logit_bias")
        if not _is_number(bias) or not math.isfinite(bias) or not -100 <= bias <= 100:
            raise bad_request(f"'logit_bias' value for token {tid} must be a number in [-100, 100], got "
                              f"{_show(bias)}", "logit_bias")
        out[tid] = float(bias)
    return tuple(out.items())


def _bad_words(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(w, str) and w.strip() for w in items):
        raise bad_request("'bad_words' must be a list of non-empty strings", "bad_words")
    if len(items) > MAX_BAD_WORDS:
        raise bad_request(f"'bad_words' has {len(items)} words, at most {MAX_BAD_WORDS} are allowed", "bad_words")
    return tuple(dict.fromkeys(items))


def _stream(f: _Fields) -> StreamOptions:
    stream = f.bool("stream", False)
    opts = f.get("stream_options")
    if opts is None:
        return StreamOptions(stream)
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(opts, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    o = _Fields(opts)
    include_usage = o.bool("include_usage", False)
    continuous = o.bool("continuous_usage_stats", False)
    unknown = [k for k in opts if k not in o.seen]
    if unknown:
        raise bad_request(f"unknown stream option '{unknown[0]}'", f"stream_options.{unknown[0]}")
    return StreamOptions(stream, include_usage, continuous)


# -- /v1/completions ------------------------------------------------------------

def parse_completion(body: Any, limits: ApiLimits) -> CompletionRequest:
    """Validate a /v1/completions body; ApiError (400/404) names the offending parameter."""
    f = _Fields(body)
    model = _model(f, limits)
    f.unsupported(_UNSUPPORTED)
    f.unsupported(_UNSUPPORTED_COMPLETION)
    prompt = _prompt(f.get("prompt"), limits)
    echo = f.bool("echo", False)
    max_tokens = f.int("max_tokens", 0, MAX_I32)
    mct = f.int("max_completion_tokens", 0, MAX_I32)
    mt = mct if mct is not None else max_tokens
    if mt == 0 and not echo:
        name = "max_completion_tokens" if mct is not None else "max_tokens"
        raise bad_request(f"'{name}' must be at least 1 (0 only with echo, which returns the prompt alone)", name)
    req = CompletionRequest(
        model=model, prompt=prompt,
        sampling=_sampling(f, limits, mt, f.int("logprobs", 0, MAX_LOGPROBS), echo),
        stream=_stream(f),
        add_special_tokens=f.bool("add_special_tokens", True),
        echo=echo,
    )
    f.finish()
    return req


def _prompt(v: Any, limits: ApiLimits) -> str | tuple[int, ...]:
    if v is None:
        raise bad_request("'prompt' is required", "prompt")
    if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
        if len(v) > 1:
            raise bad_request(f"'prompt' holds {len(v)} prompts; batched prompts are not supported, "
                              "send one prompt per request", "prompt")
        v = v[0]
    if isinstance(v, str):
        if not v:
            raise bad_request("'prompt' must not be empty", "prompt")
        return v
    if isinstance(v, list):
        return _token_ids(v, "prompt", limits, allow_empty=False)
    raise bad_request("'prompt' must be a string, a list of token ids, or a one-element list of either",
                      "prompt")


# -- /v1/chat/completions -----------------------------------------------------

_ROLES = ("system", "developer", "user", "assistant")
# Names the template renderer takes itself: a kwarg of the same name would collide with them.
_RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "continue_final_message", "self")


def parse_chat(body: Any, limits: ApiLimits) -> ChatRequest:
    """Validate a /v1/chat/completions body; ApiError (400/404) names the offending parameter."""
    f = _Fields(body)
    model = _model(f, limits)
    f.unsupported(_UNSUPPORTED)
    f.unsupported(_UNSUPPORTED_CHAT)
    messages = _messages(f.get("messages"))
    max_tokens = f.int("max_tokens", 1, MAX_I32)
    mct = f.int("max_completion_tokens", 1, MAX_I32)
    want_logprobs = f.bool("logprobs", False)
    top_logprobs = f.int("top_logprobs", 0, MAX_LOGPROBS)
    if top_logprobs and not want_logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    kwargs = f.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    for key in _RESERVED_TEMPLATE_KWARGS:
        if kwargs and key in kwargs:
            raise bad_request(f"'chat_template_kwargs' may not set '{key}' (it has its own parameter)",
                              f"chat_template_kwargs.{key}")
    add_generation_prompt = f.bool("add_generation_prompt", True)
    continue_final = f.bool("continue_final_message", False)
    if continue_final and add_generation_prompt and body.get("add_generation_prompt") is True:
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                          "continue_final_message")
    if continue_final and messages[-1].role != "assistant":
        raise bad_request("'continue_final_message' needs a final assistant message", "continue_final_message")
    try:
        tools = tool_calls.parse(f.get("tools"), f.get("tool_choice"), f.get("parallel_tool_calls"))
    except structured.ConstraintError as e:
        raise bad_request(str(e), e.param) from None
    # max_completion_tokens is the current name; max_tokens the deprecated one.
    sampling = _sampling(f, limits, mct if mct is not None else max_tokens,
                         (top_logprobs or 0) if want_logprobs else None)
    if tools is not None and tools.constraint is not None:
        if sampling.constraint is not None:
            raise bad_request("a forced tool choice cannot be combined with another structured-output constraint",
                              "tool_choice")
        if sampling.n > 1 or sampling.best_of > 1:
            raise bad_request("tool calls are served with n = 1", "n")
        sampling = dataclasses.replace(sampling, constraint=tools.constraint)
    elif tools is not None and tools.choice == "auto" and (sampling.n > 1 or sampling.best_of > 1):
        raise bad_request("tool calls are served with n = 1", "n")
    req = ChatRequest(
        model=model, messages=messages,
        sampling=sampling,
        stream=_stream(f),
        add_generation_prompt=add_generation_prompt and not continue_final,
        continue_final_message=continue_final,
        add_special_tokens=f.bool("add_special_tokens", False),
        chat_template_kwargs=tuple(sorted((kwargs or {}).items())),
        tools=tools,
    )
    f.finish()
    return req


def _messages(v: Any) -> tuple[ChatMessage, ...]:
    if v is None:
        raise bad_request("'messages' is required", "messages")
    if not isinstance(v, list):
        raise bad_request("'messages' must be a list of message objects", "messages")
    if not v:
        raise bad_request("'messages' must not be empty", "messages")
    return tuple(_message(m, f"messages[{i}]") for i, m in enumerate(v))


def _message(m: Any, where: str) -> ChatMessage:
    if not isinstance(m, dict):
        raise bad_request(f"'{where}' must be an object", where)
    role = m.get("role")
    if role == "function":
        raise bad_request(f"'{where}.role' = 'function': the legacy function role is not supported; use 'tool'",
                          f"{where}.role")
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad_request(f"'{where}.tool_call_id' is required (a string) in a tool message",
                              f"{where}.tool_call_id")
        extra = [k for k in m if k not in ("role", "content", "tool_call_id", "name")]
        if extra:
            raise bad_request(f"unsupported message field '{where}.{extra[0]}'", f"{where}.{extra[0]}")
        return ChatMessage(role, _content(m.get("content"), f"{where}.content"), tool_call_id=call_id)
    if role == "assistant" and m.get("tool_calls"):
        calls = _assistant_calls(m["tool_calls"], f"{where}.tool_calls")
        content = m.get("content")
        rest = {k: v for k, v in m.items() if k != "tool_calls"}
        if content is None:
            rest["content"] = ""
        return dataclasses.replace(_message(rest, where), tool_calls=calls)
    if role not in _ROLES:
        raise bad_request(f"'{where}.role' must be one of {', '.join(_ROLES)}, got {_show(role)}",
                          f"{where}.role")
    for key, value in m.items():
        if key in ("role", "content", "name"):
            continue
        if key in ("tool_calls", "function_call", "audio", "refusal", "reasoning_content") and not value:
            continue
        raise bad_request(f"unsupported message field '{where}.{key}'", f"{where}.{key}")
    name = m.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request(f"'{where}.name' must be a string", f"{where}.name")
    return ChatMessage(role, _content(m.get("content"), f"{where}.content"))


def _assistant_calls(v: Any, where: str) -> tuple[dict, ...]:
    if not isinstance(v, list):
        raise bad_request(f"'{where}' must be a list of tool calls", where)
    out = []
    for i, c in enumerate(v):
        w = f"{where}[{i}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise bad_request(f"'{w}' must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                              f"\"arguments\"}}}} with string name and arguments", w)
        out.append({"id": str(c.get("id", "")), "name": fn["name"], "arguments": fn["arguments"]})
    return tuple(out)


def _content(c: Any, where: str) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        texts = []
        for j, part in enumerate(c):
            w = f"{where}[{j}]"
            if not isinstance(part, dict):
                raise bad_request(f"'{w}' must be an object", w)
            kind = part.get("type")
            if kind != "text":
                raise bad_request(f"'{w}.type' = {_show(kind)}: only text content parts are supported",
                                  f"{w}.type")
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"'{w}.text' must be a string", f"{w}.text")
            extra = [k for k in part if k not in ("type", "text")]
            if extra:
                raise bad_request(f"unsupported content part field '{w}.{extra[0]}'", f"{w}.{extra[0]}")
            texts.append(text)
        return "\n".join(texts)  # vLLM joins text parts with newlines for string templates
    if c is None:
        raise bad_request(f"'{where}' is required", where)
    raise bad_request(f"'{where}' must be a string or a list of text parts", where)


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
              prompt_logprobs: list | None = None) -> dict:
    return chat_body_n(rid, created, model, [Choice(text, finish_reason, stop_reason, logprobs)], usage_,
                       prompt_logprobs)


def chat_body_n(rid: str, created: int, model: str, choices: list[Choice], usage_: dict,
                prompt_logprobs: list | None = None) -> dict:
    body = {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
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
