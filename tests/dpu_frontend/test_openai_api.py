"""Request validation (table-driven, every parameter) and reply building of openai_api."""
from __future__ import annotations

import json

import pytest

from dpu_frontend import openai_api as api
from dpu_frontend.openai_api import ApiError

LIMITS = api.ApiLimits(served_model="m", vocab_size=1000, max_stop_strings=4)
CMPL = {"prompt": "hi"}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def cmpl(**kw):
    return api.parse_completion({**CMPL, **kw}, LIMITS)


def chat(**kw):
    return api.parse_chat({**CHAT, **kw}, LIMITS)


# (extra fields, status, param the error must name) -- for both endpoints
COMMON_BAD = [
    ({"model": "other"}, 404, "model"),
    ({"model": 3}, 400, "model"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": -5}, 400, "max_tokens"),
    ({"max_tokens": 1.5}, 400, "max_tokens"),
    ({"max_tokens": "10"}, 400, "max_tokens"),
    ({"max_tokens": True}, 400, "max_tokens"),
    ({"max_tokens": 2**31}, 400, "max_tokens"),
    ({"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"temperature": -0.1}, 400, "temperature"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"temperature": float("nan")}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"top_p": 1.01}, 400, "top_p"),
    ({"top_k": -2}, 400, "top_k"),
    ({"top_k": 0.5}, 400, "top_k"),
    ({"seed": "x"}, 400, "seed"),
    ({"seed": 2**64}, 400, "seed"),
    ({"seed": -(2**63) - 1}, 400, "seed"),
    ({"stop": 5}, 400, "stop"),
    ({"stop": ["a", 5]}, 400, "stop"),
    ({"stop": [""]}, 400, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"stop_token_ids": [1000]}, 400, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"stop_token_ids": "1"}, 400, "stop_token_ids"),
    ({"ignore_eos": 1}, 400, "ignore_eos"),
    ({"stream": "yes"}, 400, "stream"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "y"}}, 400, "include_usage"),
    ({"stream": True, "stream_options": {"bogus": True}}, 400, "stream_options.bogus"),
    ({"stream": True, "stream_options": []}, 400, "stream_options"),
    ({"n": 65}, 400, "n"),
    ({"n": True}, 400, "n"),
    ({"n": 3, "best_of": 2}, 400, "best_of"),
    ({"best_of": 3, "stream": True}, 400, "best_of"),
    ({"presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"frequency_penalty": "1"}, 400, "frequency_penalty"),
    ({"repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, 400, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, 400, "logit_bias"),
    ({"logit_bias": {"5": -101}}, 400, "logit_bias"),
    ({"logit_bias": {"1000": 1}}, 400, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, 400, "logit_bias"),
    ({"logit_bias": [5, 1]}, 400, "logit_bias"),
    ({"min_tokens": -1}, 400, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 3}, 400, "min_tokens"),
    ({"min_p": 1.5}, 400, "min_p"),
    ({"prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ({"allowed_token_ids": []}, 400, "allowed_token_ids"),
    ({"allowed_token_ids": [1000]}, 400, "allowed_token_ids"),
    ({"bad_words": [""]}, 400, "bad_words"),
    ({"bad_words": 5}, 400, "bad_words"),
    ({"n": 0}, 400, "n"),
    ({"use_beam_search": True}, 400, "use_beam_search"),
    ({"response_format": {"type": "xml"}}, 400, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, 400,
     "response_format.json_schema.name"),
    ({"guided_json": 5}, 400, "guided_json"),
    ({"guided_regex": ""}, 400, "guided_regex"),
    ({"guided_choice": ["a", 1]}, 400, "guided_choice"),
    ({"guided_grammar": "root ::= 'a'"}, 400, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs"),
    ({"structured_outputs": {"xml": "a"}}, 400, "structured_outputs.xml"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, 400, "guided_choice"),
    ({"spaces_between_special_tokens": False}, 400, "spaces_between_special_tokens"),
    ({"include_stop_str_in_output": "no"}, 400, "include_stop_str_in_output"),
    ({"skip_special_tokens": 0}, 400, "skip_special_tokens"),
    ({"totally_unknown": 1}, 400, "totally_unknown"),
]

CMPL_BAD = [
    ({"prompt": None}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [""]}, 400, "prompt"),
    ({"prompt": [[]]}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": [[1, 2], [3]]}, 400, "prompt"),
    ({"prompt": [1, "a"]}, 400, "prompt"),
    ({"prompt": [1, 1000]}, 400, "prompt"),
    ({"prompt": [True]}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": {"text": "x"}}, 400, "prompt"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"logprobs": -1}, 400, "logprobs"),
    ({"logprobs": True}, 400, "logprobs"),
    ({"echo": "yes"}, 400, "echo"),
    ({"max_tokens": 0, "echo": False}, 400, "max_tokens"),
    ({"suffix": "end"}, 400, "suffix"),
    ({"add_special_tokens": "yes"}, 400, "add_special_tokens"),
]

CHAT_BAD = [
    ({"messages": None}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": ["hi"]}, 400, "messages[0]"),
    ({"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, 400, "messages[0].tool_call_id"),
    ({"messages": [{"role": "function", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b", "tool_calls": [{}]}]},
     400, "messages[1].tool_calls"),
    ({"logprobs": 1}, 400, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    ({"top_logprobs": 3}, 400, "top_logprobs"),
    ({"echo": "yes"}, 400, "echo"),
    ({"tools": [{"type": "function"}]}, 400, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, 400, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, 400, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, 400, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, 400, "functions"),
    ({"chat_template_kwargs": []}, 400, "chat_template_kwargs"),
    ({"continue_final_message": True}, 400, "continue_final_message"),
    ({"modalities": ["audio"]}, 400, "modalities"),
]


@pytest.mark.parametrize("parse", [cmpl, chat], ids=["completions", "chat"])
@pytest.mark.parametrize("extra,status,param", COMMON_BAD, ids=[json.dumps(c[0])[:40] for c in COMMON_BAD])
def test_common_parameter_rejected(parse, extra, status, param):
    with pytest.raises(ApiError) as e:
        parse(**extra)
    assert e.value.status == status
    assert e.value.param is not None and param in e.value.param
    body = e.value.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["code"] == status
    assert param.split(".")[-1].split("[")[0] in body["message"] or status == 404


@pytest.mark.parametrize("extra,status,param", CMPL_BAD, ids=[json.dumps(c[0])[:40] for c in CMPL_BAD])
def test_completion_parameter_rejected(extra, status, param):
    with pytest.raises(ApiError) as e:
        cmpl(**extra)
    assert (e.value.status, e.value.param) == (status, param)


@pytest.mark.parametrize("extra,status,param", CHAT_BAD, ids=[json.dumps(c[0])[:40] for c in CHAT_BAD])
def test_chat_parameter_rejected(extra, status, param):
    with pytest.raises(ApiError) as e:
        chat(**extra)
    assert (e.value.status, e.value.param) == (status, param)


@pytest.mark.parametrize("body", [None, [], "x", 3])
def test_body_must_be_an_object(body):
    for parse in (api.parse_completion, api.parse_chat):
        with pytest.raises(ApiError) as e:
            parse(body, LIMITS)
        assert e.value.status == 400


def test_defaults():
    r = cmpl()
    assert r.prompt == "hi" and r.model is None and r.add_special_tokens
    assert r.sampling == api.SamplingOptions()
    assert r.stream == api.StreamOptions()
    c = chat()
    assert c.messages == (api.ChatMessage("user", "hi"),) and c.add_generation_prompt and not c.add_special_tokens


def test_noop_values_of_unsupported_parameters_are_accepted():
    """What stock clients (openai, vllm bench) send: nulls and neutral values."""
    r = cmpl(model="m", n=1, best_of=1, logprobs=None, echo=False, suffix=None, presence_penalty=0,
             frequency_penalty=0.0, repetition_penalty=1.0, logit_bias={}, user="u", metadata={"a": "b"},
             response_format={"type": "text"}, stream=True, stream_options={"include_usage": True},
             top_k=-1, seed=None, stop=None, max_tokens=None)
    assert r.stream.include_usage and r.sampling.top_k == 0
    c = chat(logprobs=False, tools=[], tool_choice="none", parallel_tool_calls=True, service_tier="auto",
             messages=[{"role": "user", "content": "hi", "name": "bob", "tool_calls": []}])
    assert c.messages[0].content == "hi"


def test_sampling_fields_parsed():
    r = cmpl(max_tokens=7, temperature=0, top_p=0.5, top_k=40, seed=-3, ignore_eos=True, stop="x",
             stop_token_ids=[5, 6, 5], include_stop_str_in_output=True, skip_special_tokens=False)
    s = r.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (7, 0.0, 0.5, 40, -3)
    assert s.ignore_eos and s.stop == ("x",) and s.stop_token_ids == (5, 6)
    assert s.include_stop_str_in_output and not s.skip_special_tokens


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=5, max_completion_tokens=9).sampling.max_tokens == 9
    assert chat(max_tokens=5).sampling.max_tokens == 5


@pytest.mark.parametrize("prompt,expected", [
    ("abc", "abc"), (["abc"], "abc"), ([1, 2, 3], (1, 2, 3)), ([[4, 5]], (4, 5)),
])
def test_prompt_forms(prompt, expected):
    assert cmpl(prompt=prompt).prompt == expected


def test_chat_content_parts_joined_with_newlines():
    c = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert c.messages[0].content == "a\nb"


def test_continue_final_message():
    c = chat(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer"}],
             continue_final_message=True)
    assert c.continue_final_message and not c.add_generation_prompt


@pytest.mark.parametrize("requested,prompt_len,max_len,default,expect", [
    (None, 10, 100, None, 90), (None, 10, 100, 16, 16), (None, 95, 100, 16, 5), (90, 10, 100, None, 90),
    (91, 10, 100, None, 400), (None, 100, 100, None, 400), (1, 150, 100, None, 400),
])
def test_resolve_max_tokens(requested, prompt_len, max_len, default, expect):
    if expect == 400:
        with pytest.raises(ApiError) as e:
            api.resolve_max_tokens(requested, prompt_len, max_len, default)
        assert e.value.status == 400 and "context length" in e.value.message
    else:
        assert api.resolve_max_tokens(requested, prompt_len, max_len, default) == expect


def test_error_object_and_retry_after():
    e = ApiError(429, "busy", retry_after_s=0.2)
    assert e.body() == {"error": {"message": "busy", "type": "RateLimitError", "param": None, "code": 429}}
    assert e.headers() == {"Retry-After": "1"}
    assert ApiError(503, "x", retry_after_s=2.5).headers() == {"Retry-After": "3"}
    assert ApiError(400, "x").headers() == {}


def test_request_ids():
    assert api.request_id("cmpl").startswith("cmpl-") and len(api.request_id("cmpl")) > 20
    assert api.request_id("chatcmpl", "abc-1") == "chatcmpl-abc-1"
    assert api.request_id("chatcmpl", "bad id\n").startswith("chatcmpl-") and "bad" not in api.request_id("x", "bad id")


def test_sse_framing_and_chunks():
    c = api.completion_chunk("cmpl-1", 5, "m", "héllo")
    raw = api.sse(c)
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n") and b"\n" not in raw[:-2]
    assert json.loads(raw[6:]) == {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
                                   "choices": [{"index": 0, "text": "héllo", "logprobs": None,
                                                "finish_reason": None, "stop_reason": None}]}
    ch = api.chat_chunk("chatcmpl-1", 5, "m", {"content": "a\nb"}, "stop", "x", api.usage(3, 4))
    d = json.loads(api.sse(ch)[6:])
    assert d["object"] == "chat.completion.chunk" and d["choices"][0]["delta"] == {"content": "a\nb"}
    assert d["choices"][0]["finish_reason"] == "stop" and d["usage"]["total_tokens"] == 7
    u = api.usage_chunk("chat.completion.chunk", "chatcmpl-1", 5, "m", api.usage(3, 4))
    assert u["choices"] == [] and u["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert api.SSE_DONE == b"data: [DONE]\n\n"


def test_bodies():
    b = api.chat_body("chatcmpl-1", 1, "m", "hey", "length", None, api.usage(1, 2))
    assert b["object"] == "chat.completion" and b["choices"][0]["message"] == {"role": "assistant", "content": "hey"}
    b = api.completion_body("cmpl-1", 1, "m", "hey", "stop", 7, api.usage(1, 2))
    assert b["choices"][0]["text"] == "hey" and b["choices"][0]["stop_reason"] == 7
    m = api.models_body("m", 8192, 10)
    assert m["data"][0]["id"] == "m" and m["data"][0]["max_model_len"] == 8192


def test_delta_encoder_is_byte_identical_to_the_general_builder():
    for text in ("", "plain", 'quo"te\\ \n\t', "é世😀", "\x00\x1f", "\ue000blink-delta\ue000"):
        e = api.DeltaEncoder(False, "cmpl-x", 7, 'mo"del')
        assert e.encode(text) == api.sse(api.completion_chunk("cmpl-x", 7, 'mo"del', text))
        c = api.DeltaEncoder(True, "chatcmpl-x", 7, "m")
        assert c.encode(text) == api.sse(api.chat_chunk("chatcmpl-x", 7, "m", {"content": text}))
        timed = api.chat_chunk("chatcmpl-x", 7, "m", {"content": text})
        timed["blink_timing"] = {"t_last_ns": 12345, "t_frontend_ns": 12399, "n_tokens": 3}
        assert c.encode_timed(text, 12345, 12399, 3) == api.sse(timed)


def test_sampling_surface_parsed_with_vllm_names():
    r = cmpl(max_tokens=5, presence_penalty=-1.5, frequency_penalty=2, repetition_penalty=1.2, min_p=0.05,
             min_tokens=5, logit_bias={"7": -100, "9": 2.5}, allowed_token_ids=[3, 4, 3], bad_words=["foo"],
             logprobs=3, echo=True)
    s = r.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p, s.min_tokens) == \
        (-1.5, 2.0, 1.2, 0.05, 5)
    assert s.logit_bias == ((7, -100.0), (9, 2.5)) and s.allowed_token_ids == (3, 4) and s.bad_words == ("foo",)
    assert r.echo and s.logprobs == 3 and s.prompt_logprobs == 3    # echo + logprobs: the prompt's too
    assert cmpl(logprobs=0).sampling.logprobs == 0 and cmpl().sampling.logprobs is None
    assert cmpl(echo=True, max_tokens=0).sampling.max_tokens == 0    # lm-eval's echo alone
    assert cmpl(prompt_logprobs=2).sampling.prompt_logprobs == 2
    assert (cmpl(n=3).sampling.n, cmpl(n=3).sampling.best_of, cmpl(n=2, best_of=5).sampling.best_of) == (3, 3, 5)
    c = chat(logprobs=True, top_logprobs=20)
    assert c.sampling.logprobs == 20
    assert chat(logprobs=True).sampling.logprobs == 0 and chat(logprobs=False).sampling.logprobs is None


def test_bodies_carry_logprobs_and_prompt_logprobs():
    lp = {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5}], "text_offset": [0]}
    b = api.completion_body("id", 1, "m", "a", "length", None, api.usage(1, 1), logprobs=lp,
                            prompt_logprobs=[None])
    assert b["choices"][0]["logprobs"] == lp and b["choices"][0]["prompt_logprobs"] == [None]
    assert "prompt_logprobs" not in api.completion_body("id", 1, "m", "a", "length", None, api.usage(1, 1))["choices"][0]
    c = api.chat_chunk("id", 1, "m", {"content": "a"}, logprobs={"content": []})
    assert c["choices"][0]["logprobs"] == {"content": []}
