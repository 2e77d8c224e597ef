"""Constraint -> token automaton words for the ring, compiled once per constraint (LRU cache).

    Constraint (request.py) -> regex (regex.py) -> outlines_core.Index over the model's vocabulary
        (vocabulary.py; built once, on first use) -> {state: {token: next}} + accepting states
        -> shared_layout.automaton.from_transitions -> int32 words (bytes), cached by constraint
    -> the request's SamplingExtra.automaton: the daemon steps it with no frontend involvement

Why outlines-core (not xgrammar or llguidance): our daemon must step the constraint by
itself, so the constraint has to become a finite token automaton up front (per state: the
allowed token set and the next state). outlines-core's Index is exactly that, for regexes and
JSON schemas (bounded nesting); it is a Rust wheel with no Python dependencies (no torch),
published for x86_64 and aarch64, so it installs on the DPU. xgrammar and llguidance match
context-free grammars with a pushdown stack that the host steps every token (a per-token
round trip, what BLINK removes), and xgrammar's wheel requires torch and transformers.
The cost: no context-free grammars (guided_grammar gets a 400), and recursion is unrolled
to a bounded depth.

Bounds: compiling runs on a worker thread and a request waits at most `timeout_s` for it
(400 past it; the compile still finishes and is cached); an automaton past `max_words`
ring words is a 400 too. Identical constraints compiling concurrently share one compile.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import time

from outlines_core import Index, Vocabulary
from tokenizers import Tokenizer

from shared_layout.automaton import MAX_AUTOMATON_WORDS, from_transitions

from .regex import has_max_length, to_regex
from .request import Constraint, ConstraintError
from .vocabulary import token_bytes

MAX_REGEX_CHARS = 1 << 17
log = logging.getLogger(__name__)


class AutomatonTooLarge(ConstraintError):
    """The automaton is past the word budget (a 400 unless a lighter form fits)."""


@dataclasses.dataclass(frozen=True)
class CompilerConfig:
    timeout_s: float = 20.0                 # a request waits this long for its constraint's compile
    max_words: int = 1 << 20                # ring words of one automaton at most (4 MiB)
    cache_entries: int = 64                 # compiled automata kept (LRU)
    workers: int = 2


@dataclasses.dataclass(frozen=True)
class Compiled:
    words: bytes               # shared_layout.automaton encoding, little-endian int32
    n_states: int
    compile_s: float


class ConstraintCompiler:
    def __init__(self, tokenizer: Tokenizer, eos_id: int, config: CompilerConfig = CompilerConfig()):
        self.tokenizer, self.eos_id, self.config = tokenizer, eos_id, config
        self._vocabulary: Vocabulary | None = None
        self._cache: collections.OrderedDict[tuple[str, str], Compiled | ConstraintError] = collections.OrderedDict()
        self._running: dict[tuple[str, str], asyncio.Future] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(config.workers, thread_name_prefix="constraint")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def compile(self, c: Constraint) -> Compiled:
        """The constraint's automaton; ConstraintError (a 400) when it cannot or may not be built."""
        key = (c.kind, c.source)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            if isinstance(hit, ConstraintError):
                raise ConstraintError(str(hit), c.param)
            return hit
        loop = asyncio.get_running_loop()
        fut = self._running.get(key)
        if fut is None:
            fut = self._running[key] = asyncio.ensure_future(
                asyncio.wrap_future(self._pool.submit(self.compile_now, c)))
            fut.add_done_callback(lambda f, key=key: self._done(key, f))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.config.timeout_s)
        except TimeoutError:
            raise ConstraintError(f"'{c.param}': the constraint did not compile within {self.config.timeout_s:g} s; "
                                  "simplify it (fewer alternatives, shorter bounded strings)", c.param) from None
        finally:
            del loop

    def _done(self, key, fut: asyncio.Future) -> None:
        self._running.pop(key, None)
        if fut.cancelled():
            return
        err = fut.exception()
        if err is not None and not isinstance(err, ConstraintError):
            return      # an unexpected failure is not cached
        self._cache[key] = err if err is not None else fut.result()
        while len(self._cache) > self.config.cache_entries:
            self._cache.popitem(last=False)

    def vocabulary(self) -> Vocabulary:
        if self._vocabulary is None:
            self._vocabulary = Vocabulary(self.eos_id, token_bytes(self.tokenizer))
        return self._vocabulary

    def compile_now(self, c: Constraint) -> Compiled:
        """The whole compile, synchronously (a worker thread runs it). A schema whose string
        maxLengths make the automaton too large is compiled again without them (minLength and
        everything else still enforced), and the server log says so."""
        t0 = time.perf_counter()
        try:
            return self._compile(c, t0)
        except AutomatonTooLarge:
            if not has_max_length(c):
                raise
        compiled = self._compile(c, t0, drop_max_length=True)
        log.warning("%s: the string maxLength bounds would make the token automaton too large; "
                    "compiled without them (their lengths are not enforced)", c.param)
        return compiled

    def _compile(self, c: Constraint, t0: float, drop_max_length: bool = False) -> Compiled:
        rx = to_regex(c, drop_max_length)
        if len(rx) > MAX_REGEX_CHARS:
            raise ConstraintError(f"'{c.param}': the constraint's regex is {len(rx)} characters; at most "
                                  f"{MAX_REGEX_CHARS} are allowed", c.param)
        try:
            index = Index(rx, self.vocabulary())
        except (ValueError, TypeError, OverflowError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            what = "regex" if c.kind == "regex" else "constraint"
            raise ConstraintError(f"'{c.param}': the {what} does not compile: {first}", c.param) from None
        transitions = index.get_transitions()
        words = from_transitions(transitions, index.get_initial_state(), set(index.get_final_states()),
                                 drop_tokens=frozenset((self.eos_id,)))
        limit = min(self.config.max_words, MAX_AUTOMATON_WORDS)
        if words.size > limit:
            raise AutomatonTooLarge(f"'{c.param}': the constraint's token automaton is {words.size} words "
                                  f"({len(transitions)} states); at most {limit} fit a request", c.param)
        return Compiled(words.tobytes(), len(transitions), time.perf_counter() - t0)
