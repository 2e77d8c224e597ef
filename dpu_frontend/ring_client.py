"""The frontend's side of the ring, as the HTTP layer calls it.

    submit(prompt, params) -> wait queue (bounded, FIFO) -> flush: slots + arena ranges,
        one write_batch for every request of the burst, the frontend doorbell last -> RequestHandle
    submit_group(prompt, [params] * n) -> the same for n choices of one prompt: n slots taken
        together, the members' writes before the leader's (the daemon prefills once and forks)
        -> one RequestHandle per choice
    background loop: attach / reattach the ring -> TokenReader.poll -> handles get tokens
        -> completed slots reset -> wait queue moves; health, backend-lost, ring-replaced checks
    doorbell (a daemon on this host, shm transport): its bell readable -> drain -> poll now; the
        reader then sleeps until the next bell instead of waking around predicted steps

Everything runs on the asyncio event loop that calls `start()`; the loop task
yields after every poll. The ring is reached only through a Transport made by
`transport_factory` (called again to reattach when the daemon recreated the
ring). Decisions about HTTP status codes stay with the caller: this module
raises QueueFull (with retry_after_s), BackendUnavailable, PromptTooLong and
InvalidRequest.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time

import numpy as np

from shared_layout import MAX_STOP_IDS, LayoutMismatch, SlotState, now_ns
from shared_layout.automaton import MAX_AUTOMATON_WORDS
from shared_layout.doorbell import BellListener
from shared_layout.extra import MAX_ALLOWED_IDS, MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS_WORDS, MAX_LOGIT_BIAS
from shared_layout.layout import MAX_LOGPROBS

from .backend_health import BackendHealth, HealthMonitor
from .request_handle import RequestHandle, SamplingParams
from .ring_session import RingSession
from .token_reader import PollResult, ReaderConfig, TokenReader
from .transport.base import TransportError, TransportFactory
from .wakeup_timer import WakeupTimer

log = logging.getLogger(__name__)

__all__ = ["BackendHealth", "BackendUnavailable", "InvalidRequest", "PromptTooLong", "QueueFull", "RequestHandle",
           "RingClient", "RingClientConfig", "RingClientError", "SamplingParams", "ReaderConfig"]


class RingClientError(Exception):
    """Base of the errors `submit` raises."""


class QueueFull(RingClientError):
    """No slot now: the wait queue is full, or none came free within the timeout."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class BackendUnavailable(RingClientError):
    """No daemon serving the ring (not started, starting, lost, or the client closed)."""


class PromptTooLong(RingClientError, ValueError):
    """The prompt cannot fit the model's context (or the ring's prompt arena)."""


class InvalidRequest(RingClientError, ValueError):
    """Prompt or sampling parameters the ring cannot carry."""


# A yield (asyncio.sleep(0)) that comes back within this ran nothing else: the loop was idle
# (uvloop takes ~1 us, asyncio's own loop ~2 us; one other callback takes far longer).
IDLE_YIELD_S = 10e-6


@dataclasses.dataclass(frozen=True)
class RingClientConfig:
    health_window_s: float = 2.0         # heartbeat must advance within this to be healthy
    max_queue: int = 1024                # requests waiting for a slot; beyond: QueueFull at once
    max_buffered_tokens: int = 16384     # per handle; a consumer this far behind is cancelled
    reattach_interval_s: float = 0.25    # retry opening the ring this often while detached
    stale_check_interval_s: float = 0.1  # how often to ask whether the ring file was replaced
    recent_requests: int = 256           # finished requests kept for stats()
    reader: ReaderConfig = ReaderConfig()

    def __post_init__(self):
        for name in ("health_window_s", "reattach_interval_s", "stale_check_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        for name in ("max_queue", "max_buffered_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")


@dataclasses.dataclass(eq=False)
class _Waiter:
    prompt: np.ndarray          # [prompt_len] int32
    params: SamplingParams
    max_tokens: int             # output capacity to reserve (clamped to the context)
    t_submit_ns: int
    fut: asyncio.Future
    members: tuple[SamplingParams, ...] = ()   # a group's other choices (the leader's are `params`)


class RingClient:
    _block = staticmethod(time.sleep)   # the fine wait's blocking pause (a test hook)

    def __init__(self, transport_factory: TransportFactory, config: RingClientConfig = RingClientConfig()):
        self.factory = transport_factory
        self.config = config
        self._session: RingSession | None = None
        self._reader: TokenReader | None = None
        self._health: HealthMonitor | None = None
        self._down_message = "ring not attached yet"
        self._displaced: str | None = None
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sleep_fut: asyncio.Future | None = None
        self._timer: WakeupTimer | None = None   # precise wake-ups between polls (Linux); else loop timers
        self._bell: BellListener | None = None   # the attached ring's doorbell (same host), if bound
        self._loop_idle = False   # the last yield came straight back: nothing else was ready to run
        self._flush_handle: asyncio.Handle | None = None
        self._closed = False
        self._next_attach_s = 0.0
        self._next_stale_check_s = 0.0
        self._last_states: np.ndarray | None = None
        self._lost = False   # the backend's heartbeat is stale and in-flight requests were failed
        # counters for stats()
        self._submitted = 0
        self._attaches = 0
        self._tokens = 0
        self._finished: collections.Counter[str] = collections.Counter()
        self._recent: collections.deque[dict] = collections.deque(maxlen=config.recent_requests)
        self._freed_times: collections.deque[float] = collections.deque(maxlen=64)

    # -- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        """Attach the ring if it is there (else keep trying in the background) and start polling."""
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._timer = WakeupTimer.create()
        if self._timer is not None:
            self._loop.add_reader(self._timer.fd, self._on_timer)
        await self._try_attach()
        self._task = self._loop.create_task(self._run(), name="ring-client")

    async def close(self) -> None:
        """Stop polling; cancel what is still in flight (the daemon aborts it) and detach."""
        if self._closed:
            return
        self._closed = True
        self._wake()
        if self._task is not None:
            await self._task
        self._drop_timer()
        self._drop_bell()
        self._fail_waiters(BackendUnavailable("ring client closed"))
        s = self._session
        if s is not None:
            live = [f for f in s.flights.values() if f.handle is not None]
            for f in live:
                f.handle, h = None, f.handle
                h._end("abort", "ring client closed")
            try:
                s.write_cancels([f.slot for f in live])
            except TransportError:
                pass
            self._session = self._reader = None
            s.close()

    # -- what the HTTP layer reads ------------------------------------------------
    def health(self) -> BackendHealth:
        if self._displaced:
            return BackendHealth("DOWN", False, None, 0, self._displaced)
        if self._session is None or self._health is None:
            return BackendHealth("DOWN", False, None, 0, self._down_message)
        return self._health.health()

    @property
    def model_max_len(self) -> int:
        """Context length the daemon published (0 until it did)."""
        return self._health.model_max_len if self._health else 0

    @property
    def vocab_size(self) -> int:
        return self._health.vocab_size if self._health else 0

    @property
    def shares_clock(self) -> bool:
        """True when the attached backend stamps the ring with this host's monotonic clock
        (shm transport), so its t_picked_ns compares with our t_submit_ns; False for a
        remote backend (verbs) or none attached."""
        return self._health.shares_clock if self._health else False

    def prefix_cache_stats(self) -> dict | None:
        """The daemon's prefix-cache counters from the ring header; None when it runs without one."""
        h = self._health
        if h is None or not h.prefix_caching:
            return None
        return {"kv_blocks_cached": h.kv_blocks_cached, **h.prefix_counters}

    def stats(self) -> dict:
        """Counters and gauges for /metrics."""
        s = self._session
        states = self._last_states
        counts = {st.name: 0 for st in SlotState}
        if states is not None:
            bc = np.bincount(np.minimum(states, len(SlotState)), minlength=len(SlotState) + 1)
            counts = {st.name: int(bc[st]) for st in SlotState}
        h = self.health()
        return {
            "slots": counts,
            "slot_count": s.geom.slot_count if s else 0,
            "queue_depth": len(self._waiters),
            "inflight": s.inflight() if s else 0,
            "held_slots": len(s.flights) if s else 0,
            "prompt_arena_free_tokens": s.prompts.free_tokens if s else 0,
            "output_arena_free_tokens": s.outputs.free_tokens if s else 0,
            "prompt_arena_used_tokens": s.geom.prompt_arena_tokens - s.prompts.free_tokens if s else 0,
            "output_arena_used_tokens": s.geom.output_arena_tokens - s.outputs.free_tokens if s else 0,
            "frontend_epoch": s.epoch if s else 0,
            "kv_blocks_total": self._health.kv_blocks_total if self._health else 0,
            "kv_blocks_free": self._health.kv_blocks_free if self._health else 0,
            "prefix_cache": self.prefix_cache_stats(),
            "attach_total": self._attaches,
            "backend": dataclasses.asdict(h),
            "submitted_total": self._submitted,
            "finished_total": dict(self._finished),
            "tokens_total": self._tokens,
            "polls_total": self._reader.polls if self._reader else 0,
            "recent_requests": list(self._recent),
        }

    # -- submit ---------------------------------------------------------------------
    async def submit_group(self, prompt_ids: list[int], params: list[SamplingParams], queue_timeout_s: float = 30.0
                           ) -> list[RequestHandle]:
        """n choices of one prompt (params[i] for choice i, same max_tokens): one handle each, in order.
        The slots are taken together; the daemon prefills the prompt once and forks the others."""
        if len(params) == 1:
            return [await self.submit(prompt_ids, params[0], queue_timeout_s)]
        if len({p.max_tokens for p in params}) != 1:
            raise InvalidRequest("the choices of a group share max_tokens")
        handles = await self.submit(prompt_ids, params[0], queue_timeout_s, members=params[1:])
        return handles

    async def submit(self, prompt_ids: list[int], params: SamplingParams, queue_timeout_s: float = 30.0,
                     members: list[SamplingParams] = ()) -> RequestHandle:
        """Write one request into the ring; the handle streams its tokens.

        Waits up to `queue_timeout_s` for a slot and arena room (FIFO behind
        earlier waiters). Raises QueueFull, BackendUnavailable, PromptTooLong,
        InvalidRequest. With `members` (submit_group): a list of handles.
        """
        if self._closed or self._task is None:
            raise BackendUnavailable("ring client is not running")
        h = self.health()
        s = self._session
        if s is None or not h.healthy:
            raise BackendUnavailable(h.message or "backend unavailable")
        prompt, max_tokens = self._validate(s, prompt_ids, params)
        for member in members:
            self._validate(s, prompt_ids, member)
        if len(self._waiters) >= self.config.max_queue:
            raise QueueFull(f"wait queue full ({len(self._waiters)} requests waiting for a slot)",
                            self._retry_after_s())
        loop = asyncio.get_running_loop()
        w = _Waiter(prompt, params, max_tokens, now_ns(), loop.create_future(), tuple(members))
        self._waiters.append(w)
        if queue_timeout_s <= 0:
            self._flush()
        elif self._flush_handle is None:
            # Submissions arriving in this loop iteration go out in one batch of writes.
            self._flush_handle = loop.call_soon(self._flush)
        if not w.fut.done():
            timer = (loop.call_later(max(queue_timeout_s, 0.0), self._expire, w, queue_timeout_s)
                     if math.isfinite(queue_timeout_s) else None)
            try:
                await w.fut
            except asyncio.CancelledError:
                self._remove_waiter(w)
                if w.fut.done() and not w.fut.cancelled() and w.fut.exception() is None:
                    placed = w.fut.result()   # placed just before the caller gave up
                    for h in placed if isinstance(placed, list) else [placed]:
                        h.cancel()
                raise
            finally:
                if timer is not None:
                    timer.cancel()
        return w.fut.result()

    def _validate(self, s: RingSession, prompt_ids, params: SamplingParams) -> tuple[np.ndarray, int]:
        if not isinstance(params, SamplingParams):
            raise InvalidRequest("params must be a SamplingParams")
        try:
            prompt = np.asarray(prompt_ids)
        except (TypeError, ValueError):
            raise InvalidRequest("prompt must be a list of token ids") from None
        if prompt.ndim != 1 or prompt.size == 0:
            raise InvalidRequest("prompt must be a non-empty list of token ids")
        if prompt.dtype.kind not in "iu":
            raise InvalidRequest("prompt token ids must be integers")
        vocab = self.vocab_size
        lo, hi = int(prompt.min()), int(prompt.max())
        limit = vocab or 2**31
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            raise InvalidRequest(f"prompt token id {bad} is outside the vocabulary [0, {limit})")
        plen = int(prompt.size)
        max_len = self.model_max_len
        if max_len and plen >= max_len:
            raise PromptTooLong(f"prompt has {plen} tokens; the model's context is {max_len} "
                                f"(room must remain for at least one generated token)")
        if plen > s.geom.prompt_arena_tokens:
            raise PromptTooLong(f"prompt has {plen} tokens; the ring's prompt arena holds {s.geom.prompt_arena_tokens}")
        mt = params.max_tokens
        if not isinstance(mt, (int, np.integer)) or isinstance(mt, bool) or mt < 1:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {mt!r}")
        if not (isinstance(params.temperature, (int, float)) and math.isfinite(params.temperature)
                and params.temperature >= 0):
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {params.temperature!r}")
        if not (isinstance(params.top_p, (int, float)) and 0 < params.top_p <= 1):
            raise InvalidRequest(f"top_p must be in (0, 1], got {params.top_p!r}")
        if not isinstance(params.top_k, (int, np.integer)) or params.top_k < 0 or params.top_k >= 2**31:
            raise InvalidRequest(f"top_k must be an integer >= 0, got {params.top_k!r}")
        if params.seed is not None and not isinstance(params.seed, (int, np.integer)):
            raise InvalidRequest(f"seed must be an integer, got {params.seed!r}")
        if not all(isinstance(t, (int, np.integer)) and 0 <= t < 2**31 for t in params.stop_token_ids):
            raise InvalidRequest("stop_token_ids must be non-negative integers")
        self._validate_sampling(params, limit)
        mt = int(mt)
        if max_len:
            mt = min(mt, max_len - plen)   # the daemon stops at the context limit anyway
        if mt > s.geom.output_arena_tokens:
            raise InvalidRequest(f"max_tokens {mt} exceeds the ring's output arena ({s.geom.output_arena_tokens} tokens)")
        return prompt.astype(np.int32), mt

    @staticmethod
    def _validate_sampling(p: SamplingParams, vocab: int) -> None:
        """The ranges the daemon enforces (shared_layout.request_error, extra.decode_extra), checked
        here so a bad value is an InvalidRequest, not a request that ends in error."""
        def number(v) -> bool:
            return isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool) and math.isfinite(v)
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                             ("repetition_penalty", 1e-30, 2.0), ("min_p", 0.0, 1.0)):
            v = getattr(p, name)
            if not number(v) or not lo <= v <= hi:
                raise InvalidRequest(f"{name} must be in [{lo:g}, {hi:g}], got {v!r}")
        if not isinstance(p.min_tokens, (int, np.integer)) or not 0 <= p.min_tokens <= p.max_tokens:
            raise InvalidRequest(f"min_tokens must be in [0, max_tokens], got {p.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(p, name)
            if v is not None and (not isinstance(v, (int, np.integer)) or not 0 <= v <= MAX_LOGPROBS):
                raise InvalidRequest(f"{name} must be None or in [0, {MAX_LOGPROBS}], got {v!r}")
        e = p.extra
        n_lb, n_al, n_bw = e.counts
        if (n_lb > MAX_LOGIT_BIAS or n_al > MAX_ALLOWED_IDS or n_bw > MAX_BAD_WORDS_WORDS
                or e.automaton_words > MAX_AUTOMATON_WORDS):
            raise InvalidRequest(f"at most {MAX_LOGIT_BIAS} logit_bias entries, {MAX_ALLOWED_IDS} allowed ids, "
                                 f"{MAX_BAD_WORDS_WORDS} words of bad-word tokens and a {MAX_AUTOMATON_WORDS}-word "
                                 "token automaton fit a request")
        ids = [t for t, _ in e.logit_bias] + list(e.allowed_token_ids) + [t for w in e.bad_words for t in w]
        if not all(isinstance(t, (int, np.integer)) and 0 <= t < vocab for t in ids):
            raise InvalidRequest(f"logit_bias, allowed_token_ids and bad_words hold token ids in [0, {vocab})")
        if not all(number(b) and -100 <= b <= 100 for _, b in e.logit_bias):
            raise InvalidRequest("logit_bias values must be in [-100, 100]")
        if not all(1 <= len(w) <= MAX_BAD_WORD_TOKENS for w in e.bad_words):
            raise InvalidRequest(f"each bad word is 1 to {MAX_BAD_WORD_TOKENS} tokens")

    def _flush(self) -> None:
        """Move waiters into free slots, FIFO; all their writes go out as one batch."""
        self._flush_handle = None
        s = self._session
        if s is None or not self._waiters:
            return
        writes: list[tuple[int, bytes]] = []
        batch = []
        while self._waiters:
            w = self._waiters[0]
            if w.fut.done():
                self._waiters.popleft()
                continue
            flights = self._reserve(s, w)
            if flights is None:
                break   # head of the queue waits for slots or arena room; FIFO keeps fairness
            self._waiters.popleft()
            group = (len(flights), flights[0].seq) if len(flights) > 1 else (0, 0)
            for i in list(range(1, len(flights))) + [0]:   # the leader's state word last
                writes += self._submission(s, flights[i], w, w.params if i == 0 else w.members[i - 1], group, i)
            batch.append((w, flights))
        if not batch:
            return
        try:
            s.transport.write_batch(writes + [s.doorbell_write()])
        except TransportError as e:
            for w, flights in batch:
                for flight in flights:
                    s.unreserve(flight)
                w.fut.set_exception(BackendUnavailable(f"backend lost: {e}"))
            self._drop_session(f"backend lost: {e}")
            return
        for w, flights in batch:
            handles = []
            for flight in flights:
                h = RequestHandle(seq=flight.seq, slot=flight.slot, prompt_tokens=int(w.prompt.size),
                                  max_tokens=flight.max_tokens, t_submit_ns=w.t_submit_ns,
                                  max_buffered_tokens=self.config.max_buffered_tokens,
                                  on_cancel=self._cancel, on_end=self._record_end)
                flight.handle = h
                self._reader.track(flight)
                handles.append(h)
            w.fut.set_result(handles if w.members else handles[0])
        self._submitted += len(batch)
        self._wake()

    @staticmethod
    def _reserve(s: RingSession, w: _Waiter) -> list | None:
        """Slots and arena ranges for the waiter's request (every choice of a group, or none)."""
        out = []
        for p in (w.params,) + w.members:
            flight = s.reserve(int(w.prompt.size), w.max_tokens, p)
            if flight is None:
                for f in out:
                    s.unreserve(f)
                return None
            out.append(flight)
        return out

    @staticmethod
    def _submission(s: RingSession, flight, w: _Waiter, p: SamplingParams, group: tuple[int, int], index: int
                    ) -> list[tuple[int, bytes]]:
        stops = tuple(int(t) for t in p.stop_token_ids)
        flight.extra_stops = frozenset(stops[MAX_STOP_IDS:])
        return s.submission(flight, w.prompt, temperature=float(p.temperature), top_p=float(p.top_p),
                            top_k=int(p.top_k), seed=None if p.seed is None else int(p.seed),
                            ignore_eos=bool(p.ignore_eos), stop_ids=stops[:MAX_STOP_IDS],
                            t_submit_ns=w.t_submit_ns, params=p, group=(group[0], index, group[1]))

    def _expire(self, w: _Waiter, timeout_s: float) -> None:
        if not w.fut.done():
            self._remove_waiter(w)
            w.fut.set_exception(QueueFull(f"no slot came free within {timeout_s:g} s", self._retry_after_s()))

    def _remove_waiter(self, w: _Waiter) -> None:
        try:
            self._waiters.remove(w)
        except ValueError:
            pass

    def _retry_after_s(self) -> float:
        """Rough wait until a slot frees for the whole queue, from the recent completion rate."""
        t = self._freed_times
        if len(t) >= 2 and t[-1] > t[0]:
            rate = (len(t) - 1) / (t[-1] - t[0])
            return float(min(30.0, max(0.05, (len(self._waiters) + 1) / rate)))
        return 1.0

    def _fail_waiters(self, exc: Exception) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.fut.done():
                w.fut.set_exception(exc)

    # -- handle callbacks ------------------------------------------------------------
    def _cancel(self, handle: RequestHandle, reason: str, error: str | None) -> None:
        s = self._session
        flight = s.flights.get(handle.slot) if s is not None else None
        if flight is not None and flight.handle is handle:
            flight.handle = None   # the slot stays held until the daemon completes it
            try:
                s.write_cancels([flight.slot])
            except TransportError:
                pass   # ring gone: the loop drops the session
        handle._end(reason, error)

    def _record_end(self, h: RequestHandle) -> None:
        self._finished[h.finish_reason] += 1
        self._tokens += h.completion_tokens
        self._recent.append({
            "seq": h.seq, "prompt_tokens": h.prompt_tokens, "completion_tokens": h.completion_tokens,
            "finish_reason": h.finish_reason, "t_submit_ns": h.t_submit_ns, "t_first_token_ns": h.t_first_token_ns,
            "t_picked_ns": h.t_picked_ns, "t_first_ns": h.t_first_ns, "t_last_ns": h.t_last_ns,
        })

    # -- the background loop -----------------------------------------------------------
    async def _run(self) -> None:
        while not self._closed:
            interval = self.config.reattach_interval_s
            try:
                if self._session is None and not self._displaced and time.monotonic() >= self._next_attach_s:
                    await self._try_attach()
                if self._session is not None:
                    res = self._reader.poll()
                    self._after_poll(res)
                    if self._reader is not None:
                        interval = self._reader.next_interval_s(res)
            except TransportError as e:
                self._drop_session(f"backend lost: {e}")
            except Exception as e:   # a bug must not leave every request hanging
                log.exception("ring client poll failed")
                self._drop_session(f"ring client error: {e!r}")
            await self._sleep(interval, self._reader is not None and self._reader.fine)

    async def _try_attach(self) -> None:
        """Open the transport and take over the ring, off the event loop.

        Opening can block for seconds (the verbs transport's TCP bootstrap, queue
        pair setup and first RDMA READs; a daemon that does not answer): it runs
        in a worker thread so the loop keeps serving /health, /metrics and
        refusals meanwhile. Nothing else sees the new session until it is adopted
        here, back on the loop.
        """
        self._next_attach_s = time.monotonic() + self.config.reattach_interval_s
        try:
            opened = await self._loop.run_in_executor(None, self._open)
        except (TransportError, LayoutMismatch, OSError, ValueError) as e:
            self._down_message = f"ring unavailable: {e}"
            return
        transport, session, health, reader, res = opened
        if self._closed:   # closed while the attach ran: give the ring back untouched
            transport.close()
            return
        self._session, self._health, self._reader = session, health, reader
        self._listen_bell(transport)
        self._attaches += 1
        self._displaced = None
        self._lost = False
        self._next_stale_check_s = time.monotonic() + self.config.stale_check_interval_s
        self._last_states = res.states
        log.info("attached ring %r as frontend epoch %d", transport, session.epoch)

    def _open(self) -> tuple:
        """(worker thread) The factory's transport, attached as a new frontend, polled once."""
        transport = self.factory()
        try:
            session = RingSession.attach(transport)
            health = HealthMonitor(self.config.health_window_s, bool(getattr(transport, "shares_clock", False)))
            reader = TokenReader(session, health, self.config.reader, precise_wake=self._timer is not None)
            res = reader.poll()   # learn the backend's state before the first submit
        except BaseException:
            transport.close()
            raise
        return transport, session, health, reader, res

    def _after_poll(self, res: PollResult) -> None:
        s, hm = self._session, self._health
        self._last_states = res.states
        now_s = time.monotonic()
        if res.freed:
            self._freed_times.append(now_s)
        if res.frontend_epoch != s.epoch:
            msg = (f"another frontend attached to this ring (frontend epoch {res.frontend_epoch}, ours {s.epoch}); "
                   f"restart this frontend to take the ring back")
            self._displaced = msg
            self._drop_session(msg)
            return
        if hm.lost(now_s):
            if not self._lost:
                self._lost = True
                self._fail_inflight(hm.health(now_s).message)
            # A daemon that found the ring unusable makes a new file; look for it now.
            if s.transport.stale():
                self._drop_session("backend lost: the ring was replaced")
                return
        else:
            self._lost = False   # beating again (a restarted daemon, or one that was stalled)
        if self._waiters and not hm.health(now_s).healthy:   # health() builds a report: only when needed
            self._fail_waiters(BackendUnavailable(hm.health(now_s).message))
        if now_s >= self._next_stale_check_s:
            self._next_stale_check_s = now_s + self.config.stale_check_interval_s
            if s.transport.stale():
                self._drop_session("backend lost: the ring was replaced")
                return
            if self._bell is None:
                self._listen_bell(s.transport)   # a frontend we displaced may have given the name back
        if res.freed and self._waiters:
            self._flush()

    def _fail_inflight(self, message: str) -> None:
        """End every live handle with an error; raise their cancel flags for a daemon to come."""
        s = self._session
        live = [f for f in s.flights.values() if f.handle is not None]
        log.warning("%s; ending %d in-flight requests", message, len(live))
        for f in live:
            f.handle, h = None, f.handle
            h._end("error", message)
        try:
            s.write_cancels([f.slot for f in live])
        except TransportError:
            pass
        self._fail_waiters(BackendUnavailable(message))

    def _drop_session(self, message: str) -> None:
        s = self._session
        self._session = self._reader = None
        self._drop_bell()
        self._down_message = message
        log.warning("detached from the ring: %s", message)
        self._next_attach_s = time.monotonic() + self.config.reattach_interval_s
        if s is not None:
            for f in s.flights.values():
                if f.handle is not None:
                    f.handle, h = None, f.handle
                    h._end("error", message)
            s.close()
        self._fail_waiters(BackendUnavailable(message))

    async def _sleep(self, interval_s: float, fine: bool = False) -> None:
        """Wait before the next poll: the wake-up timer (to the microsecond; without one, a loop
        timer, ~1 ms coarse), or for 0 a yield. Only the poll loop (_run) waits here: the one
        timerfd and `_sleep_fut` belong to one wait at a time.
        A fine wait (`fine`) whose previous yield found the loop idle blocks for the reader's
        fine_sleep_s first: nothing else wanted the loop, and a blocked thread gives the core
        away where a spinning one would keep it from the client and the daemon."""
        if interval_s <= 0:
            pause = self.config.reader.fine_sleep_s
            if fine and pause > 0 and self._loop_idle:
                self._block(pause)
            t0 = time.perf_counter()
            await asyncio.sleep(0)
            self._loop_idle = time.perf_counter() - t0 < IDLE_YIELD_S
            return
        loop = asyncio.get_running_loop()
        fut = self._sleep_fut = loop.create_future()
        if self._timer is not None:
            try:
                self._timer.arm(interval_s)   # an early wake leaves it armed: its expiry then finds no wait
            except OSError as e:              # never seen; keep polling on the loop's own timers
                log.warning("wake-up timer failed (%s); using event-loop timers", e)
                self._drop_timer()
        loop_timer = loop.call_later(interval_s, _resolve, fut) if self._timer is None else None
        try:
            await fut
        finally:
            if loop_timer is not None:
                loop_timer.cancel()
            self._sleep_fut = None

    def _drop_timer(self) -> None:
        if self._timer is not None:
            self._loop.remove_reader(self._timer.fd)
            self._timer.close()
            self._timer = None
        if self._reader is not None:
            self._reader.set_precise_wake(False)

    def _listen_bell(self, transport) -> None:
        """Bind the doorbell of a ring on this host (shares_clock: the shm transport); without it
        (another frontend holds it, not Linux) the reader polls as it would for a remote ring."""
        self._drop_bell()
        if not getattr(transport, "shares_clock", False) or not getattr(transport, "name", None):
            return
        self._bell = BellListener.create(transport.name)
        if self._bell is None:   # taken (a frontend this one displaces): tried again every stale check
            return
        self._loop.add_reader(self._bell.fileno(), self._on_bell)

    def _drop_bell(self) -> None:
        if self._bell is not None:
            self._loop.remove_reader(self._bell.fileno())
            self._bell.close()
            self._bell = None

    def _on_bell(self) -> None:
        """The daemon rang: it wrote tokens or ended slots. Poll now."""
        if self._bell is not None and self._bell.drain() and self._reader is not None:
            self._reader.heard_bell(time.monotonic())
            self._wake()

    def _on_timer(self) -> None:
        """The wake-up timer's fd is readable: end the wait it was armed for."""
        if self._timer is not None and self._timer.consume():
            self._wake()

    def _wake(self) -> None:
        """Poll now (a submission landed, or close)."""
        if self._sleep_fut is not None:
            _resolve(self._sleep_fut)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
