"""Request validation under arbitrary JSON: parse_completion / parse_chat either accept a body or
raise ApiError (a 4xx with a message); no other exception, whatever the types, depths, numbers
or strings. Hypothesis builds bodies from the real parameter names with any JSON values."""
from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpu_frontend import openai_api as api
from dpu_frontend.openapi import document
from dpu_frontend.config import FrontendConfig

LIMITS = api.ApiLimits(served_model="m", vocab_size=49152, max_stop_strings=32)

PARAMS = sorted({"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                 "top_k", "seed", "ignore_eos", "stop", "stop_token_ids", "include_stop_str_in_output",
                 "skip_special_tokens", "add_special_tokens", "stream", "stream_options", "n", "best_of",
                 "logprobs", "echo", "suffix", "tools", "tool_choice", "chat_template_kwargs",
                 "add_generation_prompt", "continue_final_message", "presence_penalty", "logit_bias",
                 "response_format", "user", "metadata", "min_tokens", "priority", "unknown_thing"})

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                    st.sampled_from(["m", "user", "assistant", "text", "", "\ud800x", "\x00"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.sampled_from(PARAMS + ["role", "content", "type", "text",
                                                                         "include_usage"]), inner, max_size=5)),
    max_leaves=30)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", 5, None]),
                                 "content": json_values}, optional={"name": json_values, "extra": json_values})
bodies = st.one_of(
    json_values,
    st.dictionaries(st.sampled_from(PARAMS), json_values, max_size=8),
    st.fixed_dictionaries({"prompt": json_values}, optional={k: json_values for k in PARAMS if k != "prompt"}),
    st.fixed_dictionaries({"messages": st.lists(message, max_size=4)},
                          optional={k: json_values for k in PARAMS if k != "messages"}),
)


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(body=bodies, chat=st.booleans())
def test_validation_raises_only_api_errors(body, chat):
    parse = api.parse_chat if chat else api.parse_completion
    try:
        parse(body, LIMITS)
    except api.ApiError as e:
        assert 400 <= e.status < 500
        json.dumps(e.body(), ensure_ascii=False).encode("utf-8")   # the reply can be sent as UTF-8


def test_lone_surrogates_in_quoted_values_stay_encodable():
    for body in ({"model": "\ud800x", "prompt": "x"}, {"prompt": "x", "stop": 5, "max_tokens": "\udfff"},
                 {"prompt": "x", "n": "\ud800"}):
        try:
            api.parse_completion(body, LIMITS)
        except api.ApiError as e:
            json.dumps(e.body(), ensure_ascii=False).encode("utf-8")


def test_deep_values_do_not_break_error_messages():
    deep = []
    for _ in range(5000):
        deep = [deep]
    for key in ("stop", "max_tokens", "temperature", "model", "stream_options"):
        try:
            api.parse_completion({"prompt": "x", key: deep}, LIMITS)
        except api.ApiError as e:
            assert e.status == 400
    try:
        api.parse_completion({"prompt": "x", "max_tokens": 10 ** 4000}, LIMITS)
    except api.ApiError as e:
        assert e.status == 400


def test_openapi_document_is_json_and_tracks_settings():
    doc = document(FrontendConfig(max_tokens_limit=64, max_stop_strings=4, api_key="k"), 1000, 2048)
    json.dumps(doc)
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["max_tokens"]["anyOf"][0]["maximum"] == 64
    assert props["stop"]["anyOf"][1]["maxItems"] == 4
    assert props["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == 999
    assert doc["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert doc["paths"]["/health"]["get"]["security"] == []
