"""The whole frontend against a running `blink serve --model null` (the daemon's echo model:
output token i = prompt[i % prompt_len]), driven by the official `openai` client and raw HTTP."""
from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import openai
import pytest

from frontend_procs import Serve, http_get, metric, smollm2

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server():
    ring = f"blink-test-c1null-{os.getpid()}"
    with Serve(ring, "--model", "null") as s:
        yield s
        rc = s.stop()
    assert rc == 0, s.output
    assert not os.path.exists(f"/dev/shm/{ring}")   # serve removes the ring it created


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)


def echo(prompt: list[int], n: int) -> list[int]:
    return [prompt[i % len(prompt)] for i in range(n)]


def words(i: int) -> list[int]:
    """Token ids of a text unique to `i` (whole words, so every prefix decodes cleanly)."""
    return smollm2().encode(f" stream {i} says hello to number {i * 7} and", add_special_tokens=False)


def settled(server, timeout_s: float = 15.0) -> str:
    """/metrics once every slot is EMPTY and nothing is held or queued (or the last page on timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        page = server.metrics()
        slots = sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith("blink_slots{"))
        if (metric(page, "blink_slots", state="EMPTY") == slots and metric(page, "blink_requests_inflight") == 0
                and metric(page, "blink_queue_depth") == 0 and metric(page, "blink_held_slots") == 0) \
                or time.monotonic() > deadline:
            return page
        time.sleep(0.05)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["null"]
    status, body, _ = http_get(server.base + "/health")
    assert status == 200 and json.loads(body)["backend_status"] == "READY"


def test_completion_token_prompt_non_streaming(client):
    prompt = words(1)
    r = client.completions.create(model="null", prompt=prompt, max_tokens=25, extra_body={"ignore_eos": True})
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].text == smollm2().decode(echo(prompt, 25))
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(prompt), 25, len(prompt) + 25)


def test_completion_text_prompt_streaming_with_usage(client):
    text = "The quick brown fox 😀 jumps"
    ids = smollm2().encode(text)
    chunks = list(client.completions.create(model="null", prompt=text, max_tokens=30, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert chunks[-1].usage.prompt_tokens == len(ids)
    body = chunks[:-1]
    assert all(c.usage is None and len(c.choices) == 1 for c in body)
    assert [c.choices[0].finish_reason for c in body][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert "".join(c.choices[0].text for c in body) == smollm2().decode(echo(ids, 30))
    assert len({c.id for c in chunks}) == 1


def test_completion_default_max_tokens_is_16(client):
    r = client.completions.create(model="null", prompt=words(2), extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


def test_chat_non_streaming_stops_at_eos(client):
    tok = smollm2()
    messages = [{"role": "user", "content": "Hi there 世界"}]
    prompt = tok.encode(tok.render_chat(messages), add_special_tokens=False)
    r = client.chat.completions.create(model="null", messages=messages, max_completion_tokens=200)
    first_eos = prompt.index(2)   # the echo reaches <|im_end|> of the system turn: EOS, finish "stop"
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == tok.decode(prompt[:first_eos])
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == first_eos + 1


def test_chat_streaming_role_first_then_content(client):
    tok = smollm2()
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "question?"}]
    prompt = tok.encode(tok.render_chat(messages), add_special_tokens=False)
    chunks = list(client.chat.completions.create(model="null", messages=messages, max_tokens=40, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tok.decode(echo(prompt, 40))   # special tokens are not rendered
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40


def test_chat_echo_opens_the_reply_with_the_prefill(client):
    """vLLM's chat echo: the reply's content begins with the last message's when its role is the
    reply's (a continued assistant prefill, or any role without a generation prompt)."""
    tok = smollm2()
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    prompt = tok.encode(tok.render_chat(messages, False, True), add_special_tokens=False)
    kw = dict(model="null", messages=messages, max_tokens=5,
              extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False,
                          "ignore_eos": True})
    r = client.chat.completions.create(**kw)
    generated = tok.decode(echo(prompt, 5))
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == "The colour is" + generated
    assert r.usage.completion_tokens == 5                    # the echoed text is not generated
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "The colour is" + generated
    # roles differ (the reply is the assistant's, the last message the user's): nothing is echoed
    r = client.chat.completions.create(model="null", messages=messages[:1], max_tokens=3,
                                       extra_body={"echo": True, "ignore_eos": True})
    assert not r.choices[0].message.content.startswith("Name a colour.")
    # no generation prompt: the reply continues the user's message, with its role (vLLM)
    r = client.chat.completions.create(model="null", messages=messages[:1], max_tokens=3,
                                       extra_body={"echo": True, "add_generation_prompt": False, "ignore_eos": True})
    assert r.choices[0].message.role == "user" and r.choices[0].message.content.startswith("Name a colour.")


async def test_16_concurrent_streams_each_get_their_own_tokens(server):
    client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)

    async def one(i: int):
        prompt = words(i)
        n = 150 + i
        stream = await client.completions.create(model="null", prompt=prompt, max_tokens=n, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        text, usage = "", None
        async for c in stream:
            if c.choices:
                text += c.choices[0].text
            else:
                usage = c.usage
        return i, text, usage, n, prompt

    results = await asyncio.gather(*(one(i) for i in range(16)))
    await client.close()
    for i, text, usage, n, prompt in results:
        assert text == smollm2().decode(echo(prompt, n)), f"stream {i} got someone else's tokens"
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), n)


def test_stop_string_ends_and_frees_the_slot(server, client):
    prompt = smollm2().encode(" alpha beta gamma delta", add_special_tokens=False)
    r = client.completions.create(model="null", prompt=prompt, max_tokens=5000, stop=["gamma"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == " alpha beta " and r.choices[0].finish_reason == "stop"
    assert r.model_extra.get("stop_reason") is None and r.choices[0].model_extra["stop_reason"] == "gamma"
    assert r.usage.completion_tokens == 3
    chunks = list(client.completions.create(model="null", prompt=prompt, max_tokens=5000, stop=["delta", "beta"],
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == " alpha "
    assert chunks[-1].choices[0].finish_reason == "stop"
    settled(server)


def test_stop_token_ids(client):
    prompt = words(3)
    r = client.completions.create(model="null", prompt=prompt, max_tokens=100,
                                  extra_body={"stop_token_ids": [prompt[4]], "ignore_eos": True})
    assert r.choices[0].text == smollm2().decode(prompt[:4])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == prompt[4]
    assert r.usage.completion_tokens == 5


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": 1}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, 49152]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [7] * 8192}, 400, "prompt"),
    ("/v1/completions", {"prompt": [7] * 100, "max_tokens": 8100}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "bogus": 1}, 400, "bogus"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "tools[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "xml"}}, 400, "response_format.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "guided_regex": "(a"},
     400, "guided_regex"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream_options": {}},
     400, "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     400, "max_completion_tokens"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS,
                         ids=[f"{p.rsplit('/', 1)[1]}-{str(b)[:30]}" for p, b, _, _ in BAD_REQUESTS])
async def test_invalid_input_gets_error_json_and_next_request_works(server, path, body, status, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as s:
        async with s.post(server.base + path, data=data, headers={"Content-Type": "application/json"}) as r:
            assert r.status == status
            err = (await r.json())["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
            assert err["param"] == param and "Traceback" not in err["message"] and err["message"]
        async with s.post(server.base + "/v1/completions",
                          json={"prompt": [11, 12, 13], "max_tokens": 4, "ignore_eos": True}) as r:
            assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 4


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="'n' must be in"):
        client.chat.completions.create(model="null", messages=[{"role": "user", "content": "x"}], n=0)


def test_unknown_route_and_method(server):
    status, body, _ = http_get(server.base + "/v1/nothing")
    assert status == 404 and json.loads(body)["error"]["code"] == 404
    status, body, _ = http_get(server.base + "/v1/completions")
    assert status == 405 and json.loads(body)["error"]["code"] == 405


async def test_100_disconnects_mid_stream_leave_nothing_behind(server):
    before = server.metrics()
    gone0 = _count(before, "client_disconnect")

    async def drop_after_first_chunk(i: int):
        async with aiohttp.ClientSession() as s:
            async with s.post(server.base + "/v1/completions",
                              json={"prompt": words(i), "max_tokens": 8000, "ignore_eos": True,
                                    "stream": True}) as r:
                assert r.status == 200
                await r.content.readuntil(b"\n\n")   # one chunk, then hang up
                r.connection.transport.abort() if r.connection else None

    for wave in range(4):
        await asyncio.gather(*(drop_after_first_chunk(25 * wave + i) for i in range(25)))
    page = await asyncio.to_thread(settled, server)
    slots = sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith("blink_slots{"))
    assert metric(page, "blink_slots", state="EMPTY") == slots
    assert metric(page, "blink_requests_inflight") == 0 and metric(page, "blink_queue_depth") == 0
    assert metric(page, "blink_held_slots") == 0
    # every prompt and output arena range came back (default ring: 4M tokens each)
    assert metric(page, "blink_prompt_arena_free_tokens") == metric(page, "blink_output_arena_free_tokens") == 1 << 22
    # and every KV block of the daemon's pool (published in the ring header)
    assert metric(page, "blink_kv_blocks_total") > 0
    assert metric(page, "blink_kv_blocks_free") == metric(page, "blink_kv_blocks_total")
    assert _count(page, "client_disconnect") - gone0 > 50   # most really left mid-stream
    r = await asyncio.to_thread(http_get, server.base + "/health")
    assert r[0] == 200


def _count(page: str, outcome: str) -> float:
    try:
        return metric(page, "blink_requests_total", endpoint="completions", outcome=outcome)
    except KeyError:
        return 0.0


def test_metrics_page(server, client):
    client.completions.create(model="null", prompt=words(5), max_tokens=10, extra_body={"ignore_eos": True})
    page = server.metrics()
    assert metric(page, "blink_requests_total", endpoint="completions", outcome="length") >= 1
    for name in ("blink_time_to_first_token_seconds_count", "blink_time_per_output_token_seconds_count",
                 "blink_e2e_request_latency_seconds_count", "blink_tokenization_seconds_count"):
        assert metric(page, name) >= 1
    assert metric(page, "blink_backend_up") == 1
    assert 0 <= metric(page, "blink_backend_heartbeat_age_seconds") < 2
    assert "# TYPE blink_time_to_first_token_seconds histogram" in page
    assert metric(page, "blink_time_to_first_token_seconds_bucket", le="+Inf") >= 1


@pytest.mark.parametrize("path,payload", [
    ("/v1/completions", {"model": "null", "prompt": "Hello there, general", "repetition_penalty": 1.0,
                         "max_tokens": 20, "logprobs": None, "stream": True,
                         "stream_options": {"include_usage": True}, "ignore_eos": True}),
    ("/v1/chat/completions", {"model": "null", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hello there, general"}]}], "max_completion_tokens": 20, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True}),
], ids=["completions", "chat"])
async def test_vllm_bench_serve_payloads(server, path, payload):
    """The exact bodies `vllm bench serve` sends (openai / openai-chat backends), parsed its way."""
    async with aiohttp.ClientSession() as s:
        async with s.post(server.base + path, json=payload) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            raw = (await r.read()).decode()
    messages = [m.strip() for m in raw.split("\n\n") if m.strip()]
    assert messages[-1] == "data: [DONE]"
    datas = [json.loads(m.removeprefix("data: ")) for m in messages[:-1]]
    token_chunks = [d for d in datas if d.get("choices")]
    usage = [d["usage"] for d in datas if not d.get("choices")]
    assert token_chunks and len(usage) == 1 and usage[0]["completion_tokens"] == 20
    key = (lambda c: c["choices"][0]["delta"].get("content")) if "chat" in path else (lambda c: c["choices"][0]["text"])
    assert "".join(key(c) or "" for c in token_chunks)
