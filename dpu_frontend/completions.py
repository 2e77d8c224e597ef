"""The two generation endpoints: /v1/completions and /v1/chat/completions.

    body -> parse_* (openai_api) -> prompt ids (chat template, tokenizer; off the loop
    when long), bad words tokenized, a structured-output constraint compiled to its token
    automaton (structured/, cached) -> max_tokens resolved against the context
    -> RingClient.submit (the sampling surface rides in the slot) -> RequestHandle batches
    (+ the daemon's logprob records) -> Detokenizer deltas (+ logprobs_format objects for
    the tokens each delta consumed; an echo opens the reply with the prompt) -> SSE chunks
    | one JSON body (mid-stream chunks of a plain stream: written by the token reader itself,
    stream_push.py); a chat request with tools replies through tool_reply.py (tool_calls)

A stop string or an EOS / stop-id token seen here ends the reply at once and
cancels the handle, so the daemon stops generating within a step. A client that
goes away (write fails, or aiohttp cancels the handler) cancels the handle too:
its slot comes back as soon as the daemon completes it. Limits (limits.py): the
body is read within the request's deadline; the slot wait is capped by it; at
the deadline the handle is aborted (504, or an error event in a stream); a
client whose socket stays full for stall_timeout_s loses its request and its
connection.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import traceback

from aiohttp import web

from shared_layout import ErrorCode, now_ns
from shared_layout.extra import MAX_BAD_WORD_TOKENS, SamplingExtra

from . import choices
from . import logprobs_format as lpf
from . import openai_api as api
from . import token_reader, tool_reply
from .detokenizer import Delta
from .limits import RequestLimits, StallWatch, has_lone_surrogate, limit_send_buffer
from .metrics import FrontendMetrics
from .openai_api import ApiError, ChatRequest, CompletionRequest
from .ring_client import (BackendUnavailable, InvalidRequest, PromptTooLong, QueueFull, RequestHandle,
                          RingClient, SamplingParams)
from .stream_push import DirectSink
from .structured import tools as tool_calls
from .tokenizer import ChatTemplateError, ModelTokenizer

log = logging.getLogger(__name__)

# Set on the request once SSE headers are out: the error middleware must not answer twice.
STREAM_STARTED = (web.RequestKey("stream_started", web.StreamResponse) if hasattr(web, "RequestKey")
                  else "blink.stream_started")   # aiohttp < 3.12 has no typed request keys

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
# A stream's headers wait this long for its first chunk, to leave with it in one send; a longer
# prefill gets them alone at this point, so clients still see the reply start promptly.
SSE_HEADERS_WAIT_S = 0.05


class SseResponse(web.StreamResponse):
    """A streamed reply whose headers are buffered until the first write (aiohttp's buffered-
    headers path, as web.Response uses): headers and first chunk in one send, not two."""
    _send_headers_immediately = False


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """What differs between the two endpoints' replies."""
    name: str                # metrics label
    id_prefix: str           # cmpl / chatcmpl
    chunk_object: str        # text_completion / chat.completion.chunk
    chat: bool


COMPLETIONS = Endpoint("completions", "cmpl", "text_completion", False)
CHAT = Endpoint("chat", "chatcmpl", "chat.completion.chunk", True)


@dataclasses.dataclass
class Generation:
    """Everything the HTTP layer needs for one request after validation."""
    endpoint: Endpoint
    request: CompletionRequest | ChatRequest
    prompt_ids: list[int]
    rid: str
    created: int
    t_arrival_ns: int
    deadline_s: float | None = None   # event-loop clock; None: no deadline
    timed_out: bool = False           # the deadline aborted the handle
    stalled: bool = False             # the client stopped reading
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    echo_only: bool = False           # echo with max_tokens 0: the prompt alone (one token is generated, unused)
    automaton: bytes = b""            # the structured-output constraint's ring words (structured/compiler.py)

    @property
    def echo(self) -> bool:
        """A completions echo: the prompt (with its logprobs when asked) opens the reply."""
        return isinstance(self.request, CompletionRequest) and self.request.echo

    @property
    def echoes(self) -> bool:
        """The reply opens with echoed text: the prompt (completions) or the last message (chat)."""
        return self.request.echo

    @property
    def role(self) -> str:
        """A chat reply's role (the last message's when there is no generation prompt, as vLLM does)."""
        return self.request.reply_role


class GenerationService:
    """Turns validated requests into ring submissions and replies; one per app."""

    def __init__(self, client: RingClient, tokenizer: ModelTokenizer, metrics: FrontendMetrics,
                 served_model: str, queue_timeout_s: float, max_tokens_default: int | None,
                 max_stop_strings: int = 32, expose_backend_timing: bool = False,
                 request_limits: RequestLimits | None = None, log_prompts: bool = False):
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.model = served_model
        self.request_limits = request_limits or RequestLimits(queue_timeout_s=queue_timeout_s)
        self.queue_timeout_s = queue_timeout_s
        self.max_tokens_default = max_tokens_default
        self.limits = api.ApiLimits(served_model, tokenizer.vocab_size, max_stop_strings,
                                    self.request_limits.max_tokens_limit or api.MAX_I32)
        self.expose_backend_timing = expose_backend_timing
        self.log_prompts = log_prompts
        self.token_text = lpf.TokenText(tokenizer.decode)
        self._compiler = None          # structured.compiler.ConstraintCompiler, made on the first constraint

    # -- request preparation ---------------------------------------------------
    async def prepare(self, endpoint: Endpoint, body, request_id_header: str | None,
                      t_arrival_ns: int, deadline_s: float | None = None) -> Generation:
        if endpoint.chat:
            req = api.parse_chat(body, self.limits)
        else:
            req = api.parse_completion(body, self.limits)
        t0 = time.perf_counter()
        prompt_ids = await self._prompt_ids(req)
        self.metrics.tokenize.observe(time.perf_counter() - t0)
        param = "messages" if endpoint.chat else "prompt"
        if not prompt_ids:
            raise api.bad_request("the prompt is empty after tokenization", param)
        cap = self.request_limits.max_prompt_tokens
        if cap is not None and len(prompt_ids) > cap:
            raise api.bad_request(f"the prompt has {len(prompt_ids)} tokens; this server accepts at most {cap}",
                                  param)
        gen = Generation(endpoint, req, prompt_ids, api.request_id(endpoint.id_prefix, request_id_header),
                         int(time.time()), t_arrival_ns, deadline_s,
                         bad_words_ids=self._bad_words_ids(req.sampling.bad_words))
        if req.sampling.constraint is not None:
            gen.automaton = await self._compile(req.sampling.constraint)
        if self.log_prompts:   # debug setting: prompts are user data and stay out of logs otherwise
            log.info("request %s prompt (%d tokens): %r", gen.rid, len(prompt_ids),
                     self.tokenizer.decode(prompt_ids, skip_special_tokens=False))
        return gen

    async def _compile(self, constraint) -> bytes:
        """The constraint's token automaton (a 400 naming the parameter when it cannot be built)."""
        from .structured.compiler import ConstraintCompiler    # outlines-core: loaded on first use
        from .structured.request import ConstraintError
        if self._compiler is None:
            eos = min(self.tokenizer.eos_ids) if self.tokenizer.eos_ids else 0
            self._compiler = ConstraintCompiler(self.tokenizer.tokenizer, eos)
        try:
            return (await self._compiler.compile(constraint)).words
        except ConstraintError as e:
            raise api.bad_request(str(e), e.param) from None

    def _bad_words_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """vLLM's tokenization of bad words: each word alone, and with a leading space where that
        makes a different first token of the same length (a word inside text)."""
        out: list[tuple[int, ...]] = []
        for word in words:
            plain = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            for ids in (plain, spaced):
                if ids is spaced and (not ids or ids[0] == plain[0] or len(ids) != len(plain)):
                    continue
                if not 1 <= len(ids) <= MAX_BAD_WORD_TOKENS:
                    raise api.bad_request(f"bad word {word[:40]!r} is {len(ids)} tokens; at most "
                                          f"{MAX_BAD_WORD_TOKENS} are allowed", "bad_words")
                out.append(ids)
        return tuple(out)

    async def _prompt_ids(self, req: CompletionRequest | ChatRequest) -> list[int]:
        tok = self.tokenizer
        if isinstance(req, CompletionRequest):
            if isinstance(req.prompt, tuple):
                return list(req.prompt)
            return await tok.encode_async(req.prompt, req.add_special_tokens)
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        if req.tools is not None or any(m.tool_calls or m.role == "tool" for m in req.messages):
            messages = tool_calls.render_messages(
                [{"role": m.role, "content": m.content, "tool_calls": m.tool_calls} for m in req.messages], req.tools)
        try:
            text = tok.render_chat(messages, req.add_generation_prompt, req.continue_final_message,
                                   **dict(req.chat_template_kwargs))
        except ChatTemplateError as e:
            raise api.bad_request(str(e), "messages") from None
        return await tok.encode_async(text, req.add_special_tokens)

    async def submit(self, gen: Generation) -> RequestHandle:
        s = gen.request.sampling
        max_len = self.client.model_max_len
        if not max_len:
            health = self.client.health()
            raise ApiError(503, f"backend not ready: {health.message or health.status}", retry_after_s=1.0)
        param = "max_completion_tokens" if gen.endpoint.chat else "max_tokens"
        default = self.max_tokens_default
        if default is None and not gen.endpoint.chat:
            default = api.COMPLETIONS_DEFAULT_MAX_TOKENS
        cap = self.request_limits.max_tokens_limit
        if cap is not None:
            if s.max_tokens is not None and s.max_tokens > cap:
                raise api.bad_request(f"'{param}' is too large: {s.max_tokens}; this server generates at most "
                                      f"{cap} tokens per request", param)
            default = cap if default is None else min(default, cap)
        if s.max_tokens == 0:                    # echo alone: one token is generated and dropped
            gen.echo_only = True
            api.resolve_max_tokens(1, len(gen.prompt_ids), max_len, default, param)
            max_tokens = 1
        else:
            max_tokens = api.resolve_max_tokens(s.max_tokens, len(gen.prompt_ids), max_len, default, param)
        if s.min_tokens > max_tokens:
            raise api.bad_request(f"'min_tokens' ({s.min_tokens}) exceeds the {max_tokens} tokens this request "
                                  "may generate", "min_tokens")
        params = SamplingParams(max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                seed=s.seed, ignore_eos=s.ignore_eos, stop_token_ids=s.stop_token_ids,
                                presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                                repetition_penalty=s.repetition_penalty, min_p=s.min_p,
                                min_tokens=min(s.min_tokens, max_tokens), logprobs=s.logprobs,
                                prompt_logprobs=s.prompt_logprobs if len(gen.prompt_ids) > 1 else None,
                                extra=SamplingExtra(s.logit_bias, s.allowed_token_ids, gen.bad_words_ids,
                                                    gen.automaton),
                                priority=s.priority, ttft_slo_ms=s.ttft_slo_ms, tbt_slo_ms=s.tbt_slo_ms)
        loop = asyncio.get_running_loop()
        try:
            if s.best_of > 1:
                return await self.client.submit_group(gen.prompt_ids, choices.group_params(params, s),
                                                      self.request_limits.queue_wait_s(loop, gen.deadline_s))
            return await self.client.submit(gen.prompt_ids, params,
                                            self.request_limits.queue_wait_s(loop, gen.deadline_s))
        except QueueFull as e:
            raise ApiError(429, f"server busy: {e}", retry_after_s=e.retry_after_s) from None
        except BackendUnavailable as e:
            raise ApiError(503, f"backend unavailable: {e}", retry_after_s=1.0) from None
        except PromptTooLong as e:
            raise api.bad_request(str(e), "prompt") from None
        except InvalidRequest as e:
            raise api.bad_request(str(e)) from None

    # -- replies ------------------------------------------------------------------
    def _detokenizer(self, gen: Generation):
        s = gen.request.sampling
        return self.tokenizer.detokenizer(ignore_eos=s.ignore_eos, stop_token_ids=s.stop_token_ids, stop=s.stop,
                                          include_stop_str_in_output=s.include_stop_str_in_output,
                                          skip_special_tokens=s.skip_special_tokens)

    async def respond(self, request: web.Request, gen: Generation, handle: RequestHandle | list[RequestHandle]
                      ) -> web.StreamResponse:
        """Stream or collect the reply; always leaves the handle(s) finished or cancelled."""
        if isinstance(handle, list):
            return await choices.respond(self, request, gen, handle)
        if gen.endpoint.chat and gen.request.tools is not None and gen.request.tools.choice != "none":
            return await tool_reply.respond(self, request, gen, handle)
        timer = None
        if gen.deadline_s is not None:
            timer = asyncio.get_running_loop().call_at(gen.deadline_s, self._expire, gen, handle)
        try:
            if gen.request.stream.stream:
                return await self._stream(request, gen, handle)
            return await self._collect(gen, handle)
        finally:
            if timer is not None:
                timer.cancel()
            if not handle.finished:
                handle.cancel()   # client gone or an error here: the daemon stops and the slot comes back

    def _expire(self, gen: Generation, handle: RequestHandle) -> None:
        """The request's deadline passed: stop generating; the reply ends with a 504 error."""
        if not handle.finished:
            gen.timed_out = True
            handle.abort(f"request deadline exceeded ({self.request_limits.request_timeout_s:g} s)")

    def _error(self, gen: Generation, handle: RequestHandle) -> ApiError:
        if gen.timed_out:
            return ApiError(504, f"generation stopped: {handle.error}")
        return generation_error(handle)

    def _error_outcome(self, gen: Generation) -> str:
        return "timeout" if gen.timed_out else "error"

    def _echo_text(self, gen: Generation) -> str:
        """What an echo opens the reply with: for chat the last message's content when its role is the
        reply's (vLLM), else the prompt as sent (its token ids decoded)."""
        if gen.endpoint.chat:
            return api.echo_prefix(gen.request)
        prompt = gen.request.prompt
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(gen.prompt_ids)

    def _reply_logprobs(self, gen: Generation) -> lpf.ReplyLogprobs | None:
        k = gen.request.sampling.logprobs
        return None if k is None else lpf.ReplyLogprobs(self.token_text, gen.endpoint.chat, k)

    def _echo_logprobs(self, gen: Generation, handle: RequestHandle, rl: lpf.ReplyLogprobs | None) -> dict | None:
        """The echoed prompt's piece of the completions logprobs (its first token null)."""
        if rl is None:
            return None
        return rl.add(gen.prompt_ids, handle.prompt_logprobs, first_is_null=True)

    def _extras(self, gen: Generation, handle: RequestHandle) -> dict:
        """vLLM's prompt_logprobs field, when asked."""
        if gen.request.sampling.prompt_logprobs is None or gen.echo:
            return {}
        records = handle.prompt_logprobs
        if records is None:
            return {"prompt_logprobs": [None]}
        return {"prompt_logprobs": lpf.prompt_logprobs(self.token_text, gen.prompt_ids, records)}

    async def _collect(self, gen: Generation, handle: RequestHandle) -> web.Response:
        detok = self._detokenizer(gen)
        rl = self._reply_logprobs(gen)
        t_first = None
        async for batch in handle:
            if t_first is None:
                t_first = now_ns()
                if gen.echo:
                    self._echo_logprobs(gen, handle, rl)
            if gen.echo_only:
                continue                       # the one token generated for an echo alone is not part of it
            n0 = detok.tokens_seen
            detok.feed(batch)
            if rl is not None:
                used = detok.tokens_seen - n0
                rl.add(batch[:used], None if handle.batch_logprobs is None else handle.batch_logprobs[:used])
            if detok.finished:
                break
        finish, stop_reason = self._finish(detok, handle)
        if finish == "error":
            self._observe(gen, self._error_outcome(gen), t_first, detok.tokens_seen, handle)
            err = self._error(gen, handle)
            return web.json_response(err.body(), status=err.status, headers=err.headers(), dumps=api.dumps)
        text = detok.text + detok.flush()
        if gen.echo_only:
            finish, stop_reason = "length", None
        if gen.echoes:
            text = self._echo_text(gen) + text
        usage = api.usage(len(gen.prompt_ids), detok.tokens_seen)
        extras = self._extras(gen, handle)
        if gen.endpoint.chat:
            extras["role"] = gen.role
        build = api.chat_body if gen.endpoint.chat else api.completion_body
        body = build(gen.rid, gen.created, self.model, text, finish, stop_reason, usage,
                     logprobs=None if rl is None else rl.total, **extras)
        self._observe(gen, finish, t_first, detok.tokens_seen, handle)
        return web.json_response(body, dumps=api.dumps)

    async def _stream(self, request: web.Request, gen: Generation, handle: RequestHandle) -> web.StreamResponse:
        ep, opts = gen.endpoint, gen.request.stream
        resp = SseResponse(status=200, headers=SSE_HEADERS)
        detok = self._detokenizer(gen)
        t_first = None
        n_prompt = len(gen.prompt_ids)
        chunk = api.chat_chunk if ep.chat else api.completion_chunk
        fast = api.DeltaEncoder(ep.chat, gen.rid, gen.created, self.model)
        outcome = "client_disconnect"
        finish = None
        watch = None
        loop = asyncio.get_running_loop()
        if self.request_limits.stall_timeout_s > 0:
            watch = StallWatch(loop, self.request_limits.stall_timeout_s, lambda: self._stalled(request, gen, handle))
        headers_due = None
        direct = None   # stream_push.DirectSink, installed on the handle once the first chunk is out
        rl = self._reply_logprobs(gen)

        async def write(data: bytes, eof: bool = False) -> None:
            """One write under the stall watch: a client that stops reading is caught while it blocks."""
            if watch is not None:
                watch.begin()
            await (resp.write_eof(data) if eof else resp.write(data))
            if watch is not None:
                watch.end()
        tail = b""      # the stream's closing bytes, sent with the end of the body (write_eof) in one write
        try:
            limit_send_buffer(request.transport)
            await resp.prepare(request)   # headers buffered: they go out with the first chunk
            headers_due = loop.call_later(SSE_HEADERS_WAIT_S, _send_headers, request)
            request[STREAM_STARTED] = resp
            async for batch in handle:
                t_batch_ns = now_ns() if self.expose_backend_timing else 0
                echo_lp = echo_text = extras = None
                if t_first is None:
                    if gen.echoes:
                        echo_text = self._echo_text(gen) or None
                        echo_lp = self._echo_logprobs(gen, handle, rl) if gen.echo else None
                    extras = self._extras(gen, handle) or None     # prompt_logprobs: on the first chunk
                n0 = detok.tokens_seen
                delta = detok.feed(batch) if not gen.echo_only else Delta("")
                lp = None
                if rl is not None and not gen.echo_only:
                    used = detok.tokens_seen - n0
                    lp = rl.add(batch[:used], None if handle.batch_logprobs is None else handle.batch_logprobs[:used])
                if echo_lp is not None:
                    lp = lpf.merge_completion(echo_lp, lp) if lp is not None else echo_lp
                last = delta.finished or handle.finished or gen.echo_only
                finish = stop_reason = None
                text = delta.text if echo_text is None else echo_text + delta.text
                if last:
                    text += detok.flush()
                    finish, stop_reason = self._finish(detok, handle)
                    if gen.echo_only and finish != "error":
                        finish, stop_reason = "length", None
                    if finish == "error":
                        break
                usage = api.usage(n_prompt, detok.tokens_seen) if opts.continuous_usage else None
                out = b""
                if t_first is None:
                    t_first = now_ns()
                    if ep.chat:   # the first chat chunk carries the role (and the prompt's logprobs when asked)
                        first = chunk(gen.rid, gen.created, self.model, {"role": gen.role, "content": ""}, usage_=usage)
                        out += api.sse({**first, **extras} if extras else first)
                        extras = None
                if not last and usage is None and lp is None and echo_text is None and extras is None:
                    # the common case: pre-encoded chunk, only the text encoded
                    if self.expose_backend_timing:
                        out += fast.encode_timed(text, handle.t_last_ns, t_batch_ns, len(batch))
                    else:
                        out += fast.encode(text)
                else:
                    payload = ({"content": text} if text or not last else {}) if ep.chat else text
                    body = chunk(gen.rid, gen.created, self.model, payload, finish, stop_reason, usage, logprobs=lp)
                    if extras:
                        body["choices"][0].update(extras)   # completions: prompt_logprobs on the choice, as in the body
                    if self.expose_backend_timing:
                        body["blink_timing"] = self._timing(handle, batch, t_batch_ns)
                    out += api.sse(body)
                if last:
                    tail = out
                    break
                await write(out)
                if direct is None and DirectSink.usable(request, detok, opts.continuous_usage):
                    direct = handle.sink = DirectSink(request, handle, detok, fast, self.expose_backend_timing)
            else:
                # The handle ended after its last batch had been sent: close with the finish reason.
                text = detok.flush()
                finish, stop_reason = self._finish(detok, handle)
                if finish != "error":
                    payload = ({"content": text} if text else {}) if ep.chat else text
                    usage = api.usage(n_prompt, detok.tokens_seen) if opts.continuous_usage else None
                    tail = api.sse(chunk(gen.rid, gen.created, self.model, payload, finish, stop_reason, usage))
            if direct is not None and direct.failure is not None:
                raise direct.failure   # the direct path failed mid-stream: the error event below
            if finish == "error":
                tail += api.sse(self._error(gen, handle).body())
            if opts.include_usage:
                tail += api.sse(api.usage_chunk(ep.chunk_object, gen.rid, gen.created, self.model,
                                                api.usage(n_prompt, detok.tokens_seen)))
            tail += api.SSE_DONE
            await write(tail, eof=True)   # one write: the last chunk, usage, [DONE] and the end of the body
            outcome = self._error_outcome(gen) if finish == "error" else finish
        except ConnectionError:
            if gen.stalled:
                outcome = "stalled"
            # else the client went away mid-stream; `respond` cancels the handle
        except Exception as e:
            if not resp.prepared:
                raise   # nothing sent yet: the error middleware answers with a 500
            # Headers are out: end the stream with an error event instead of a broken body.
            log.error("unhandled %s while streaming %s\n%s", type(e).__name__, gen.rid, code_trace(e))
            outcome = "internal_error"
            err = ApiError(500, f"internal server error ({type(e).__name__}); see the server log")
            try:
                await resp.write(api.sse(err.body()) + api.SSE_DONE)
            except ConnectionError:
                pass
        finally:
            handle.sink = None
            if headers_due is not None:
                headers_due.cancel()
            if watch is not None:
                watch.close()
        self._observe(gen, outcome, t_first, detok.tokens_seen, handle)
        return resp

    @staticmethod
    def _stalled(request: web.Request, gen: Generation, handle: RequestHandle) -> None:
        """The client has taken no bytes for stall_timeout_s: cancel the request, drop the connection
        (the blocked write then fails, and the handler ends)."""
        gen.stalled = True
        handle.abort("the client stopped reading the stream")
        transport = request.transport
        if transport is not None:
            transport.abort()

    @staticmethod
    def _timing(handle: RequestHandle, batch: list[int], t_batch_ns: int) -> dict[str, int]:
        """Benchmark-only: the daemon's stamp of the newest token in this chunk (monotonic clock,
        same machine), when this handler got the batch, and how many tokens it holds."""
        return {"t_last_ns": handle.t_last_ns, "t_frontend_ns": t_batch_ns, "n_tokens": len(batch)}

    @staticmethod
    def _finish(detok, handle: RequestHandle) -> tuple[str, int | str | None]:
        """finish_reason and vLLM's stop_reason (matched stop string / stop token id, None for EOS)."""
        if detok.finished:
            return "stop", detok.stop_reason
        reason = handle.finish_reason or "abort"
        return reason, None

    def _observe(self, gen: Generation, outcome: str, t_first_ns: int | None, n_tokens: int,
                 handle: RequestHandle | None = None) -> None:
        m = self.metrics
        m.outcome(gen.endpoint.name, outcome)
        m.prompt_tokens.inc(by=len(gen.prompt_ids))
        m.generation_tokens.inc(by=n_tokens)
        now = now_ns()
        m.e2e.observe((now - gen.t_arrival_ns) / 1e9)
        if t_first_ns is not None:
            m.ttft.observe((t_first_ns - gen.t_arrival_ns) / 1e9)
            if n_tokens > 1:
                m.tpot.observe((now - t_first_ns) / 1e9 / (n_tokens - 1))
        if handle is not None:   # the slot's stamps as the reader last copied them (all of them at completion)
            m.observe_stages(handle.t_submit_ns, handle.t_picked_ns, handle.t_first_ns, handle.t_last_ns,
                             self.client.shares_clock)


# Why a request the backend ended with an error failed, by the daemon's ErrorCode: the client's
# request (400), a daemon that went away (503: retry), or the backend itself (500).
_CLIENT_ERROR_CODES = (ErrorCode.INVALID_REQUEST, ErrorCode.INVALID_TOKEN, ErrorCode.PROMPT_TOO_LONG,
                       ErrorCode.OUT_OF_MEMORY)
_RETRY_ERROR_CODES = (ErrorCode.BACKEND_SHUTDOWN, ErrorCode.STALE_EPOCH)


def generation_error(handle: RequestHandle) -> ApiError:
    """The error reply for a handle that finished with "error"."""
    message = handle.error or "backend error"
    code = getattr(handle, "error_code", None)
    if code is None:
        # The handle reports the daemon's error as text only (token_reader's table); map it back
        # until RequestHandle carries the ErrorCode itself.
        code = next((c for c, text in token_reader._ERROR_TEXT.items() if text == handle.error), None)
    if code in _CLIENT_ERROR_CODES:
        return ApiError(400, f"request rejected by the backend: {message}")
    if code in _RETRY_ERROR_CODES or message.startswith("backend lost"):
        return ApiError(503, f"generation interrupted: {message}", retry_after_s=1.0)
    return ApiError(500, f"generation failed: {message}")


def _send_headers(request: web.Request) -> None:
    """The first chunk is late (a long prefill): send the buffered headers alone (a no-op once sent)."""
    transport = request.transport
    if transport is not None and not transport.is_closing():
        request.writer.send_headers()


def code_trace(e: BaseException) -> str:
    """The traceback of `e`, frames and code lines only: its message may quote the prompt."""
    return "".join(traceback.format_tb(e.__traceback__)).rstrip()


async def read_json(request: web.Request, deadline_s: float | None = None):
    """The body as JSON, or a 400 / 408 / 413 that says why not. `deadline_s` (loop clock):
    the body timeout or the request's deadline, whichever is sooner."""
    try:
        async with asyncio.timeout_at(deadline_s):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise ApiError(413, f"request body too large ({e.text})") from None
    except TimeoutError:
        raise ApiError(408, "the request body did not arrive in time (body timeout or request deadline)") from None
    if not raw.strip():
        raise api.bad_request("request body is empty; expected a JSON object")
    try:
        body = api.loads(raw)
    except (ValueError, RecursionError) as e:
        raise api.bad_request(f"malformed JSON body: {_short(e)}") from None
    if has_lone_surrogate(raw, body):
        raise api.bad_request("the body holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff); "
                              "text must be valid Unicode")
    return body


def _short(e: Exception) -> str:
    text = str(e)
    return text if len(text) <= 200 else text[:197] + "..."


async def handle_generation(request: web.Request, service: GenerationService, endpoint: Endpoint):
    t_arrival = now_ns()
    deadline_s = service.request_limits.deadline_s(asyncio.get_running_loop())
    gen = None
    try:
        body = await read_json(request, service.request_limits.body_deadline_s(asyncio.get_running_loop(), deadline_s))
        gen = await service.prepare(endpoint, body, request.headers.get("X-Request-Id"), t_arrival, deadline_s)
        handle = await service.submit(gen)
        return await service.respond(request, gen, handle)
    except asyncio.CancelledError:
        # The client went away at any point (body, queue, reply): counted once, here.
        service.metrics.outcome(endpoint.name, "stalled" if gen is not None and gen.stalled else "client_disconnect")
        raise
