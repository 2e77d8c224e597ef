"""The streaming client's timing and failure handling.

The server here is a TEST DOUBLE: a few-line aiohttp app that streams OpenAI-style
SSE chunks with known delays, so the client-side metric code (TTFT, ITL, E2E,
token counts, failures, timeouts) can be checked against known numbers. The real
server is exercised in test_smoke.py (`blink serve --model null`).
"""
import asyncio
import json

import pytest
from aiohttp import web

from bench.client import Endpoint, request_body, send_completion
from bench.workload import WorkRequest

REQ = WorkRequest("hello world", prompt_tokens=2, output_tokens=4)
BODIES = web.AppKey("bodies", list)


def _chunk(text, finish=None):
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


async def stream_handler(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    request.app[BODIES].append(body)
    mode = request.query.get("mode", "ok")
    if mode == "http_error":
        return web.json_response({"error": {"message": "bad model"}}, status=404)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    delays = {"ok": [0.15, 0.05, 0.05, 0.05], "nousage_length": [0.05] * 4, "slow": [0.1, 5.0]}.get(mode, [0.05, 0.05])
    pieces = ["A", "B", "C", "D"]
    for i, d in enumerate(delays):
        await asyncio.sleep(d)
        if mode == "error_event" and i == 1:
            await resp.write(b'data: {"error": {"message": "backend died", "code": 500}}\n\n')
            break
        # Two events in one write, split mid-event across writes: the parser must cope.
        payload = f"data: {json.dumps(_chunk(pieces[i], 'length' if i == 3 else None))}\n\n".encode()
        await resp.write(payload[:7])
        await resp.write(payload[7:])
    if mode == "ok":
        usage = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}}
        await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest.fixture
async def base_url(aiohttp_server):
    app = web.Application()
    app[BODIES] = []
    app.router.add_post("/v1/completions", stream_handler)
    server = await aiohttp_server(app)
    yield f"http://127.0.0.1:{server.port}", app


async def _send(base, mode, timeout_s=10.0, counter=None):
    import aiohttp
    ep = Endpoint(base, "m", completions_path=f"/v1/completions?mode={mode}")
    async with aiohttp.ClientSession() as s:
        return await send_completion(s, ep, REQ, timeout_s, counter)


async def test_ttft_itl_e2e_and_usage(base_url):
    base, app = base_url
    rec = await _send(base, "ok")
    assert rec.success and rec.error is None and not rec.timed_out
    assert 0.13 < rec.ttft_s < 0.5
    assert len(rec.itl_s) == 3 and all(0.03 < g < 0.3 for g in rec.itl_s)
    assert rec.e2e_s == pytest.approx(rec.ttft_s + sum(rec.itl_s), abs=1e-6)
    assert rec.output_tokens == 4 and rec.server_prompt_tokens == 2 and rec.finish_reason == "length"
    assert rec.tpot_s == pytest.approx((rec.e2e_s - rec.ttft_s) / 3)
    body = app[BODIES][-1]
    assert body["max_tokens"] == 4 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


async def test_without_usage_the_text_is_counted(base_url):
    base, _ = base_url
    rec = await _send(base, "nousage", counter=lambda text: len(text) * 10)
    assert rec.success and rec.output_tokens == 20   # "AB" -> 2 chars * 10
    # finish_reason "length" without usage: exactly max_tokens were generated.
    rec = await _send(base, "nousage_length", counter=lambda text: 999)
    assert rec.success and rec.output_tokens == REQ.output_tokens and rec.finish_reason == "length"


async def test_http_error_stream_error_and_timeout_are_failures(base_url):
    base, _ = base_url
    rec = await _send(base, "http_error")
    assert not rec.success and rec.error.startswith("HTTP 404") and "bad model" in rec.error
    rec = await _send(base, "error_event")
    assert not rec.success and "backend died" in rec.error
    rec = await _send(base, "slow", timeout_s=0.5)
    assert not rec.success and rec.timed_out and "timeout" in rec.error


async def test_connection_refused_is_a_failure_not_an_exception():
    import aiohttp
    async with aiohttp.ClientSession() as s:
        rec = await send_completion(s, Endpoint("http://127.0.0.1:9", "m"), REQ, 5.0)
    assert not rec.success and rec.error and not rec.timed_out


def test_request_body_carries_server_extras():
    body = request_body(Endpoint("http://x", "m", (("logit_bias", {"2": -100.0}),), usage_in_stream=False), REQ)
    assert body["logit_bias"] == {"2": -100.0} and "stream_options" not in body
    assert body["prompt"] == "hello world" and body["temperature"] == 0.0


async def test_level_cut_after_drain_counts_stragglers_as_timeouts(base_url):
    from bench.load import LoadConfig, new_session, run_level
    from bench.metrics import summarize
    base, _ = base_url
    ep = Endpoint(base, "m", completions_path="/v1/completions?mode=slow")   # 5 s between chunks
    cfg = LoadConfig(mode="constant", levels=(4.0,), duration_s=0.5, timeout_s=30.0, drain_s=0.5, min_requests=2)
    async with new_session() as s:
        res = await run_level(s, ep, cfg, 4.0, [REQ])
    assert len(res.records) == 2 and res.duration_s < 3.0
    assert all(r.timed_out and not r.success and "cut" in r.error for r in res.records)
    assert summarize(res.records, res.duration_s).timeouts == 2
    ok = Endpoint(base, "m", completions_path="/v1/completions?mode=ok")
    conc = LoadConfig(mode="concurrency", levels=(2,), duration_s=0.6, timeout_s=30.0, drain_s=5.0)
    async with new_session() as s:
        res = await run_level(s, ok, conc, 2, [REQ])
    # Two closed-loop workers, ~0.3 s per request, for 0.6 s: 4 to 6 requests, all complete.
    assert 4 <= len(res.records) <= 6 and all(r.success for r in res.records)
