"""What clients see when the backend is absent, dies, or has no free slot: 503 / 429 with Retry-After."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import aiohttp
import pytest

from frontend_procs import REPO, Serve, blink, free_port, http_get, metric, pid_alive

pytestmark = pytest.mark.timeout(120)


def wait_for(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def post(base: str, path: str, body: dict) -> tuple[int, dict, dict]:
    import urllib.error
    import urllib.request
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def test_frontend_without_backend_answers_503_until_one_comes(ring_name):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    fe = subprocess.Popen([*blink(), "frontend", "--ring", ring_name, "--model", "null", "--port", str(port),
                           "--startup-timeout-s", "0", "--heartbeat-timeout-s", "0.5"], cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    daemon = None
    try:
        wait_for(lambda: http_get(base + "/v1/models")[0] == 200, 30, "the frontend to listen")
        status, body, headers = http_get(base + "/health")
        assert status == 503 and "Retry-After" in headers and json.loads(body)["error"]["code"] == 503
        status, err, headers = post(base, "/v1/completions", {"prompt": "hi"})
        assert status == 503 and "Retry-After" in headers and err["error"]["type"] == "ServiceUnavailableError"

        daemon = subprocess.Popen([*blink(), "gpu-daemon", "--ring", ring_name, "--model", "null"], cwd=REPO,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: http_get(base + "/health")[0] == 200, 30, "the backend to become healthy")
        status, r, _ = post(base, "/v1/completions", {"prompt": [5, 6], "max_tokens": 3, "ignore_eos": True})
        assert status == 200 and r["usage"]["completion_tokens"] == 3

        daemon.kill()
        daemon.wait()
        wait_for(lambda: http_get(base + "/health")[0] == 503, 10, "/health to notice the dead backend")
        status, err, headers = post(base, "/v1/completions", {"prompt": "hi"})
        assert status == 503 and "Retry-After" in headers
    finally:
        for p in (daemon, fe):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(15)
    assert fe.returncode == 0


async def test_no_free_slot_gives_429_and_cancelled_waiters_free_their_slots():
    ring = f"blink-test-c1slots-{os.getpid()}"
    with Serve(ring, "--model", "null", "--slots", "2", "--heartbeat-timeout-s", "30",
               "--queue-timeout-s", "0.3") as s:
        await _no_free_slot(s)


async def _no_free_slot(s: Serve):
    daemon = s.backend_pid()
    try:
        os.kill(daemon, signal.SIGSTOP)   # the daemon takes nothing: both slots stay pending

        async def hold(session, prompt):
            async with session.post(s.base + "/v1/completions",
                                    json={"prompt": prompt, "max_tokens": 50, "stream": True,
                                          "ignore_eos": True}) as r:
                return r.status, (await r.read()).decode()

        async with aiohttp.ClientSession() as session:
            keeper = asyncio.ensure_future(hold(session, [101, 102, 103]))
            leaver = asyncio.ensure_future(hold(session, [201, 202]))
            await asyncio.to_thread(wait_for, lambda: metric(s.metrics(), "blink_requests_inflight") == 2, 10,
                                    "both slots taken")
            async with session.post(s.base + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
                assert (await r.json())["error"]["code"] == 429
            leaver.cancel()   # this client hangs up while its request is still pending in the ring
            await asyncio.gather(leaver, return_exceptions=True)
            await asyncio.to_thread(wait_for, lambda: metric(s.metrics(), "blink_requests_inflight") == 1, 10,
                                    "the cancelled request to let go")
            os.kill(daemon, signal.SIGCONT)
            status, text = await keeper
        assert status == 200 and text.endswith("data: [DONE]\n\n")
        chunks = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        page = s.metrics()
        wait_for(lambda: metric(s.metrics(), "blink_slots", state="EMPTY") == 2, 10, "both slots free")
        assert metric(page, "blink_requests_total", endpoint="completions", outcome="rate_limited") == 1
    finally:
        if pid_alive(daemon):
            os.kill(daemon, signal.SIGCONT)
        assert s.stop() == 0, s.output


async def test_daemon_stopping_mid_request_gives_503_not_500(ring_name):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    daemon = subprocess.Popen([*blink(), "gpu-daemon", "--ring", ring_name, "--model", "null",
                               "--shutdown-grace-s", "0"], cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    fe = subprocess.Popen([*blink(), "frontend", "--ring", ring_name, "--model", "null", "--port", str(port),
                           "--heartbeat-timeout-s", "1"], cwd=REPO, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    try:
        await asyncio.to_thread(wait_for, lambda: http_get(base + "/health")[0] == 200, 30, "healthy")
        os.kill(daemon.pid, signal.SIGSTOP)   # requests stay in the ring until the daemon goes
        body = {"prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True}
        async with aiohttp.ClientSession() as s:
            async def plain():
                async with s.post(base + "/v1/completions", json=body) as r:
                    return r.status, await r.json(), r.headers.get("Retry-After")

            async def streamed():
                async with s.post(base + "/v1/completions", json={**body, "stream": True}) as r:
                    return r.status, (await r.read()).decode()

            tasks = [asyncio.ensure_future(plain()), asyncio.ensure_future(streamed())]
            await asyncio.sleep(0.5)
            os.kill(daemon.pid, signal.SIGTERM)
            os.kill(daemon.pid, signal.SIGCONT)
            (status, err, retry), (sstatus, text) = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert status == 503 and err["error"]["code"] == 503 and retry is not None, err
        events = [e for e in text.split("\n\n") if e]
        assert sstatus == 200 and events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == 503
    finally:
        for p in (daemon, fe):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
                p.wait(15)
