"""The frontend's structured-output pieces without a server: request shapes, regexes, tool calls,
and a compiled automaton that accepts exactly what its regex accepts (on SmolLM2's vocabulary)."""
import json
import random
import re

import numpy as np
import pytest

from dpu_frontend.structured import regex, tools
from dpu_frontend.structured.request import Constraint, ConstraintError, parse


def test_request_shapes_give_one_canonical_constraint():
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    same = [{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}},
            {"structured_outputs": {"json": schema}}, {"guided_json": json.dumps(schema)}]
    got = {(c.kind, c.source) for c in map(parse, same)}
    assert len(got) == 1 and next(iter(got))[0] == "json_schema"
    assert parse({"response_format": {"type": "text"}}) is None
    assert parse({"response_format": {"type": "json_object"}}).kind == "json_object"
    assert parse({"structured_outputs": {"choice": ["a", "b"]}}) == Constraint("choice", '["a", "b"]',
                                                                                "structured_outputs.choice")
    with pytest.raises(ConstraintError) as e:
        parse({"guided_regex": "a", "response_format": {"type": "json_object"}})
    assert e.value.param == "guided_regex"


@pytest.mark.parametrize("lo,hi", [(0, 150), (5, 5000), (-300, 2000), (None, -7), (13, None), (-5000, -1200),
                                   (987, 123456)])
def test_integer_regex_is_exact(lo, hi):
    rx = re.compile("^" + regex.integer_regex(lo, hi) + "$")
    rng = random.Random(0)
    for i in list(range(-13000, 13000, 7)) + [rng.randint(-10**7, 10**7) for _ in range(2000)]:
        assert bool(rx.match(str(i))) == ((lo is None or i >= lo) and (hi is None or i <= hi)), i
    assert not rx.match("007") and not rx.match("-0")


def test_schema_checks():
    def rx(schema):
        return regex.to_regex(Constraint("json_schema", json.dumps(schema), "p"))
    out = rx({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 3}}, "required": ["n"]})
    assert re.fullmatch(out, '{"n": 2}') and not re.fullmatch(out, '{"n": 4}')
    for bad in ({"type": "object", "patternProperties": {}}, {"type": "number", "minimum": 0},
                {"type": "integer", "minimum": 5, "maximum": 1}, {"type": "frobnicate"}):
        with pytest.raises(ConstraintError):
            rx(bad)


def test_choice_is_literal():
    out = regex.to_regex(Constraint("choice", json.dumps(["a+b", "(x)", "1.5"]), "p"))
    assert all(re.fullmatch(out, s) for s in ("a+b", "(x)", "1.5")) and not re.fullmatch(out, "aab")


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tools_parse_render_and_calls():
    spec = tools.parse([WEATHER], "auto", None)
    assert spec.choice == "auto" and spec.constraint is None and spec.parallel
    msgs = tools.render_messages(
        [{"role": "user", "content": "hi"},
         {"role": "assistant", "content": "", "tool_calls": ({"id": "c1", "name": "get_weather",
                                                              "arguments": '{"city": "Oslo"}'},)},
         {"role": "tool", "content": "rain"}], spec)
    assert msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in msgs[2]["content"]
    assert msgs[3] == {"role": "user", "content": "<tool_response>\nrain\n</tool_response>"}
    found, rest = tools.calls('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>',
                              spec)
    assert rest == "Sure." and [(c.name, json.loads(c.arguments)) for c in found] == [("get_weather", {"city": "Rome"})]
    assert tools.calls("no call here", spec) == ([], "no call here")
    named = tools.parse([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, False)
    assert named.constraint.kind == "json_schema" and not named.rendered
    required = tools.parse([WEATHER], "required", False)
    assert json.loads(required.constraint.source)["maxItems"] == 1
    found, _ = tools.calls('[{"name": "get_weather", "parameters": {"city": "Rome"}}]', required)
    assert found[0].name == "get_weather" and json.loads(found[0].arguments) == {"city": "Rome"}
    for bad, param in (([{"type": "function"}], "tools[0]"), ([WEATHER, WEATHER], "tools")):
        with pytest.raises(ConstraintError) as e:
            tools.parse(bad, None, None)
        assert e.value.param == param


def test_compiled_automaton_accepts_what_the_regex_accepts():
    """Walk SmolLM2's tokenization of matching and non-matching strings through the ring-encoded automaton."""
    from dpu_frontend.structured.compiler import ConstraintCompiler
    from dpu_frontend.tokenizer import load_tokenizer
    from shared_layout.automaton import decode
    tok = load_tokenizer("default")
    cc = ConstraintCompiler(tok.tokenizer, min(tok.eos_ids))
    pattern = r"\([0-9]{3}\) [a-z]+"
    a = decode(np.frombuffer(cc.compile_now(Constraint("regex", pattern, "p")).words, "<i4"), tok.vocab_size)

    def walk(text):
        state = a.initial
        for t in tok.encode(text, add_special_tokens=False):
            if not a.allowed(state, tok.vocab_size)[t]:
                return False
            state = a.next_state(state, t)
        return a.accepting(state)
    for text in ("(123) abc", "(555) hello", "(000) x"):
        assert walk(text), text
    for text in ("(12) abc", "(123)abc", "(123) ABC", "(123) abc "):
        assert not walk(text), text
    cc.close()


def _schema(**string):
    return Constraint("json_schema", json.dumps({"type": "object", "properties": {"s": {"type": "string", **string}},
                                                 "required": ["s"]}, sort_keys=True), "response_format")


def test_string_lengths_reach_the_regex():
    rx = regex.to_regex(_schema(minLength=2, maxLength=4))
    for n in range(1, 6):
        assert bool(re.fullmatch(rx, '{"s":"' + "x" * n + '"}')) == (2 <= n <= 4), n
    assert not re.fullmatch(rx, '{"s":"\\n"}')             # an escape is one character: below minLength 2
    assert re.fullmatch(rx, '{"s":"a\\n"}')
    no_max = regex.to_regex(_schema(minLength=2, maxLength=4), drop_max_length=True)
    assert re.fullmatch(no_max, '{"s":"' + "x" * 9 + '"}') and not re.fullmatch(no_max, '{"s":"x"}')


def test_a_max_length_past_the_budget_compiles_without_it(caplog):
    """maxLength costs ~40 K automaton words per character on SmolLM2: past the budget the schema is
    compiled again without its maxLengths (minLength kept) and the log says so; a schema without one
    that is too large is still a 400."""
    from dpu_frontend.structured.compiler import CompilerConfig, ConstraintCompiler
    from dpu_frontend.tokenizer import load_tokenizer
    from shared_layout.automaton import decode
    tok = load_tokenizer("default")
    cc = ConstraintCompiler(tok.tokenizer, min(tok.eos_ids), CompilerConfig(max_words=100_000))
    exact = ConstraintCompiler(tok.tokenizer, min(tok.eos_ids)).compile_now(_schema(minLength=3, maxLength=8))
    light = cc.compile_now(_schema(minLength=3, maxLength=40))
    assert len(light.words) // 4 <= 100_000 < len(exact.words) // 4
    assert "not enforced" in caplog.text
    a = decode(np.frombuffer(light.words, "<i4"), tok.vocab_size)

    def walk(text):
        state = a.initial
        for t in tok.encode(text, add_special_tokens=False):
            if not a.allowed(state, tok.vocab_size)[t]:
                return False
            state = a.next_state(state, t)
        return a.accepting(state)
    assert walk('{"s":"abcdefgh"}') and not walk('{"s":"ab"}')     # minLength still holds
    with pytest.raises(ConstraintError, match="at most 100000"):
        cc.compile_now(Constraint("regex", "[a-z]{30}", "p"))
    cc.close()
