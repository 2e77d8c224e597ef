"""The direct path for mid-stream SSE chunks: the token reader writes them itself.

    TokenReader.poll -> RequestHandle._deliver(tokens) -> handle.sink = DirectSink
        -> Detokenizer.feed -> DeltaEncoder (pre-encoded chunk, the text JSON-encoded)
        -> one HTTP/1.1 chunk, transport.write (non-blocking)        [the common event]
    anything else -> False: the tokens are buffered in the handle and the request's
        handler task (completions._stream) writes them through aiohttp as before

Without it every event wakes the handler task (a future, a task step, the coroutine
chain of `async for` and aiohttp's write layers) only to do the same three things.
The sink is installed after the handler has written the first chunk (headers, the chat
role), and declines whenever the handler must decide: the handler is not parked on the
handle or has tokens buffered (order), the batch may end the request (an EOS or stop id),
the request has stop strings or wants usage on every chunk (never installed), the
connection is closing or its write buffer is past DIRECT_MAX_BUFFER (the handler's
write then blocks, which is what the stall watch looks for). A failure here aborts the
request and is re-raised by the handler, which ends the stream with an error event.
"""
from __future__ import annotations

from aiohttp import web

from shared_layout import now_ns

from .detokenizer import Detokenizer
from .openai_api import DeltaEncoder
from .request_handle import RequestHandle

DIRECT_MAX_BUFFER = 16 * 1024   # bytes queued in the transport: past this, the handler writes (and waits)


class DirectSink:
    """RequestHandle.sink for one streaming request (see the module docstring)."""

    def __init__(self, request: web.Request, handle: RequestHandle, detok: Detokenizer, encoder: DeltaEncoder,
                 timing: bool):
        self.transport = request.transport
        self.writer = request.writer
        self.handle = handle
        self.detok = detok
        self.encoder = encoder
        self.timing = timing
        self.failure: Exception | None = None
        self.events = 0

    @staticmethod
    def usable(request: web.Request, detok: Detokenizer, continuous_usage: bool) -> bool:
        """Whether this request's mid-stream chunks can take the direct path at all."""
        return (not continuous_usage and not detok.has_stop_strings and request.transport is not None
                and getattr(request.writer, "chunked", False) is True)

    def __call__(self, batch: list[int]) -> bool:
        transport = self.transport
        if (transport.is_closing() or transport.get_write_buffer_size() > DIRECT_MAX_BUFFER
                or self.detok.ends_in(batch)):
            return False
        try:
            t_batch_ns = now_ns() if self.timing else 0
            text = self.detok.feed(batch).text   # cannot finish: no stop strings, no ending id in the batch
            if self.timing:
                out = self.encoder.encode_timed(text, self.handle.t_last_ns, t_batch_ns, len(batch))
            else:
                out = self.encoder.encode(text)
            frame = b"%x\r\n%b\r\n" % (len(out), out)   # HTTP/1.1 chunked framing, as aiohttp writes it
            transport.write(frame)
            self.writer.output_size += len(frame)
            self.events += 1
        except Exception as e:   # a bug must end this request with an error event, not the reader
            self.failure = e
            self.handle.sink = None
            self.handle.abort(f"internal error while streaming ({type(e).__name__})")
        return True
