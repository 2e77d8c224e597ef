"""The frontend over the real SmolLM2-135M-Instruct on the CPU executor (`blink serve`, the README's
command), driven by the official `openai` client."""
from __future__ import annotations

import asyncio
import os

import openai
import pytest

from frontend_procs import Serve, smollm2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def server():
    ring = f"blink-test-c1cpu-{os.getpid()}"
    with Serve(ring, "--max-batch-size", "8", ready_timeout_s=540) as s:
        yield s
        assert s.stop() == 0, s.output


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_answers_and_counts_usage(client):
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=30,
                                       temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"   # <|im_end|> ends the turn and is not rendered
    assert "<|im_end|>" not in r.choices[0].message.content
    tok = smollm2()
    assert r.usage.prompt_tokens == len(tok.encode(tok.render_chat(QUESTION), add_special_tokens=False))
    assert 1 <= r.usage.completion_tokens <= 30


def test_streamed_text_equals_the_non_streamed_text(client):
    kw = dict(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Name three colours."}],
              max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_string_cuts_real_output(client):
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=20,
                                  temperature=0, stop=["Paris"])
    assert "Paris" not in r.choices[0].text and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == "Paris"


async def test_concurrent_greedy_requests_match_their_solo_answers(server):
    client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)
    prompts = ["The capital of France is", "1, 2, 3, 4,"]

    async def ask(p: str) -> str:
        r = await client.completions.create(model="SmolLM2-135M-Instruct", prompt=p, max_tokens=6, temperature=0)
        return r.choices[0].text

    solo = [await ask(p) for p in prompts]
    together = await asyncio.gather(*(ask(p) for p in prompts))
    await client.close()
    assert together == solo
