"""One accepted request as the HTTP layer sees it: a stream of token batches.

    TokenReader -> handle._deliver(tokens, records) / handle._end(reason, error)
                -> `async for batch in handle` (HTTP layer) -> SSE chunks
                   (`batch_logprobs`: the batch's logprob records, [n, words] int32, when the
                   request asked for them; `prompt_logprobs`: the prompt's, set with the first batch)
                   or, while the consumer is parked with nothing buffered, handle.sink(tokens)
                   (stream_push.DirectSink: the chunk written at once, the consumer left asleep)

The buffer between the reader and the consumer is bounded: a consumer that stops
reading gets its request cancelled (finish_reason "error") instead of a buffer
that grows with the generation.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Callable

import numpy as np

from shared_layout import now_ns
from shared_layout.extra import SamplingExtra


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings, as the slot carries them."""
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None          # top entries per generated token's record; None: no records
    prompt_logprobs: int | None = None   # top entries per prompt token's record
    extra: SamplingExtra = SamplingExtra()   # logit_bias, allowed ids, bad words (token ids)
    priority: int = 0                    # scheduling: lower runs first
    ttft_slo_ms: int = 0                 # 0: the daemon's default
    tbt_slo_ms: int = 0


class RequestHandle:
    """Tokens of one request as they arrive; see `finish_reason` once iteration ends.

    Timestamps: `t_submit_ns` / `t_first_token_ns` on this process's monotonic
    clock; `t_picked_ns` / `t_first_ns` / `t_last_ns` as the backend stamped them
    (its clock; compare them only with each other).
    """

    def __init__(self, *, seq: int, slot: int, prompt_tokens: int, max_tokens: int, t_submit_ns: int,
                 max_buffered_tokens: int, on_cancel: Callable[["RequestHandle", str, str | None], None],
                 on_end: Callable[["RequestHandle"], None] | None = None):
        self.seq = seq
        self.slot = slot
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens          # output capacity reserved in the ring
        self.completion_tokens = 0
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
        self.error: str | None = None
        self.t_submit_ns = t_submit_ns
        self.t_first_token_ns: int | None = None
        self.t_picked_ns = 0
        self.t_first_ns = 0
        self.t_last_ns = 0
        self._max_buffered = max_buffered_tokens
        self._on_cancel = on_cancel
        self._on_end = on_end
        self._pending: list[int] = []
        self._pending_records: list[np.ndarray] = []   # logprob records of the tokens in _pending
        self.batch_logprobs: np.ndarray | None = None  # [batch, words]: records of the batch just returned
        self.prompt_logprobs: np.ndarray | None = None  # [prompt_len - 1, words], with the first batch
        self._ended = False
        self._wake: asyncio.Future | None = None
        # Takes a batch instead of the consumer when it returns True; tried only while the consumer
        # is parked with nothing buffered (order) and never for a request's last batch.
        self.sink: Callable[[list[int]], bool] | None = None

    # -- consumer side --------------------------------------------------------
    @property
    def finished(self) -> bool:
        """No more tokens will be delivered (some may still be buffered)."""
        return self._ended

    def cancel(self) -> None:
        """Stop the request: raise the slot's cancel flag; ends the stream with "abort"."""
        if not self._ended:
            self._on_cancel(self, "abort", None)

    def abort(self, error: str) -> None:
        """Stop the request as failed (deadline, stalled client): the slot's cancel flag goes
        up and the stream ends with "error" and this message."""
        if not self._ended:
            self._on_cancel(self, "error", error)

    def __aiter__(self) -> "RequestHandle":
        return self

    async def __anext__(self) -> list[int]:
        while not self._pending:
            if self._ended:
                raise StopAsyncIteration
            self._wake = asyncio.get_running_loop().create_future()
            try:
                await self._wake
            finally:
                self._wake = None
        batch, self._pending = self._pending, []
        if self._pending_records:
            recs, self._pending_records = self._pending_records, []
            self.batch_logprobs = recs[0] if len(recs) == 1 else np.concatenate(recs)
        return batch

    async def result(self) -> list[int]:
        """All remaining tokens, once the request has finished."""
        out: list[int] = []
        async for batch in self:
            out += batch
        return out

    # -- reader side ----------------------------------------------------------
    def _deliver(self, tokens: list[int], final: bool = False, records: np.ndarray | None = None) -> None:
        """New tokens (with their logprob records when asked); `final`: the request ends right
        after them (the consumer then sees both)."""
        if self._ended or not tokens:
            return
        if records is not None:
            self._pending_records.append(records)
        if self.t_first_token_ns is None:
            self.t_first_token_ns = now_ns()
        self.completion_tokens += len(tokens)
        sink, wake = self.sink, self._wake
        if (sink is not None and records is None and not final and not self._pending and wake is not None
                and not wake.done() and sink(tokens)):
            return
        self._pending += tokens
        if len(self._pending) > self._max_buffered:
            self._on_cancel(self, "error",
                            f"consumer stopped reading: {len(self._pending)} tokens buffered "
                            f"(limit {self._max_buffered}); request cancelled")
        self._notify()

    def _end(self, finish_reason: str, error: str | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        self.finish_reason = finish_reason
        self.error = error
        self._notify()
        if self._on_end is not None:
            self._on_end(self)

    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def __repr__(self) -> str:
        return (f"RequestHandle(seq={self.seq}, slot={self.slot}, tokens={self.completion_tokens}, "
                f"finish={self.finish_reason})")
