"""The reply of a chat request with tools: message.tool_calls, finish_reason "tool_calls", and stream deltas.

    RequestHandle batches -> Detokenizer text
      named function (the output is its arguments, constrained by the daemon): streamed as OpenAI
        does, a first tool_calls delta with id, type and name, then argument fragments as they come
      required (a constrained JSON array of calls) / auto (the model's <tool_call> blocks):
        text held until it is known to be a call (auto streams plain content as soon as it
        cannot be one), the calls parsed at the end (structured/tools.calls) and sent as one
        delta each (id and name, then the arguments)
    -> one body (message.tool_calls, content null) or SSE chunks, then usage and [DONE]

A structure cut by max_tokens ends "length" with the text as content and no calls.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from shared_layout import now_ns

from . import openai_api as api
from .request_handle import RequestHandle
from .structured import tools

if TYPE_CHECKING:
    from .completions import Generation, GenerationService


async def respond(svc: "GenerationService", request: web.Request, gen: "Generation", handle: RequestHandle
                  ) -> web.StreamResponse:
    try:
        if gen.request.stream.stream:
            return await _stream(svc, request, gen, handle)
        return await _collect(svc, gen, handle)
    finally:
        if not handle.finished:
            handle.cancel()


def _outcome(svc, detok, handle, spec: tools.ToolSpec, text: str) -> tuple[str, list[tools.ToolCall], str | None]:
    finish, _ = svc._finish(detok, handle)
    if finish in ("error", "length", "abort"):
        return finish, [], text
    found, content = tools.calls(text, spec)
    return ("tool_calls" if found else finish), found, content


async def _collect(svc: "GenerationService", gen: "Generation", handle: RequestHandle) -> web.Response:
    detok = svc._detokenizer(gen)
    t_first = None
    async for batch in handle:
        t_first = t_first or now_ns()
        detok.feed(batch)
        if detok.finished:
            break
    text = detok.text + detok.flush()
    finish, found, content = _outcome(svc, detok, handle, gen.request.tools, text)
    if finish == "error":
        svc._observe(gen, svc._error_outcome(gen), t_first, detok.tokens_seen, handle)
        err = svc._error(gen, handle)
        return web.json_response(err.body(), status=err.status, headers=err.headers(), dumps=api.dumps)
    message = {"role": "assistant", "content": content}
    if found:
        message["tool_calls"] = [c.body() for c in found]
    body = {"id": gen.rid, "object": "chat.completion", "created": gen.created, "model": svc.model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish,
                         "stop_reason": None}],
            "usage": api.usage(len(gen.prompt_ids), detok.tokens_seen)}
    svc._observe(gen, finish, t_first, detok.tokens_seen, handle)
    return web.json_response(body, dumps=api.dumps)


async def _stream(svc: "GenerationService", request: web.Request, gen: "Generation", handle: RequestHandle
                  ) -> web.StreamResponse:
    from .completions import SSE_HEADERS, STREAM_STARTED, SseResponse

    spec: tools.ToolSpec = gen.request.tools
    opts = gen.request.stream
    resp = SseResponse(status=200, headers=SSE_HEADERS)
    detok = svc._detokenizer(gen)

    def chunk(delta: dict, finish: str | None = None) -> bytes:
        return api.sse(api.chat_chunk(gen.rid, gen.created, svc.model, delta, finish))

    named = tools.ToolCall(tools.new_id(), spec.named, "") if spec.choice == "function" else None
    held, content_mode, t_first, outcome = "", False, None, "client_disconnect"
    try:
        await resp.prepare(request)
        request[STREAM_STARTED] = resp
        await resp.write(chunk({"role": "assistant", "content": ""}))
        async for batch in handle:
            out = b""
            if t_first is None:
                t_first = now_ns()
                if named is not None:
                    out += chunk({"tool_calls": [{"index": 0, "id": named.id, "type": "function",
                                                  "function": {"name": named.name, "arguments": ""}}]})
            delta = detok.feed(batch)
            if named is not None:
                if delta.text:
                    out += chunk({"tool_calls": [{"index": 0, "function": {"arguments": delta.text}}]})
            elif content_mode:
                if delta.text:
                    out += chunk({"content": delta.text})
            else:
                held += delta.text
                lead = held.lstrip()
                if spec.choice == "auto" and lead and not (tools.TOOL_CALL_OPEN.startswith(lead)
                                                           or lead.startswith(tools.TOOL_CALL_OPEN)):
                    content_mode = True
                    out += chunk({"content": held})
                    held = ""
            if out:
                await resp.write(out)
            if delta.finished:
                break
        rest = detok.flush()
        text = held + rest
        tail = b""
        if named is not None:
            finish, _ = svc._finish(detok, handle)
            if rest:
                tail += chunk({"tool_calls": [{"index": 0, "function": {"arguments": rest}}]})
            if finish not in ("error", "length", "abort"):
                finish = "tool_calls"
        elif content_mode:
            finish, _ = svc._finish(detok, handle)
            if rest:
                tail += chunk({"content": rest})
        else:
            finish, found, content = _outcome(svc, detok, handle, spec, text)
            if content:
                tail += chunk({"content": content})
            for i, c in enumerate(found):
                tail += chunk({"tool_calls": [{"index": i, "id": c.id, "type": "function",
                                               "function": {"name": c.name, "arguments": ""}}]})
                tail += chunk({"tool_calls": [{"index": i, "function": {"arguments": c.arguments}}]})
        if finish == "error":
            tail += api.sse(svc._error(gen, handle).body())
        else:
            tail += chunk({}, finish)
        if opts.include_usage:
            tail += api.sse(api.usage_chunk("chat.completion.chunk", gen.rid, gen.created, svc.model,
                                            api.usage(len(gen.prompt_ids), detok.tokens_seen)))
        await resp.write_eof(tail + api.SSE_DONE)
        outcome = svc._error_outcome(gen) if finish == "error" else finish
    except ConnectionError:
        pass
    svc._observe(gen, outcome, t_first, detok.tokens_seen, handle)
    return resp
