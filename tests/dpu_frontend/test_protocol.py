"""protocol.py: the declared API is what validation accepts and what /openapi.json says, and the
replies the dict builders make fit the declared response models."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from dpu_frontend import openai_api as api
from dpu_frontend import protocol
from dpu_frontend.config import FrontendConfig
from dpu_frontend.openapi import document

LIMITS = api.ApiLimits(served_model="m", vocab_size=1000, max_stop_strings=4)
CHAT = [{"role": "user", "content": "hi"}]

BOTH = ("n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p",
        "min_tokens", "top_k", "top_p", "temperature", "seed", "prompt_logprobs", "stop", "stop_token_ids",
        "allowed_token_ids", "bad_words", "response_format", "structured_outputs", "guided_json", "guided_regex",
        "guided_choice", "guided_grammar", "stream", "stream_options", "ignore_eos", "max_tokens",
        "max_completion_tokens", "echo", "logprobs", "include_stop_str_in_output", "skip_special_tokens")
CHAT_ONLY = ("messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt",
             "continue_final_message", "chat_template_kwargs")


def test_the_document_lists_every_accepted_parameter():
    schemas = document(FrontendConfig(), 1000, 2048)["components"]["schemas"]
    comp, chat = schemas["CompletionRequest"]["properties"], schemas["ChatCompletionRequest"]["properties"]
    assert set(BOTH) <= set(comp) and set(BOTH + CHAT_ONLY) <= set(chat)
    assert "prompt" in comp
    # the document's properties are exactly the keys validation accepts: any other is refused
    for name in comp:
        if name not in ("prompt",):
            try:
                api.parse_completion({"prompt": "x", name: None}, LIMITS)
            except api.ApiError as e:
                pytest.fail(f"{name} is documented but refused: {e.message}")
    with pytest.raises(api.ApiError, match="Unrecognized"):
        api.parse_completion({"prompt": "x", "not_a_parameter": None}, LIMITS)


def test_the_document_states_the_ranges_validation_enforces():
    props = document(FrontendConfig(), 1000, 2048)["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    top = props["top_logprobs"]["anyOf"][0]
    assert (top["minimum"], top["maximum"]) == (0, protocol.MAX_LOGPROBS)
    api.parse_chat({"messages": CHAT, "logprobs": True, "top_logprobs": protocol.MAX_LOGPROBS}, LIMITS)
    with pytest.raises(api.ApiError):
        api.parse_chat({"messages": CHAT, "logprobs": True, "top_logprobs": protocol.MAX_LOGPROBS + 1}, LIMITS)
    bias = props["logit_bias"]["anyOf"][0]
    assert bias["additionalProperties"] == {"maximum": 100, "minimum": -100, "type": "number"}
    assert props["use_beam_search"]["anyOf"][0]["enum"] == [False, None]


def test_the_servers_max_tokens_bounds_validation_and_the_document():
    limits = api.ApiLimits("m", 1000, 4, max_tokens=32)
    assert api.parse_completion({"prompt": "x", "max_tokens": 32}, limits).sampling.max_tokens == 32
    with pytest.raises(api.ApiError) as e:
        api.parse_completion({"prompt": "x", "max_tokens": 33}, limits)
    assert e.value.param == "max_tokens" and "[0, 32]" in e.value.message


def test_logit_bias_errors_name_the_parameter_and_the_token():
    for bias, words in (({"5": 150}, "token \"5\""), ({"5": "1"}, "token \"5\""), ({"x": 1}, "not a token id"),
                        ({"1000": 1}, "outside the vocabulary")):
        with pytest.raises(api.ApiError) as e:
            api.parse_completion({"prompt": "x", "logit_bias": bias}, LIMITS)
        assert e.value.param == "logit_bias" and words in e.value.message, e.value.message


def test_range_errors_name_the_interval():
    with pytest.raises(api.ApiError) as e:
        api.parse_completion({"prompt": "x", "n": 0}, LIMITS)
    assert e.value.message == "'n' must be in [1, 64], got 0"
    with pytest.raises(api.ApiError) as e:
        api.parse_completion({"prompt": "x", "top_p": 0}, LIMITS)
    assert e.value.message.startswith("'top_p' must be in (0")


@pytest.mark.parametrize("body,role,prefix", [
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer"}],
      "continue_final_message": True, "add_generation_prompt": False}, "assistant", "The answer"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer"}],
      "continue_final_message": True}, "assistant", "The answer"),
    ({"messages": [{"role": "user", "content": "Once upon"}], "add_generation_prompt": False}, "user", "Once upon"),
    ({"messages": [{"role": "user", "content": "q"}]}, "assistant", ""),          # roles differ: nothing echoed
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A"}]}, "assistant", "A"),
])
def test_chat_echo_opens_with_the_last_message_when_its_role_is_the_replys(body, role, prefix):
    req = api.parse_chat({**body, "echo": True}, LIMITS)
    assert req.reply_role == role and api.echo_prefix(req) == prefix
    assert api.echo_prefix(api.parse_chat(body, LIMITS)) == ""      # no echo: nothing


def test_reply_builders_fit_the_response_models():
    lp = {"tokens": ["a", "b"], "token_logprobs": [None, -0.5], "top_logprobs": [None, {"b": -0.5}],
          "text_offset": [0, 1]}
    body = api.completion_body("cmpl-1", 1, "m", "ab", "stop", None, api.usage(1, 2), logprobs=lp,
                               prompt_logprobs=[None, {"7": {"logprob": -1.0, "rank": 1, "decoded_token": "b"}}])
    protocol.CompletionResponse.model_validate(body)
    chat_lp = {"content": [{"token": "a", "logprob": -0.1, "bytes": [97],
                            "top_logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97]}]}]}
    body = api.chat_body("chatcmpl-1", 1, "m", "a", "length", None, api.usage(1, 1), logprobs=chat_lp, role="user")
    assert protocol.ChatCompletionResponse.model_validate(body).choices[0].message.role == "user"
    protocol.ErrorResponse.model_validate(api.bad_request("x", "n").body())
    with pytest.raises(ValidationError):
        protocol.CompletionResponse.model_validate({**body, "choices": [{"index": 0}]})
