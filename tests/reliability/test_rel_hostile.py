"""Hostile input by hand against `blink serve --model null`: huge bodies, deep JSON, invalid UTF-8,
lone surrogates, control characters, NaN / negative / huge numbers, wrong types, unknown fields,
token ids outside the vocabulary, thousands of stop strings. Each gets a clear 4xx (or is served
when it is valid), never a 5xx; afterwards the server still serves."""
from __future__ import annotations

import json

import pytest

from bench.reliability import ServeUnderTest, http_get
from rel_procs import post

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {200}
BAD = {400}


def deep(n: int, open_: str = "[", close: str = "]") -> str:
    return open_ * n + close * n


def msg(content) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4}


CASES = [
    # (id, path, body (dict | bytes), acceptable statuses)
    ("body over the limit", C, b'{"prompt": "' + b"x" * (5 << 20) + b'"}', {413}),
    ("empty body", C, b"", BAD),
    ("not json", C, b"hello", BAD),
    ("json list body", C, b"[]", BAD),
    ("json string body", C, b'"prompt"', BAD),
    ("json null body", C, b"null", BAD),
    ("100k open brackets", C, b"[" * 100_000, BAD),
    ("deep array as prompt", C, ('{"prompt": ' + deep(900) + "}").encode(), BAD),
    ("deep array as stop", C, ('{"prompt": "x", "stop": ' + deep(950) + "}").encode(), BAD),
    ("deep object as stream_options", C, ('{"prompt": "x", "stream": true, "stream_options": '
                                          + deep(900, '{"a":', "}").replace("{}", "1") + "}").encode(), BAD),
    ("deep object as template kwargs", CHAT, json.dumps(msg("hi"))[:-1].encode()
     + b', "chat_template_kwargs": ' + deep(400, '{"a":', "}").replace("{}", "1").encode() + b"}", OK | BAD),
    ("invalid utf-8", C, b'{"prompt": "\xff\xfe\xfd"}', BAD),
    ("overlong utf-8", C, b'{"prompt": "\xc0\xaf"}', BAD),
    ("lone high surrogate", C, b'{"prompt": "abc\\ud800def", "max_tokens": 2}', BAD),
    ("lone low surrogate in chat", CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', BAD),
    ("lone surrogate as model", C, b'{"model": "\\ud800", "prompt": "x"}', BAD),
    ("surrogate pair is fine", C, b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}', OK),
    ("control characters served", C, {"prompt": "a\u0000b\u0007c\u001b[31m\u007f\u0085", "max_tokens": 3}, OK),
    ("control characters in chat", CHAT, msg("\u0000\u0001\u0002 nul \u2028"), OK),
    ("NaN temperature", C, b'{"prompt": "x", "temperature": NaN}', BAD),
    ("Infinity max_tokens", C, b'{"prompt": "x", "max_tokens": Infinity}', BAD),
    ("-Infinity top_p", C, b'{"prompt": "x", "top_p": -Infinity}', BAD),
    ("negative max_tokens", C, {"prompt": "x", "max_tokens": -1}, BAD),
    ("zero max_tokens", C, {"prompt": "x", "max_tokens": 0}, BAD),
    ("huge max_tokens", C, {"prompt": "x", "max_tokens": 10 ** 30}, BAD),
    ("4000-digit max_tokens", C, b'{"prompt": "x", "max_tokens": ' + b"9" * 4000 + b"}", BAD),
    ("5000-digit number", C, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", BAD),
    ("1e308 top_p", C, {"prompt": "x", "top_p": 1e308}, BAD),
    ("float max_tokens", C, {"prompt": "x", "max_tokens": 2.5}, BAD),
    ("negative temperature", C, {"prompt": "x", "temperature": -0.5}, BAD),
    ("huge seed", C, {"prompt": "x", "seed": 2 ** 70}, BAD),
    ("top_k -5", C, {"prompt": "x", "top_k": -5}, BAD),
    ("string max_tokens", C, {"prompt": "x", "max_tokens": "5"}, BAD),
    ("bool max_tokens", C, {"prompt": "x", "max_tokens": True}, BAD),
    ("prompt number", C, {"prompt": 5}, BAD),
    ("prompt object", C, {"prompt": {"text": "x"}}, BAD),
    ("prompt null", C, {"prompt": None}, BAD),
    ("prompt empty list", C, {"prompt": []}, BAD),
    ("messages string", CHAT, {"messages": "hi"}, BAD),
    ("messages of numbers", CHAT, {"messages": [1, 2]}, BAD),
    ("message without role", CHAT, {"messages": [{"content": "x"}]}, BAD),
    ("message content number", CHAT, msg(5), BAD),
    ("message image part", CHAT, msg([{"type": "image_url", "image_url": {"url": "http://x"}}]), BAD),
    ("stream as string", C, {"prompt": "x", "stream": "yes"}, BAD),
    ("stop as number", C, {"prompt": "x", "stop": 5}, BAD),
    ("unknown field", C, {"prompt": "x", "foo": 1}, BAD),
    ("unknown stream option", C, {"prompt": "x", "stream": True, "stream_options": {"bar": 1}}, BAD),
    ("unknown message field", CHAT, {"messages": [{"role": "user", "content": "x", "evil": 1}]}, BAD),
    ("template kwargs clash with messages", CHAT, {**msg("hi"), "chat_template_kwargs": {"messages": 5}},
     OK | BAD),
    ("template kwargs clash with flags", CHAT,
     {**msg("hi"), "chat_template_kwargs": {"add_generation_prompt": "x", "continue_final_message": 1}}, OK | BAD),
    ("token id = vocab", C, {"prompt": [49152]}, BAD),
    ("negative token id", C, {"prompt": [-1]}, BAD),
    ("token id 2**63", C, {"prompt": [2 ** 63]}, BAD),
    ("token id 2**64+1", C, {"prompt": [2 ** 64 + 1]}, BAD),
    ("bool token id", C, {"prompt": [True, 5]}, BAD),
    ("float token id", C, {"prompt": [5.0]}, BAD),
    ("stop token id out of vocab", C, {"prompt": [5], "stop_token_ids": [10 ** 12]}, BAD),
    ("prompt longer than the context", C, {"prompt": [5] * 8192, "max_tokens": 1}, BAD),
    ("thousands of stop strings", C, {"prompt": "x", "stop": ["a"] * 5000}, BAD),
    ("empty stop string", C, {"prompt": "x", "stop": [""]}, BAD),
    ("one megabyte stop string", C, {"prompt": [5, 6], "max_tokens": 8, "stop": "z" * (1 << 20)}, OK | BAD),
    ("many chat messages", CHAT, {"messages": [{"role": "user", "content": "hi"}] * 5000, "max_tokens": 2},
     OK | BAD),
    ("n = 10**6", C, {"prompt": "x", "n": 10 ** 6}, BAD),
    ("logprobs 10**6", C, {"prompt": "x", "logprobs": 10 ** 6}, BAD),
    ("logit_bias of 10**5 entries", C, {"prompt": "x", "logit_bias": {str(i): 1 for i in range(10 ** 5)}}, BAD),
    ("logit_bias 1e308", C, {"prompt": "x", "logit_bias": {"1": 1e308}}, BAD),
    ("bad_words of 10**4 words", C, {"prompt": "x", "bad_words": ["w"] * 10 ** 4}, BAD),
    ("min_tokens over max_tokens", C, {"prompt": "x", "max_tokens": 2, "min_tokens": 10 ** 9}, BAD),
    ("model of another name", C, {"model": "gpt-4" * 1000, "prompt": "x"}, {404}),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServeUnderTest(f"blink-test-hostile-{id(tmp_path_factory)}", ["--model", "null", "--slots", "64"],
                       tmp_path_factory.mktemp("hostile") / "serve.log", ready_timeout_s=120)
    yield s
    assert s.stop() == 0, s.log_path.read_text()


@pytest.mark.parametrize("path,body,allowed", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_input_gets_a_clear_answer(server, path, body, allowed):
    status, reply, headers = post(server.base, path, body, timeout_s=60)
    assert status in allowed, (status, reply)
    if status != 200:
        err = reply["error"]
        assert isinstance(err["message"], str) and err["code"] == status and "Traceback" not in err["message"]
        assert headers.get("Content-Type", "").startswith("application/json")


def test_wrong_methods_and_headers(server):
    assert http_get(server.base + C)[0] == 405
    status, reply, _ = post(server.base, C, {"prompt": [5, 6], "max_tokens": 2},
                            headers={"X-Request-Id": "../../etc/passwd\u00e9".encode("utf-8").decode("latin-1"),
                                     "Content-Type": "text/plain"})
    assert status == 200 and reply["id"].startswith("cmpl-") and "/" not in reply["id"]


def test_still_serving_afterwards_and_no_5xx_counted(server):
    status, reply, _ = post(server.base, C, {"prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True})
    assert status == 200 and reply["usage"]["completion_tokens"] == 6
    assert http_get(server.base + "/health")[0] == 200
    m = server.metrics()
    assert not any("internal_error" in k and v for k, v in m.items()), {k: v for k, v in m.items() if "total" in k}
    assert server.proc.poll() is None
