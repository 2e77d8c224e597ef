"""One streamed OpenAI /v1/completions request, timed the way `vllm bench serve` times it.

    WorkRequest -> send_completion(session, endpoint, ...) -> RequestRecord
        t0 = perf_counter() just before the POST
        each SSE `data:` chunk with a non-empty `choices` (text or not, as vLLM
          counts them): first -> TTFT, later ones -> one ITL gap each
        a usage chunk -> completion/prompt token counts (else: max_tokens when the
          server says finish_reason "length", else re-tokenize the text, as vLLM does)
        E2E = the last such chunk (vLLM's `latency`); an HTTP error, a broken
          stream, an error event or the timeout -> failure

`first_token_seconds` is the blocking one-request TTFT probe the prefill and prefix-cache
benchmarks use (one request at a time, no event loop).

The request asks for a fixed output length (max_tokens, ignore_eos) and the
server's usage numbers (stream_options.include_usage); `extra_body` adds what a
particular server needs (llama.cpp: logit_bias against EOS when it ignores ignore_eos).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any, Callable

import aiohttp

from .metrics import RequestRecord
from .workload import WorkRequest


@dataclasses.dataclass(frozen=True)
class Endpoint:
    base_url: str                     # http://127.0.0.1:8000
    model: str                        # the name the server answers to
    extra_body: tuple[tuple[str, Any], ...] = ()   # per-server request fields
    usage_in_stream: bool = True      # send stream_options.include_usage
    completions_path: str = "/v1/completions"

    @property
    def completions_url(self) -> str:
        return self.base_url.rstrip("/") + self.completions_path


def request_body(ep: Endpoint, req: WorkRequest) -> dict:
    body: dict[str, Any] = {"model": ep.model, "prompt": req.prompt, "max_tokens": req.output_tokens,
                            "temperature": 0.0, "stream": True, "ignore_eos": True}
    if ep.usage_in_stream:
        body["stream_options"] = {"include_usage": True}
    body.update(dict(ep.extra_body))
    return body


async def send_completion(session: aiohttp.ClientSession, ep: Endpoint, req: WorkRequest, timeout_s: float,
                          count_tokens: Callable[[str], int] | None = None) -> RequestRecord:
    """Send one streamed completion and time it; never raises for server or network trouble."""
    rec = RequestRecord(prompt_tokens=req.prompt_tokens, max_tokens=req.output_tokens)
    text_parts: list[str] = []
    t0 = time.perf_counter()
    rec.t_send_s = t0
    last = t0
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(ep.completions_url, json=request_body(ep, req)) as resp:
                if resp.status != 200:
                    body = (await resp.text())[:300]
                    rec.error = f"HTTP {resp.status}: {body}"
                    return rec
                buf = b""
                async for piece in resp.content.iter_any():
                    buf += piece
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        done = _handle_event(event, rec, text_parts, t0, last)
                        if done is _DONE:
                            buf = b""
                            break
                        if done is not None:
                            last = done
                if buf.strip():
                    _handle_event(buf, rec, text_parts, t0, last)
        rec.e2e_s = last - t0
    except TimeoutError:
        rec.timed_out = True
        rec.error = f"timeout after {timeout_s:g} s"
        return rec
    except (aiohttp.ClientError, ConnectionError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    if rec.error:
        return rec
    if rec.ttft_s is None:
        rec.error = "stream ended without any text"
        return rec
    if not rec.output_tokens:
        if rec.finish_reason == "length":
            # Stopped by max_tokens: exactly that many, whatever the text re-tokenizes to.
            rec.output_tokens = req.output_tokens
        else:
            text = "".join(text_parts)
            rec.output_tokens = count_tokens(text) if count_tokens else 1 + len(rec.itl_s)
    rec.success = True
    return rec


_DONE = object()


def _handle_event(event: bytes, rec: RequestRecord, text_parts: list[str], t0: float, last: float):
    """Apply one SSE event; returns the time of its last chunk with choices, _DONE, or None."""
    now = time.perf_counter()
    result = None
    for line in event.split(b"\n"):
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return _DONE
        data = json.loads(payload)
        if "error" in data and not data.get("choices"):
            err = data["error"]
            rec.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
            continue
        choices = data.get("choices") or []
        if choices:
            c = choices[0]
            text = c.get("text")
            if text is None:
                text = (c.get("delta") or {}).get("content")
            if c.get("finish_reason"):
                rec.finish_reason = c["finish_reason"]
            if rec.ttft_s is None:
                rec.ttft_s = now - t0
            else:
                rec.itl_s.append(now - last)
            text_parts.append(text or "")
            result = last = now
        usage = data.get("usage")
        if isinstance(usage, dict):
            if usage.get("completion_tokens") is not None:
                rec.output_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                rec.server_prompt_tokens = int(usage["prompt_tokens"])
    return result


def first_token_seconds(base_url: str, path: str, body: dict, timeout_s: float = 900.0) -> float:
    """Seconds from POSTing one streamed request (`body` gets stream: true) to its first chunk
    that carries output: text or content, or a finish_reason (a chat stream's role-only
    opening chunk does not count)."""
    import http.client
    import urllib.parse
    u = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    try:
        t0 = time.perf_counter()
        conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        while True:
            line = resp.readline()
            if not line:
                raise RuntimeError("the stream ended before a chunk")
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            choices = json.loads(line[5:]).get("choices") or []
            c = choices[0] if choices else {}
            if c.get("text") is not None or (c.get("delta") or {}).get("content") is not None \
                    or c.get("finish_reason"):
                return time.perf_counter() - t0
    finally:
        conn.close()
