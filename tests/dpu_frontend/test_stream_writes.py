"""What a stream puts on the socket, in-process over a real null daemon: the SSE headers leave
with the first chunk in one write, or alone once SSE_HEADERS_WAIT_S passed without a token."""
from __future__ import annotations

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

        def write(data):
            writes.append((time.monotonic(), bytes(data)))
            return inner(data)
        transport.write = write

    monkeypatch.setattr(completions, "limit_send_buffer", wrap)
    return writes


async def test_headers_leave_with_the_first_chunk(ring_name, aiohttp_client, record_writes):
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
