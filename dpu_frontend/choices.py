"""n choices of one prompt (n, best_of): the group's ring parameters and its reply.

    SamplingParams of the request -> group_params: one per choice (choice i seeded seed + i, as
    vLLM does; with best_of > n every candidate also asks for its logprobs, to rank them)
    -> RingClient.submit_group (the daemon prefills once and forks) -> one handle per choice
    -> respond: collect every choice concurrently (each its own Detokenizer and logprobs),
       keep the n with the highest cumulative logprob when best_of > n, one body with
       choices[0..n-1] and usage over every generated token
    | stream: the handles' batches as they come, each chunk carrying its choice's `index`,
       a choice's finish chunk when it ends, then usage and [DONE] once all have ended

The single-choice path (completions.GenerationService) is left as it is: its hot loop
(pre-encoded deltas, chunks written by the token reader) never sees a group.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING

import numpy as np
from aiohttp import web

from shared_layout import now_ns
from shared_layout.layout import decode_logprob_records

from . import logprobs_format as lpf
from . import openai_api as api
from .detokenizer import Delta
from .request_handle import RequestHandle, SamplingParams

if TYPE_CHECKING:
    from .completions import Generation, GenerationService

_SEED_MASK = (1 << 64) - 1


def group_params(params: SamplingParams, s: api.SamplingOptions) -> list[SamplingParams]:
    """The ring parameters of each of the best_of choices."""
    out = []
    for i in range(s.best_of):
        p = params
        if p.seed is not None:
            p = dataclasses.replace(p, seed=(p.seed + i) & _SEED_MASK)
        if s.best_of > s.n and p.logprobs is None:
            p = dataclasses.replace(p, logprobs=0)     # the sampled token's logprob: the ranking needs it
        out.append(p)
    return out


@dataclasses.dataclass
class _Choice:
    """One choice's reply as its batches arrive."""
    detok: object
    logprobs: lpf.ReplyLogprobs | None
    cumulative: float = 0.0
    started: bool = False
    closed: bool = False

    def feed(self, svc: "GenerationService", gen: "Generation", handle: RequestHandle, batch: list[int]
             ) -> tuple[Delta, dict | None, str]:
        """(delta, logprobs piece, echoed prompt text) for one batch."""
        echo_text, echo_lp = "", None
        if not self.started:
            self.started = True
            if gen.echoes:
                echo_text = svc._echo_text(gen)
                echo_lp = svc._echo_logprobs(gen, handle, self.logprobs) if gen.echo else None
        if gen.echo_only:
            return Delta(""), echo_lp, echo_text
        n0 = self.detok.tokens_seen
        delta = self.detok.feed(batch)
        used = self.detok.tokens_seen - n0
        records = None if handle.batch_logprobs is None else handle.batch_logprobs[:used]
        if records is not None and records.size:
            k = lpf.record_k(records)
            lp = decode_logprob_records(records.reshape(-1), k)[0]
            self.cumulative += float(np.nan_to_num(lp, nan=0.0).sum())
        piece = self.logprobs.add(batch[:used], records) if self.logprobs is not None else None
        if echo_lp is not None:
            piece = lpf.merge_completion(echo_lp, piece) if piece is not None else echo_lp
        return delta, piece, echo_text


def _choice(svc: "GenerationService", gen: "Generation") -> _Choice:
    return _Choice(svc._detokenizer(gen), svc._reply_logprobs(gen))


async def respond(svc: "GenerationService", request: web.Request, gen: "Generation",
                  handles: list[RequestHandle]) -> web.StreamResponse:
    """Stream or collect a group's reply; always leaves every handle finished or cancelled."""
    timer = None
    if gen.deadline_s is not None:
        timer = asyncio.get_running_loop().call_at(gen.deadline_s, _expire, svc, gen, handles)
    try:
        if gen.request.stream.stream:
            return await _stream(svc, request, gen, handles)
        return await _collect(svc, gen, handles)
    finally:
        if timer is not None:
            timer.cancel()
        for h in handles:
            if not h.finished:
                h.cancel()


def _expire(svc: "GenerationService", gen: "Generation", handles: list[RequestHandle]) -> None:
    for h in handles:
        svc._expire(gen, h)


def _finish(svc: "GenerationService", gen: "Generation", c: _Choice, handle: RequestHandle):
    finish, stop_reason = svc._finish(c.detok, handle)
    if gen.echo_only and finish != "error":
        finish, stop_reason = "length", None
    return finish, stop_reason


async def _collect(svc: "GenerationService", gen: "Generation", handles: list[RequestHandle]) -> web.Response:
    t_first = None

    async def one(handle: RequestHandle) -> tuple[_Choice, api.Choice]:
        nonlocal t_first
        c = _choice(svc, gen)
        text = ""
        async for batch in handle:
            if t_first is None:
                t_first = now_ns()
            delta, _, echo_text = c.feed(svc, gen, handle, batch)
            text += echo_text + delta.text
            if c.detok.finished:
                break
        finish, stop_reason = _finish(svc, gen, c, handle)
        text += c.detok.flush()
        return c, api.Choice(text, finish, stop_reason, None if c.logprobs is None else c.logprobs.total)

    done = await asyncio.gather(*(one(h) for h in handles))
    tokens = sum(c.detok.tokens_seen for c, _ in done)
    failed = next((i for i, (_, ch) in enumerate(done) if ch.finish_reason == "error"), None)
    if failed is not None:
        svc._observe(gen, svc._error_outcome(gen), t_first, tokens, handles[failed])
        err = svc._error(gen, handles[failed])
        return web.json_response(err.body(), status=err.status, headers=err.headers(), dumps=api.dumps)
    s = gen.request.sampling
    if s.best_of > s.n:   # the n candidates with the highest cumulative logprob, best first
        done = sorted(done, key=lambda d: -d[0].cumulative)[:s.n]
    body_n = api.chat_body_n if gen.endpoint.chat else api.completion_body_n
    extras = svc._extras(gen, handles[0])
    if gen.endpoint.chat:
        extras["role"] = gen.role
    body = body_n(gen.rid, gen.created, svc.model, [ch for _, ch in done],
                  api.usage(len(gen.prompt_ids), tokens), **extras)
    svc._observe(gen, done[0][1].finish_reason, t_first, tokens, handles[0])
    return web.json_response(body, dumps=api.dumps)


async def _stream(svc: "GenerationService", request: web.Request, gen: "Generation",
                  handles: list[RequestHandle]) -> web.StreamResponse:
    from .completions import SSE_HEADERS, STREAM_STARTED, SseResponse

    ep, opts = gen.endpoint, gen.request.stream
    chunk = api.chat_chunk if ep.chat else api.completion_chunk
    resp = SseResponse(status=200, headers=SSE_HEADERS)
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, h: RequestHandle) -> None:
        try:
            async for batch in h:
                queue.put_nowait((i, batch, h.batch_logprobs))
        finally:
            queue.put_nowait((i, None, None))

    cs = [_choice(svc, gen) for _ in handles]
    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    n_prompt = len(gen.prompt_ids)
    t_first = None
    outcome = "client_disconnect"
    failed = None

    def tokens() -> int:
        return sum(c.detok.tokens_seen for c in cs)

    try:
        await resp.prepare(request)
        request[STREAM_STARTED] = resp
        while not all(c.closed for c in cs):
            i, batch, records = await queue.get()
            c, h = cs[i], handles[i]
            if c.closed:
                continue
            out = b""
            if batch is None:      # the handle ended after its last batch was sent
                finish, stop_reason = _finish(svc, gen, c, h)
                if finish == "error":
                    failed = i
                    break
                c.closed = True
                text = c.detok.flush()
                payload = ({"content": text} if text else {}) if ep.chat else text
                out = api.sse(chunk(gen.rid, gen.created, svc.model, payload, finish, stop_reason, index=i))
                await resp.write(out)
                continue
            extras = None
            if t_first is None:
                t_first = now_ns()
                extras = svc._extras(gen, h) or None     # prompt_logprobs: on the stream's first chunk
            if ep.chat and not c.started:   # each choice's first chat chunk carries the role
                first = chunk(gen.rid, gen.created, svc.model, {"role": gen.role, "content": ""}, index=i)
                out += api.sse({**first, **extras} if extras else first)
                extras = None
            h.batch_logprobs = records
            delta, piece, echo_text = c.feed(svc, gen, h, batch)
            text = echo_text + delta.text
            finish = stop_reason = None
            if delta.finished or gen.echo_only:
                c.closed = True
                text += c.detok.flush()
                finish, stop_reason = _finish(svc, gen, c, h)
                if not h.finished:
                    h.cancel()      # a stop string ended it here: the daemon stops this choice
            usage = api.usage(n_prompt, tokens()) if opts.continuous_usage else None
            payload = ({"content": text} if text or not finish else {}) if ep.chat else text
            body = chunk(gen.rid, gen.created, svc.model, payload, finish, stop_reason, usage, logprobs=piece, index=i)
            if extras:
                body["choices"][0].update(extras)      # completions: prompt_logprobs on the choice, as in the body
            out += api.sse(body)
            await resp.write(out)
        tail = b""
        if failed is not None:
            tail += api.sse(svc._error(gen, handles[failed]).body())
        elif opts.include_usage:
            tail += api.sse(api.usage_chunk(ep.chunk_object, gen.rid, gen.created, svc.model,
                                            api.usage(n_prompt, tokens())))
        await resp.write_eof(tail + api.SSE_DONE)
        outcome = svc._error_outcome(gen) if failed is not None else "stop"
    except ConnectionError:
        pass
    finally:
        for t in tasks:
            t.cancel()
    svc._observe(gen, outcome, t_first, tokens(), handles[0])
    return resp
