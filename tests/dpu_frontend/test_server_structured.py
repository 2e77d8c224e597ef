"""Structured outputs end to end: `blink serve` on SmolLM2 (CPU executor), the official `openai`
client; the constraint is compiled on the frontend and stepped by the daemon alone."""
from __future__ import annotations

import json
import os
import re
from typing import Literal, Optional

import openai
import pydantic
import pytest

from frontend_procs import Serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    ring = f"blink-test-structured-{os.getpid()}"
    with Serve(ring, "--max-batch-size", "8", ready_timeout_s=540) as s:
        yield s
        assert s.stop() == 0, s.output


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=300)


class Address(pydantic.BaseModel):
    street: str
    city: str


class Pet(pydantic.BaseModel):
    name: str
    kind: Literal["cat", "dog", "bird"]
    age: int = pydantic.Field(ge=0, le=30)
    nickname: Optional[str]
    tags: list[str] = pydantic.Field(min_length=1, max_length=2)
    home: Address


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe a pet as JSON."}],
        response_format=Pet, max_tokens=300, temperature=0.7, seed=3)
    c = r.choices[0]
    assert c.finish_reason == "stop", c.message.content
    pet = c.message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.age <= 30 and 1 <= len(pet.tags) <= 2
    assert Pet.model_validate_json(c.message.content) == pet


class Badge(pydantic.BaseModel):
    code: str = pydantic.Field(min_length=6, max_length=6)
    name: str = pydantic.Field(min_length=3, max_length=8)


def test_parse_enforces_string_lengths(client):
    """minLength / maxLength hold: an exact 6-character code is what a sampled model rarely writes
    unconstrained, at several seeds."""
    for seed in (1, 2, 3):
        r = client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "Make up a badge code and a name as JSON."}],
            response_format=Badge, max_tokens=100, temperature=1.0, seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "stop", c.message.content
        badge = c.message.parsed          # the client validated the lengths too
        assert len(badge.code) == 6 and 3 <= len(badge.name) <= 8, badge


class City(pydantic.BaseModel):
    name: str
    country: str


CITY_PROMPT = 'Paris is the capital of France. Reply with the JSON {"name": <the city>, "country": <its country>}.'


@pytest.mark.parametrize("mode", ["JSON", "TOOLS"])
def test_instructor_json_and_tools_modes(server, mode):
    """instructor, unchanged: JSON mode sends response_format json_object and the schema in the prompt,
    TOOLS mode a forced tool call; both come back as a validated City."""
    instructor = pytest.importorskip("instructor")
    raw = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=300)
    ic = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))
    city, completion = ic.chat.completions.create_with_completion(
        model=MODEL, response_model=City, max_retries=0, max_tokens=200, temperature=0,
        messages=[{"role": "user", "content": CITY_PROMPT}])
    assert city.name == "Paris" and city.country.lower() == "france"
    assert completion.choices[0].finish_reason == ("tool_calls" if mode == "TOOLS" else "stop")


def test_json_object(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Give the JSON object {\"name\": \"Alice\", \"age\": 30}."}],
                                       response_format={"type": "json_object"}, max_tokens=200, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "stop", c.message.content
    assert isinstance(json.loads(c.message.content), dict)


def test_regex_and_choice(client):
    r = client.completions.create(model=MODEL, prompt="A phone number: ", max_tokens=20, temperature=1.0, seed=1,
                                  extra_body={"structured_outputs": {"regex": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is the sky green?"}],
                                       max_tokens=10, extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert r.choices[0].message.content in ("yes", "no", "maybe") and r.choices[0].finish_reason == "stop"


def test_out_of_tokens_mid_structure_is_length(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A pet."}], max_tokens=5,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema()}})
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


def test_bad_constraints_are_400s_that_name_the_parameter(client):
    cases = [({"guided_regex": "(ab"}, "guided_regex"),
             ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs.grammar"),
             ({"guided_json": {"type": "object", "patternProperties": {"a": {}}}}, "guided_json"),
             ({"response_format": {"type": "xml"}}, "response_format.type")]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                           extra_body=body)
        assert e.value.body["param"] == param, e.value.body
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.choices[0].message.content is not None


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_forced_tool_call(client):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=100, temperature=0)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c.message
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.id
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit")
        else:
            assert call.function.name == "get_time" and isinstance(args["tz"], str)


def test_tool_round_trip(client):
    # one call: with parallel calls allowed, greedy SmolLM2 may repeat the call until max_tokens cuts
    # the array (it did once prompts moved to bf16 weights), and a cut structure carries no calls
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=100, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    call = r.choices[0].message.tool_calls[0]
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=40, temperature=0)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert c.message.content or c.message.tool_calls


def test_streamed_named_tool_call(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], stream=True, max_tokens=100, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    first, args, finish = None, "", None
    for ev in stream:
        if not ev.choices:
            continue
        d = ev.choices[0].delta
        for tc in d.tool_calls or ():
            if first is None:
                first = tc
                assert tc.id and tc.function.name == "get_weather" and tc.type == "function"
            else:
                assert tc.id is None and tc.function.name is None
            args += tc.function.arguments or ""
        finish = ev.choices[0].finish_reason or finish
    assert first is not None and finish == "tool_calls"
    assert set(json.loads(args)) == {"city", "unit"}


def test_langchain_structured_output_and_bind_tools(server):
    """LangChain's ChatOpenAI unchanged: with_structured_output (json_schema and function calling)
    and bind_tools with a forced tool."""
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(base_url=server.base + "/v1", api_key="none", model=MODEL, temperature=0, max_tokens=300,
                        max_retries=0, timeout=300)
    for method in ("json_schema", "function_calling"):
        pet = llm.with_structured_output(Pet, method=method).invoke("Describe a pet as JSON.")
        assert isinstance(pet, Pet) and 0 <= pet.age <= 30, method

    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Current weather in a city."""
        return "sunny"
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}
