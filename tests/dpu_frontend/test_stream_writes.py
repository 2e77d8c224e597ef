"""What a stream puts on the socket, in-process over a real null daemon: the SSE headers leave
with the first chunk in one write, or alone once SSE_HEADERS_WAIT_S passed without a token; the
last chunk, the usage chunk, [DONE] and the end of the chunked body leave in one write; the
direct path (stream_push.py) writes the same chunks the handler would, stays off where the handler
must decide, turns its own failure into an error event, and leaves a stalled client to the stall watch."""
from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from dpu_frontend import completions
from dpu_frontend.app import create_app
from dpu_frontend.config import FrontendConfig
from frontend_procs import REPO, blink, smollm2

pytestmark = pytest.mark.timeout(60)


def start_daemon(ring_name: str, step_ms: float) -> subprocess.Popen:
    return subprocess.Popen([*blink(), "gpu-daemon", "--ring", ring_name, "--model", "null", "--slots", "16",
                             "--step-ms", str(step_ms)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def client_for(ring_name, aiohttp_client):
    app = create_app(FrontendConfig(ring_name=ring_name, model="null", startup_timeout_s=20), tokenizer=smollm2())
    c = await aiohttp_client(app)
    deadline = time.monotonic() + 20
    while (await c.get("/health")).status != 200 and time.monotonic() < deadline:
        pass
    return c


@pytest.fixture
def record_writes(monkeypatch):
    """Every transport.write of a stream, with its time (the stream's transport, wrapped when it starts)."""
    writes: list[tuple[float, bytes]] = []
    real_limit = completions.limit_send_buffer

    def wrap(transport):
        real_limit(transport)
        inner = transport.write

        inner_lines = transport.writelines

        def write(data):
            writes.append((time.monotonic(), bytes(data)))
            return inner(data)

        def writelines(parts):
            parts = [bytes(p) for p in parts]
            writes.append((time.monotonic(), b"".join(parts)))
            return inner_lines(parts)
        transport.write = write
        transport.writelines = writelines

    monkeypatch.setattr(completions, "limit_send_buffer", wrap)
    return writes


@pytest.fixture
def patient_headers(monkeypatch):
    """Headers wait for the first chunk far longer than a loaded CI machine can delay it: the tests
    that use this check the coalescing, not the 50 ms deadline (the late-token test checks that)."""
    monkeypatch.setattr(completions, "SSE_HEADERS_WAIT_S", 5.0)


async def test_headers_leave_with_the_first_chunk(ring_name, aiohttp_client, record_writes, patient_headers):
    daemon = start_daemon(ring_name, 0.0)   # tokens at once: the first is there well within SSE_HEADERS_WAIT_S
    try:
        c = await client_for(ring_name, aiohttp_client)
        r = await c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8, "stream": True,
                                                  "ignore_eos": True})
        text = (await r.read()).decode()
        assert r.status == 200 and text.endswith("data: [DONE]\n\n")
        first = record_writes[0][1]
        assert first.startswith(b"HTTP/1.1 200") and b"text/event-stream" in first and b"data: {" in first
        assert not any(w.startswith(b"HTTP/1.1") for _, w in record_writes[1:])
    finally:
        daemon.terminate()
        daemon.wait(15)


@pytest.mark.parametrize("max_tokens", [1, 6])
async def test_the_end_of_a_stream_leaves_in_one_write(ring_name, aiohttp_client, record_writes, max_tokens,
                                                       patient_headers):
    daemon = start_daemon(ring_name, 0.0)
    try:
        c = await client_for(ring_name, aiohttp_client)
        r = await c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": max_tokens, "stream": True,
                                                  "ignore_eos": True, "stream_options": {"include_usage": True}})
        text = (await r.read()).decode()
        assert r.status == 200 and text.endswith("data: [DONE]\n\n")
        last = record_writes[-1][1]
        # the chunk with finish_reason, the usage-only chunk, [DONE], then the terminating zero-size chunk
        assert b'"finish_reason":"length"' in last and b'"usage":{"prompt_tokens":3' in last
        assert last.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        assert not any(b"[DONE]" in w or b'"finish_reason":"length"' in w for _, w in record_writes[:-1])
        if max_tokens == 1:   # the only token is also the last: headers, chunk and end in one write
            assert len(record_writes) == 1 and last.startswith(b"HTTP/1.1 200")
    finally:
        daemon.terminate()
        daemon.wait(15)


async def test_headers_go_alone_when_the_first_token_is_late(ring_name, aiohttp_client, record_writes):
    daemon = start_daemon(ring_name, 300.0)   # one 0.3 s step before the first token
    try:
        c = await client_for(ring_name, aiohttp_client)
        t0 = time.monotonic()
        r = await c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "stream": True,
                                                  "ignore_eos": True})
        t_headers = time.monotonic() - t0   # the client has the status line and headers
        assert r.status == 200
        text = (await r.read()).decode()
        assert text.endswith("data: [DONE]\n\n")
        (t_first, first), (t_second, second) = record_writes[:2]
        assert first.startswith(b"HTTP/1.1 200") and b"data:" not in first
        assert b"data: {" in second and t_second - t_first > 0.1
        assert t_headers < 0.25   # about SSE_HEADERS_WAIT_S, well before the 0.3 s step (2-core slack)
    finally:
        daemon.terminate()
        daemon.wait(15)


async def stream(c, **body) -> tuple[str, list[dict]]:
    import json
    r = await c.post("/v1/completions", json={"prompt": [1000, 2345, 3456, 4567], "stream": True, "ignore_eos": True,
                                              "stream_options": {"include_usage": True}, **body})
    assert r.status == 200
    raw = (await r.read()).decode()
    events = [e[6:] for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return raw, [json.loads(e) for e in events[:-1]]


def sink_counter(monkeypatch) -> list[int]:
    """How many events the direct path wrote (the sink's True answers that wrote a chunk)."""
    from dpu_frontend import stream_push
    written = []
    real = stream_push.DirectSink.__call__

    def counting(self, batch):
        before = self.events
        ok = real(self, batch)
        written.extend([1] * (self.events - before))
        return ok
    monkeypatch.setattr(stream_push.DirectSink, "__call__", counting)
    return written


async def test_direct_path_writes_mid_stream_chunks_the_same_as_the_handler(ring_name, aiohttp_client, monkeypatch):
    from dpu_frontend import stream_push
    daemon = start_daemon(ring_name, 2.0)   # one token per 2 ms step: the handler is parked between them
    try:
        c = await client_for(ring_name, aiohttp_client)
        written = sink_counter(monkeypatch)
        _, direct = await stream(c, max_tokens=40)
        assert len(written) > 20
        monkeypatch.setattr(stream_push.DirectSink, "usable", staticmethod(lambda *a: False))
        written.clear()
        _, handler = await stream(c, max_tokens=40)
        assert written == []

        def text(events):
            return "".join(e["choices"][0]["text"] for e in events if e["choices"])
        assert text(direct) == text(handler) and len(text(direct)) > 0
        for events in (direct, handler):
            assert events[-2]["choices"][0]["finish_reason"] == "length"
            assert events[-1]["usage"]["completion_tokens"] == 40 and events[-1]["choices"] == []
            mid = [e for e in events[:-2]]
            assert all(e["id"] == events[0]["id"] and e["choices"][0]["finish_reason"] is None for e in mid)
    finally:
        daemon.terminate()
        daemon.wait(15)


async def test_direct_path_stays_off_for_stop_strings_and_continuous_usage(ring_name, aiohttp_client, monkeypatch):
    daemon = start_daemon(ring_name, 2.0)
    try:
        c = await client_for(ring_name, aiohttp_client)
        written = sink_counter(monkeypatch)
        _, events = await stream(c, max_tokens=20, stop=["zzzz"])
        _, events2 = await stream(c, max_tokens=20, stream_options={"include_usage": True,
                                                                     "continuous_usage_stats": True})
        assert written == []
        assert events[-1]["usage"]["completion_tokens"] == 20 and events2[-1]["usage"]["completion_tokens"] == 20
        assert all(e.get("usage") for e in events2)
    finally:
        daemon.terminate()
        daemon.wait(15)


async def test_a_failure_on_the_direct_path_ends_the_stream_with_an_error_event(ring_name, aiohttp_client,
                                                                                monkeypatch, caplog):
    import json
    import logging

    from dpu_frontend import stream_push
    daemon = start_daemon(ring_name, 2.0)
    try:
        c = await client_for(ring_name, aiohttp_client)

        class BrokenEncoder:
            def encode(self, text, *more):
                raise RuntimeError("encoder bug")
            encode_timed = encode

        real_init = stream_push.DirectSink.__init__

        def init(self, request, handle, detok, encoder, timing):
            real_init(self, request, handle, detok, BrokenEncoder(), timing)
        monkeypatch.setattr(stream_push.DirectSink, "__init__", init)
        with caplog.at_level(logging.ERROR):
            r = await c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 50, "stream": True,
                                                      "ignore_eos": True})
            raw = (await r.read()).decode()
        events = [e[6:] for e in raw.split("\n\n") if e]
        assert r.status == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == 500
        assert any("RuntimeError" in rec.getMessage() for rec in caplog.records)
        monkeypatch.undo()
        _, events = await stream(c, max_tokens=5)   # the next request is served normally
        assert events[-1]["usage"]["completion_tokens"] == 5
    finally:
        daemon.terminate()
        daemon.wait(15)


async def test_a_client_that_stops_reading_is_caught_with_the_direct_path_on(ring_name, aiohttp_client):
    """The direct path stops at DIRECT_MAX_BUFFER queued bytes and leaves the rest to the handler,
    whose blocked write the stall watch sees: the request is cancelled, its slot comes back."""
    import socket

    from frontend_procs import metric
    daemon = start_daemon(ring_name, 0.0)
    sock = None
    try:
        app = create_app(FrontendConfig(ring_name=ring_name, model="null", startup_timeout_s=20, stall_timeout_s=1.0),
                         tokenizer=smollm2())
        c = await aiohttp_client(app)
        deadline = time.monotonic() + 20
        while (await c.get("/health")).status != 200 and time.monotonic() < deadline:
            pass
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        sock.connect(("127.0.0.1", c.port))
        body = (b'{"prompt": [46778, 45855, 39910, 40672], "max_tokens": 8000, "ignore_eos": true, '
                b'"stream": true}')
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        key = 'blink_requests_total'
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            page = await (await c.get("/metrics")).text()
            try:
                if metric(page, key, endpoint="completions", outcome="stalled") == 1:
                    break
            except KeyError:
                pass
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("the stalled request was not cancelled")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            page = await (await c.get("/metrics")).text()
            if metric(page, "blink_held_slots") == 0:
                break
            await asyncio.sleep(0.2)
        assert metric(page, "blink_held_slots") == 0
    finally:
        if sock is not None:
            sock.close()
        daemon.terminate()
        daemon.wait(15)
