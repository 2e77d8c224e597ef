"""The app in-process (aiohttp test client) over a real daemon process: unexpected failures become a
500 error JSON (or an error event mid-stream), are logged without the prompt, and disturb nobody else."""
from __future__ import annotations

import json
import logging
import subprocess
import time

import pytest

from dpu_frontend.app import SERVICE, create_app, ring_client_for
from dpu_frontend.completions import GenerationService
from dpu_frontend.config import FrontendConfig
from frontend_procs import REPO, blink, smollm2

pytestmark = pytest.mark.timeout(60)
SECRET = "my-secret-prompt-text"


@pytest.fixture
def daemon(ring_name):
    p = subprocess.Popen([*blink(), "gpu-daemon", "--ring", ring_name, "--model", "null", "--slots", "64"],
                         cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield ring_name
    p.terminate()
    assert p.wait(15) == 0


@pytest.fixture
async def http(daemon, aiohttp_client):
    config = FrontendConfig(ring_name=daemon, model="null", startup_timeout_s=20)
    app = create_app(config, tokenizer=smollm2())
    c = await aiohttp_client(app)
    deadline = time.monotonic() + 20
    while (await c.get("/health")).status != 200 and time.monotonic() < deadline:
        pass
    return c


async def test_unexpected_exception_is_a_500_json_without_the_prompt(http, monkeypatch, caplog):
    real_submit = GenerationService.submit

    async def exploding_submit(self, gen):
        if SECRET in str(gen.request.prompt):
            raise RuntimeError(f"bug while handling {gen.request.prompt}")
        return await real_submit(self, gen)

    monkeypatch.setattr(GenerationService, "submit", exploding_submit)
    with caplog.at_level(logging.ERROR):
        r = await http.post("/v1/completions", json={"prompt": SECRET})
        body = await r.json()
    assert r.status == 500 and body["error"]["code"] == 500 and body["error"]["type"] == "InternalServerError"
    assert SECRET not in json.dumps(body) and "Traceback" not in json.dumps(body)
    assert caplog.records and all(SECRET not in (rec.getMessage() + str(rec.exc_info)) for rec in caplog.records)
    assert any("RuntimeError" in rec.getMessage() for rec in caplog.records)
    r = await http.post("/v1/completions", json={"prompt": [9, 10], "max_tokens": 3, "ignore_eos": True})
    assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 3


async def test_failure_mid_stream_ends_with_an_error_event(http, monkeypatch):
    service: GenerationService = http.server.app[SERVICE]
    real = service._detokenizer

    class Broken:
        def __init__(self, inner):
            self.inner = inner   # no tokens_seen either: a second failure after the first


        def feed(self, batch):
            raise ValueError("detokenizer bug")

    monkeypatch.setattr(service, "_detokenizer", lambda gen: Broken(real(gen)) if gen.request.sampling.stop else real(gen))
    r = await http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 50, "stream": True,
                                                 "stop": ["zzz"], "ignore_eos": True})
    assert r.status == 200
    text = (await r.read()).decode()
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == 500
    r = await http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 5, "stream": True,
                                                 "ignore_eos": True})
    assert r.status == 200 and (await r.read()).decode().endswith("data: [DONE]\n\n")


async def test_client_owned_by_caller_is_not_closed(daemon, aiohttp_client):
    config = FrontendConfig(ring_name=daemon, model="null")
    client = ring_client_for(config)
    await client.start()
    try:
        c = await aiohttp_client(create_app(config, client=client, tokenizer=smollm2()))
        deadline = time.monotonic() + 20
        while (await c.get("/health")).status != 200 and time.monotonic() < deadline:
            pass
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                       "max_tokens": 5})
        assert r.status == 200
        await c.close()
        assert client.health().healthy   # still running after the app shut down
    finally:
        await client.close()
