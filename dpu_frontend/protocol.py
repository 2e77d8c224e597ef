"""The served OpenAI API declared once, as pydantic models with vLLM's names, ranges and defaults.

    request JSON (a dict) -> request_models(limits).completion / .chat .model_validate(body)
        -> CompletionRequest / ChatCompletionRequest (validated; `null` = not given, the
           default applies) | pydantic.ValidationError -> api_error() -> ApiError 400 naming
           the parameter ("messages[0].content[0].type")
    the same models -> json_schema() -> /openapi.json (openapi.py) and schemathesis' fuzzing
    response models (CompletionResponse, ChatCompletionResponse, the stream chunks,
        ErrorResponse) -> the document's response schemas; the replies themselves are built
        by openai_api.py's dict builders (the hot path), and a test holds the two together

What the models cannot say in a type (min_tokens <= max_tokens, best_of >= n, a final
assistant message for continue_final_message, ...) sits in a model validator beside the
fields it relates. Bounds that depend on the served model (vocabulary size, stop strings,
the server's max_tokens) are fields of `ApiLimits`; `request_models` makes the subclasses
that carry them, once per distinct limits.

Parameters we understand but cannot honour are declared with `NoOp`: their neutral values
pass (stock clients send them), anything else is a 400 that says why. Keys nobody declares
are rejected, as OpenAI does. To add a request field, declare it on the request model (or
on `SamplingRequest` for both endpoints) and read it in openai_api's conversion.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator
from pydantic_core import PydanticCustomError, core_schema

MAX_SEED = (1 << 64) - 1
MIN_SEED = -(1 << 63)
MAX_I32 = (1 << 31) - 1
MAX_LOGPROBS = 20          # logprobs / top_logprobs / prompt_logprobs at most (vLLM's max_logprobs)
MAX_LOGIT_BIAS = 1024      # logit_bias entries at most
MAX_BAD_WORDS = 64
MAX_CHOICES = 64           # n and best_of at most
MAX_TOOLS = 128


@dataclasses.dataclass(frozen=True)
class ApiLimits:
    """What validation needs to know about the served model and the server's settings."""
    served_model: str
    vocab_size: int
    max_stop_strings: int = 32
    max_tokens: int = MAX_I32          # the largest max_tokens the server accepts


# -- errors ---------------------------------------------------------------------------

def invalid(message: str, at: str | None = None) -> PydanticCustomError:
    """A validation error raised by our own checks: `message` as is; `at` a path below where
    the check runs ("tool_call_id" inside messages[2]), for the error's `param`."""
    return PydanticCustomError("blink_invalid", "{message}", {"message": message, "at": at})


def show(v: Any) -> str:
    """A short quote of a client's value for an error message (never fails: any depth, any number)."""
    try:
        s = json.dumps(v, ensure_ascii=True) if not isinstance(v, (bytes, bytearray)) else repr(v)
    except (ValueError, RecursionError, TypeError):   # too deep, an int beyond the digit limit, ...
        s = f"a {type(v).__name__} that cannot be shown"
    return s if len(s) <= 60 else s[:57] + "..."


def param_of(loc: tuple, at: str | None = None) -> str:
    """('messages', 0, 'content', 'list[TextContentPart]', 1, 'type') -> messages[0].content[1].type
    (the labels pydantic gives the members of a union are left out)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _is_union_label(part):
            continue
        else:
            out += f".{part}" if out else part
    if at:
        out = f"{out}.{at}" if out else at
    return out


def _is_union_label(part: str) -> bool:
    """pydantic names a union member in `loc` by its type: 'str', 'list[TextContentPart]', a model's class."""
    if part in ("str", "int", "float", "bool", "none", "dict", "list") or part[:1].isupper():
        return True
    return not part.isidentifier() and not part.isdigit()


_RANGE_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


@functools.lru_cache(maxsize=64)
def _ranges(model: type[BaseModel]) -> dict[str, str]:
    """Top-level numeric parameters -> their interval as the document states it ("[1, 64]", "(0.0, 1.0]")."""
    out = {}
    for name, prop in model.model_json_schema()["properties"].items():
        for s in prop.get("anyOf", [prop]):
            lo = s.get("minimum", s.get("exclusiveMinimum"))
            hi = s.get("maximum", s.get("exclusiveMaximum"))
            if lo is not None and hi is not None:
                out[name] = (f"{'(' if 'exclusiveMinimum' in s else '['}{lo}, {hi}"
                             f"{')' if 'exclusiveMaximum' in s else ']'}")
    return out


def describe(e: ValidationError, model: type[BaseModel] | None = None) -> tuple[str, str]:
    """(message, param) of the error to report: the first parameter that failed; inside a union,
    the member that got furthest (the one the client meant)."""
    errors = e.errors(include_url=False, include_input=True)
    first = errors[0]["loc"][:1]
    best = max((x for x in errors if x["loc"][:1] == first), key=lambda x: len(x["loc"]))
    ctx = best.get("ctx") or {}
    param = param_of(best["loc"], ctx.get("at") if best["type"] == "blink_invalid" else None)
    param = param.encode("utf-8", "backslashreplace").decode("utf-8")   # a key with a lone surrogate stays sendable
    if best["type"] == "blink_invalid":
        return best["msg"], param
    if best["type"] == "extra_forbidden":
        if len(best["loc"]) == 1:
            return f"Unrecognized request argument supplied: {param}", param
        return f"unsupported field '{param}'", param
    if best["type"] == "missing":
        return f"'{param}' is required", param
    if best["loc"][:1] == ("logit_bias",) and len(best["loc"]) == 2:     # its keys are token ids, not parameters
        return (f"'logit_bias' value for token {show(best['loc'][1])} must be a number in [-100, 100], got "
                f"{show(best.get('input'))}", "logit_bias")
    if best["type"] in _RANGE_ERRORS and model is not None and param in _ranges(model):
        return f"'{param}' must be in {_ranges(model)[param]}, got {show(best.get('input'))}", param
    got = "" if best["type"].endswith("missing") else f", got {show(best.get('input'))}"
    return f"'{param}': {best['msg'][0].lower()}{best['msg'][1:]}{got}", param


# -- annotations ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)    # eq=False: hashed by identity (its values may be lists)
class NoOp:
    """A parameter we cannot honour: only `values` (and null) pass; anything else is a 400 saying `why`."""
    values: tuple
    why: str

    def __get_pydantic_core_schema__(self, source, handler):
        return core_schema.with_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema, handler):
        shown = " or ".join(json.dumps(v) for v in (*self.values, None))
        return {"enum": [*self.values, None], "description": f"accepted only as {shown}: {self.why}"}

    def _check(self, v, info):
        if v is not None and not any(_same(v, a) for a in self.values):
            raise invalid(f"unsupported parameter '{info.field_name}' = {show(v)}: {self.why}")
        return v


def _same(value: Any, allowed: Any) -> bool:
    """Equality that does not let True pass for 1 or 0.0 for False."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return type(value) is type(allowed) and value == allowed
    return value == allowed


@dataclasses.dataclass(frozen=True)
class OneError:
    """Any failure inside the annotated value is reported at the value itself, as `message`
    (a union whose members' errors would not help the client: the prompt's forms)."""
    message: str

    def __get_pydantic_core_schema__(self, source, handler):
        return core_schema.with_info_wrap_validator_function(self._wrap, handler(source))

    def _wrap(self, v, handler, info):
        try:
            return handler(v)
        except ValidationError:
            raise invalid(f"'{info.field_name}' {self.message}, got {show(v)}") from None


class OpenAIBaseModel(BaseModel):
    """Strict JSON types (no "10" for 10, no true for 1), unknown keys rejected, null = not given."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        if isinstance(data, dict) and None in data.values():
            known = _keys(cls)
            return {k: v for k, v in data.items() if v is not None or k not in known}   # unknown keys stay: refused
        return data


@functools.lru_cache(maxsize=None)
def _keys(model: type[BaseModel]) -> frozenset[str]:
    """The keys a model declares (field names and their aliases)."""
    return frozenset(n for name, f in model.model_fields.items() for n in (name, f.alias) if n)


Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TokenId = Annotated[int, Field(ge=0)]
NonEmpty = Annotated[str, Field(min_length=1)]
LogprobCount = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Ignored = Annotated[Any, Field(description="accepted and ignored")]
LogitBias = Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                      Field(max_length=MAX_LOGIT_BIAS, json_schema_extra={"propertyNames": {"pattern": "^[0-9]+$"}},
                            description="token id (in the vocabulary) -> bias added to its logit, in [-100, 100]")]


# -- request parts ----------------------------------------------------------------------

class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False                  # a usage-only chunk before [DONE]
    continuous_usage_stats: bool = False         # usage on every chunk (vLLM)


class JsonSchemaResponseFormat(OpenAIBaseModel):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


JsonSchemaSource = Annotated[str | dict[str, Any], OneError("must be a JSON schema (an object, or its JSON text)")]


class StructuredOutputsParams(OpenAIBaseModel):
    """vLLM's structured_outputs: one of json, regex, choice, grammar, json_object."""
    json_: JsonSchemaSource | None = Field(None, alias="json")
    regex: NonEmpty | None = None
    choice: list[NonEmpty] | None = None
    grammar: NonEmpty | None = Field(None, description="not supported: a grammar gets a 400")
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    @model_validator(mode="before")
    @classmethod
    def _shape(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("type") != "function" or not isinstance(data.get("function"), dict):
            raise invalid("a tool must be {\"type\": \"function\", \"function\": {\"name\", \"description\", "
                          "\"parameters\"}}")
        return data


class FunctionName(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Annotated[Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam,
                       OneError("must be none, auto, required or {\"type\": \"function\", \"function\": "
                                "{\"name\": ...}}")]


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str
    arguments: str                                  # JSON text


class ToolCallParam(BaseModel):
    """An assistant's earlier call, sent back in the conversation."""
    model_config = ConfigDict(strict=True)
    id: str = ""
    type: str = "function"
    function: FunctionCall


_MESSAGE_FIELDS = ("role", "content", "name")
_PLAIN_KEYS = frozenset(("role", "content", "name"))
_PLAIN_ROLES = frozenset(("system", "developer", "user", "assistant"))
_EMPTY_OK = ("tool_calls", "function_call", "audio", "refusal", "reasoning_content")   # accepted when empty


class ChatCompletionMessageParam(OpenAIBaseModel):
    """One message of the conversation (OpenAI's roles; `tool` carries a tool result)."""
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None      # assistant only
    tool_call_id: str | None = None                    # tool only
    function_call: Annotated[Any, NoOp((), "the legacy function_call is not supported")] = None
    audio: Annotated[Any, NoOp((), "audio is not supported")] = None
    refusal: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _role_rules(cls, m: Any) -> Any:
        if not isinstance(m, dict):
            return m
        role = m.get("role")
        if not isinstance(role, str):
            return m        # the role field's own validation names the problem
        if role in _PLAIN_ROLES and m.get("content") is not None and m.keys() <= _PLAIN_KEYS:
            return m        # the common message: a role, its content, perhaps a name
        if role == "function":
            raise invalid("the legacy function role is not supported; use 'tool'", "role")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise invalid("'tool_call_id' is required (a string) in a tool message", "tool_call_id")
            extra = [k for k in m if k not in (*_MESSAGE_FIELDS, "tool_call_id")]
            if extra:
                raise invalid(f"unsupported message field '{extra[0]}' in a tool message", extra[0])
        elif role != "assistant" or not m.get("tool_calls"):
            for key, value in m.items():
                if key not in _MESSAGE_FIELDS and (key not in _EMPTY_OK or value):
                    raise invalid(f"unsupported message field '{key}'", key)
        if m.get("content") is None and not (role == "assistant" and m.get("tool_calls")):
            if isinstance(role, str):
                raise invalid("'content' is required", "content")
        return m

    def text(self) -> str:
        """The content as one string: text parts joined with newlines (as vLLM does for string templates)."""
        c = self.content
        if c is None:
            return ""
        return c if isinstance(c, str) else "\n".join(p.text for p in c)


# -- requests ---------------------------------------------------------------------------

StopStrings = Annotated[NonEmpty | list[NonEmpty], OneError("must be a non-empty string or a list of them")]


class SamplingRequest(OpenAIBaseModel):
    """What both endpoints take: sampling, stopping, streaming, structured outputs, accepted no-ops."""
    model: str | None = Field(None, description="the served model's name (another gets 404)")
    max_tokens: Annotated[int, Field(ge=1, le=MAX_I32)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_I32)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1e4)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=MAX_I32, description="0 or -1: off")] = 0
    min_p: Probability = 0.0
    seed: Annotated[int, Field(ge=MIN_SEED, le=MAX_SEED)] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] = 1.0
    logit_bias: LogitBias | None = None
    min_tokens: Annotated[int, Field(ge=0, le=MAX_I32, description="at most max_tokens")] = 0
    stop: StopStrings | None = None
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, pattern=r"\S")]],
                         Field(max_length=MAX_BAD_WORDS)] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: LogprobCount | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES, description="at least n; more than n only without stream")] \
        | None = None
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: JsonSchemaSource | None = None
    guided_regex: NonEmpty | None = None
    guided_choice: Annotated[list[NonEmpty], Field(min_length=1)] | None = None
    guided_grammar: NonEmpty | None = Field(None, description="not supported: a grammar gets a 400")
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    # scheduling (the daemon's --scheduling-policy decides what they do)
    priority: Annotated[int, Field(ge=-MAX_I32 - 1, le=MAX_I32, description="lower runs first (vLLM's meaning); "
                                   "used by --scheduling-policy priority")] = 0
    ttft_slo_ms: Annotated[int, Field(ge=1, le=MAX_I32, description="time-to-first-token target in ms (default: "
                                      "the server's --ttft-slo-ms); used by --scheduling-policy lvf")] | None = None
    tbt_slo_ms: Annotated[int, Field(ge=1, le=MAX_I32, description="time-between-tokens target in ms (default: "
                                     "the server's --tbt-slo-ms); used by --scheduling-policy lvf")] | None = None
    # accepted, without effect on the generation
    user: Ignored = None
    metadata: Ignored = None
    service_tier: Ignored = None
    request_id: Ignored = None
    # understood, not supported beyond their neutral values
    use_beam_search: Annotated[bool, NoOp((False,), "beam search is not supported")] | None = None
    length_penalty: Annotated[float, NoOp((1.0,), "length_penalty is not supported")] | None = None
    truncate_prompt_tokens: Annotated[Any, NoOp((), "truncate_prompt_tokens is not supported")] = None
    spaces_between_special_tokens: Annotated[bool, NoOp((True,), "spaces_between_special_tokens=false is not "
                                                                  "supported")] | None = None
    return_tokens_as_token_ids: Annotated[bool, NoOp((False,), "return_tokens_as_token_ids is not supported")] \
        | None = None
    return_token_ids: Annotated[bool, NoOp((False,), "return_token_ids is not supported")] | None = None
    store: Annotated[bool, NoOp((False,), "store=true is not supported")] | None = None
    detokenize: Annotated[bool, NoOp((True,), "detokenize=false is not supported")] | None = None

    @model_validator(mode="after")
    def _relations(self):
        if self.stream_options is not None and not self.stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
        max_tokens = self.requested_max_tokens
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise invalid(f"'min_tokens' ({self.min_tokens}) must not exceed 'max_tokens' ({max_tokens})",
                          "min_tokens")
        if self.best_of is not None:
            if self.best_of < self.n:
                raise invalid(f"'best_of' ({self.best_of}) must be at least 'n' ({self.n})", "best_of")
            if self.best_of > self.n and self.stream:
                raise invalid("'best_of' greater than 'n' cannot be streamed (the best choices are known at "
                              "the end)", "best_of")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens is the current name; max_tokens the deprecated one."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


Prompt = Annotated[NonEmpty | Annotated[list[TokenId], Field(min_length=1)]
                   | Annotated[list[NonEmpty | Annotated[list[TokenId], Field(min_length=1)]],
                               Field(min_length=1, max_length=1)],
                   OneError("must be a string, a list of token ids, or a one-element list of either "
                            "(batched prompts are not supported: send one prompt per request)")]


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""
    prompt: Prompt
    echo: bool = Field(False, description="the reply opens with the prompt (with its logprobs when asked)")
    logprobs: LogprobCount | None = None
    max_tokens: Annotated[int, Field(ge=0, le=MAX_I32, description="0 only with echo: the prompt alone")] | None = None
    max_completion_tokens: Annotated[int, Field(ge=0, le=MAX_I32)] | None = None
    add_special_tokens: bool = True
    suffix: Annotated[str, NoOp(("",), "suffix is not supported")] | None = None
    parallel_tool_calls: Ignored = None

    @model_validator(mode="after")
    def _echo_alone(self):
        if self.requested_max_tokens == 0 and not self.echo:
            name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
            raise invalid(f"'{name}' must be at least 1 (0 only with echo, which returns the prompt alone)", name)
        return self


_RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "continue_final_message", "self")


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""
    messages: Annotated[list[ChatCompletionMessageParam], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Annotated[LogprobCount, Field(description="needs logprobs: true")] | None = None
    echo: bool = Field(False, description="the reply's content opens with the last message's when its role is "
                                          "the reply's (vLLM)")
    tools: Annotated[list[ChatCompletionToolsParam], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False               # the template places BOS etc.
    chat_template_kwargs: dict[str, Any] | None = None
    functions: Annotated[list, NoOp(([],), "functions are not supported; use tools")] | None = None
    function_call: Annotated[Any, NoOp(("none",), "function_call is not supported; use tool_choice")] = None
    audio: Annotated[Any, NoOp((), "audio output is not supported")] = None
    modalities: Annotated[list, NoOp((["text"],), "only the text modality is supported")] | None = None
    prediction: Annotated[Any, NoOp((), "predicted outputs are not supported")] = None
    reasoning_effort: Annotated[Any, NoOp((), "reasoning_effort is not supported")] = None
    web_search_options: Annotated[Any, NoOp((), "web search is not supported")] = None

    @model_validator(mode="after")
    def _chat_relations(self):
        if self.top_logprobs and not self.logprobs:
            raise invalid("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
        for key in _RESERVED_TEMPLATE_KWARGS:
            if self.chat_template_kwargs and key in self.chat_template_kwargs:
                raise invalid(f"'chat_template_kwargs' may not set '{key}' (it has its own parameter)",
                              f"chat_template_kwargs.{key}")
        if self.continue_final_message:
            if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
                raise invalid("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                              "continue_final_message")
            if self.messages[-1].role != "assistant":
                raise invalid("'continue_final_message' needs a final assistant message", "continue_final_message")
        return self

    @property
    def reply_role(self) -> str:
        """The reply's role: the assistant's after a generation prompt, else the last message's (vLLM)."""
        return "assistant" if self.add_generation_prompt and not self.continue_final_message \
            else self.messages[-1].role


# -- the bounds of one served model --------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RequestModels:
    completion: type[CompletionRequest]
    chat: type[ChatCompletionRequest]


@functools.lru_cache(maxsize=16)
def request_models(limits: ApiLimits) -> RequestModels:
    """The request models with this server's bounds: token ids in the vocabulary, the stop-string
    count, the largest max_tokens."""
    vocab_id = Annotated[int, Field(ge=0, le=max(0, limits.vocab_size - 1))]
    ids = Annotated[list[vocab_id], Field(min_length=1)]
    stop = Annotated[NonEmpty | Annotated[list[NonEmpty], Field(max_length=limits.max_stop_strings)],
                     OneError(f"must be a non-empty string or a list of at most {limits.max_stop_strings} of them")]
    max_tokens = Annotated[int, Field(ge=1, le=limits.max_tokens)]
    bias = Annotated[LogitBias, AfterValidator(functools.partial(logit_bias_ids, limits=limits))]
    common = dict(
        logit_bias=(bias | None, None),
        stop=(stop | None, None),
        stop_token_ids=(list[vocab_id] | None, None),
        allowed_token_ids=(ids | None, None),
        max_tokens=(max_tokens | None, None),
        max_completion_tokens=(max_tokens | None, None),
    )
    prompt = Annotated[NonEmpty | ids | Annotated[list[NonEmpty | ids], Field(min_length=1, max_length=1)],
                       OneError("must be a string, a list of token ids in the vocabulary, or a one-element list "
                                "of either (batched prompts are not supported: send one prompt per request)")]
    echo_max = Annotated[int, Field(ge=0, le=limits.max_tokens, description="0 only with echo: the prompt alone")]
    completion = create_model("CompletionRequest", __base__=CompletionRequest, __module__=__name__,
                              **{**common, "prompt": (prompt, ...), "max_tokens": (echo_max | None, None),
                                 "max_completion_tokens": (echo_max | None, None)})
    chat = create_model("ChatCompletionRequest", __base__=ChatCompletionRequest, __module__=__name__, **common)
    for model in (completion, chat):
        model.__doc__ = model.__mro__[1].__doc__
    return RequestModels(completion, chat)


def logit_bias_ids(bias: dict[str, float], limits: ApiLimits) -> tuple[tuple[int, float], ...]:
    """{"token id": bias} -> ((id, bias), ...), every key a token id of the vocabulary."""
    out = {}
    for key, value in bias.items():
        if not key.isdigit() or not key.isascii():
            raise invalid(f"'logit_bias' key {show(key)} is not a token id")
        tid = int(key)
        if tid >= limits.vocab_size:
            raise invalid(f"'logit_bias' key {tid} is outside the vocabulary [0, {limits.vocab_size})")
        out[tid] = float(value)
    return tuple(out.items())


# -- responses (for the document; the replies are built by openai_api's dict builders) -------

FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogProbs(BaseModel):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = []


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


PromptLogprobs = list[dict[str, Any] | None]


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class FunctionCallReply(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallReply


class ChatMessage(BaseModel):
    role: str
    content: str | None = None
    tool_calls: list[ToolCall] = []


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
