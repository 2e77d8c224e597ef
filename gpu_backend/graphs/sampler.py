"""In-graph sampling: logits of every row -> one token per row (+ its logprob record),
with no host sync and no data-dependent shape, so it is captured inside each step graph.

    raw logits [R, V] float32
      RowParams [R] (staged by the graph's first kernel from each row's request copy):
        temperature, top_p, top_k, min_p, seed, token index (= tokens generated before
        this draw), presence / frequency / repetition penalties, min_tokens, stop ids
        [R, ROW_STOPS] (the slot's stop ids + EOS unless ignore_eos), seat, and for a
        structured output its automaton's allowed tokens at the current state [R, V]
      SeatState [seats + 1, ...] (per active request, on the device; the last seat is the
        sink, always neutral): bias row [V] (logit_bias added, -inf on tokens not allowed
        and on one-token bad words), prompt mask [V], output counts [V], the last
        BAD_WORD_LEN - 1 generated tokens, the multi-token bad words
      -> process (logits_processors.apply's order and formulas): + bias row -> bad words
         whose prefix ends the output, stop ids before min_tokens and the tokens a row's
         automaton does not allow -> -inf ->
         repetition (logit > 0: / p, else * p on prompt or output tokens), frequency
         (- f * count), presence (- p * [count > 0])
      -> greedy rows (temperature < MIN_TEMPERATURE): argmax of the processed logits
      -> others: / temperature -> min_p -> sort (descending, ties by id) -> top-k (ties with
         the k-th kept) -> top-p (a token stays while the ones before it hold less than top_p;
         the first always stays) -> softmax -> inverse CDF in token-id order (the CPU
         daemon's) at u = hash(seed, token index) -> token; a row whose filtered
         distribution is not finite keeps the argmax
      -> logprobs of the *raw* logits (vLLM's raw_logprobs, as logprobs.records): the
         token's logprob and rank, the MAX_LOGPROBS most likely ids and logprobs (the fused
         kernel: only for rows with lp_want, whose record is read; zeros elsewhere)
      -> update: each seated row's token counted in its seat, appended to its recent tokens

Every rule runs on every row: a neutral parameter (bias 0, penalties 0/1, min_p 0, no
stop ids, the sink seat) leaves a row's logits bit for bit as they were, so a batch
mixing plain and processed requests needs no branch. Rows that do not sample this step
(a prefill piece before a chunk's last) and padding rows use the sink seat, whose
update is a no-op.

The processing and filtering are gpu_backend/logits_processors.apply and
sampling.filter_batch (the CPU daemon's) written with static shapes; the draw differs: a
counter-based uniform (a murmur3-style hash of the request's seed and the index of the
token being drawn) instead of a torch.Generator, so a request's draws depend on nothing
else in its batch, a recompute after preemption draws the same tokens, and the same
seed gives the same tokens on every run. The hash uses only int64 ops on values below
2^49, so it is exact and identical on CPU and GPU. The same code runs eagerly on CPU
tensors: tests/gpu_backend/graphs/test_sampler_twin.py diffs it with the CPU daemon's
sampler.
"""
from __future__ import annotations

import dataclasses

import torch

from shared_layout.layout import MAX_LOGPROBS, MAX_STOP_IDS

MIN_TEMPERATURE = 1e-5          # as gpu_backend/sampling.py: below this, argmax
ROW_STOPS = 2 * MAX_STOP_IDS    # a row's stop ids: the slot's (8) and the model's EOS ids (8)
BAD_WORDS = 64                  # multi-token bad words a seat holds
BAD_WORD_LEN = 64               # tokens of one bad word at most (shared_layout.extra.MAX_BAD_WORD_TOKENS)
TOP_LOGPROBS = MAX_LOGPROBS     # top entries computed for a row; a record keeps its first k
_M32 = 0xFFFF_FFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), without int64 overflow: c split in 16-bit halves."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + ((x * hi) & 0xFFFF) * 65536) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser on 32-bit values held in int64."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EB_CA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2_AE35)
    return h ^ (h >> 16)


def uniform(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[R] int64 seeds (any 64 bits) and token indices -> [R] float32 in [0, 1) (24-bit resolution)."""
    lo = seed & _M32
    hi = (seed >> 32) & _M32                       # arithmetic shift, then the low 32 bits: the seed's high word
    h = _fmix32((index & _M32) ^ 0x9E37_79B9)
    h = _fmix32(lo ^ h)
    h = _fmix32(hi ^ _mul32(h, 0x27D4_EB2D))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def uniform_reference(seed: int, index: int) -> float:
    """The same hash in Python integers (the test's reference)."""
    def fmix(h):
        h ^= h >> 16
        h = (h * 0x85EB_CA6B) & _M32
        h ^= h >> 13
        h = (h * 0xC2B2_AE35) & _M32
        return h ^ (h >> 16)
    seed &= (1 << 64) - 1
    h = fmix((index & _M32) ^ 0x9E37_79B9)
    h = fmix((seed & _M32) ^ h)
    h = fmix((seed >> 32) ^ ((h * 0x27D4_EB2D) & _M32))
    return (h >> 8) / (1 << 24)


@dataclasses.dataclass
class RowParams:
    """Per-row sampling parameters, [R] each (views of the static buffers in a graph)."""
    temperature: torch.Tensor     # [R] f32
    top_p: torch.Tensor           # [R] f32
    top_k: torch.Tensor           # [R] i64, 0 = off
    seed: torch.Tensor            # [R] i64
    index: torch.Tensor           # [R] i64: tokens generated before this draw
    min_p: torch.Tensor           # [R] f32, 0 = off
    presence: torch.Tensor        # [R] f32
    frequency: torch.Tensor       # [R] f32
    repetition: torch.Tensor      # [R] f32, 1 = off
    min_tokens: torch.Tensor      # [R] i64: stop ids masked while index < min_tokens
    stop_ids: torch.Tensor        # [R, ROW_STOPS] i64, -1 = unused
    seat: torch.Tensor            # [R] i64 into SeatState; the sink seat for rows without one
    automaton_on: torch.Tensor | None = None       # [R] bool: the row samples under a token automaton
    automaton_allowed: torch.Tensor | None = None  # [R, V] bool: its allowed tokens (staged: csrc/automaton.h)
    lp_want: torch.Tensor | None = None  # [R] i64, 1: the row's logprob record is read (None: every row's);
                                         # the fused logprobs skip the others (the PyTorch ones compute all)

    @classmethod
    def neutral(cls, rows: int, sink_seat: int, device="cpu") -> "RowParams":
        f32, i64 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int64, device=device)
        return cls(torch.zeros(rows, **f32), torch.ones(rows, **f32), torch.zeros(rows, **i64),
                   torch.zeros(rows, **i64), torch.zeros(rows, **i64), torch.zeros(rows, **f32),
                   torch.zeros(rows, **f32), torch.zeros(rows, **f32), torch.ones(rows, **f32),
                   torch.zeros(rows, **i64), torch.full((rows, ROW_STOPS), -1, **i64),
                   torch.full((rows,), sink_seat, **i64))

    def view(self, r: int) -> "RowParams":
        """The first r rows (a graph of r rows reads these views of the static buffers)."""
        return RowParams(*(None if getattr(self, f.name) is None else getattr(self, f.name)[:r]
                           for f in dataclasses.fields(self)))


class SeatState:
    """What a request keeps on the device between steps while it runs: `seats` seats plus
    the sink (index `seats`), which stays neutral (no bias, nothing counted, no bad words)."""

    def __init__(self, seats: int, vocab: int, device="cpu"):
        n = seats + 1
        self.seats, self.vocab, self.sink = seats, vocab, seats
        f32, i64 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int64, device=device)
        self.bias = torch.zeros(n, vocab, **f32)                                  # [S+1, V]
        self.counts = torch.zeros(n, vocab, **f32)                                # [S+1, V] output counts
        self.prompt_mask = torch.zeros(n, vocab, dtype=torch.bool, device=device)  # [S+1, V]
        self.recent = torch.full((n, BAD_WORD_LEN - 1), -1, **i64)                # [S+1, L-1] right-aligned
        self.bad_prefix = torch.full((n, BAD_WORDS, BAD_WORD_LEN - 1), -1, **i64)  # [S+1, W, L-1] right-aligned
        self.bad_len = torch.full((n, BAD_WORDS), -1, **i64)                      # [S+1, W] prefix tokens; -1 unused
        self.bad_last = torch.full((n, BAD_WORDS), vocab, **i64)                  # [S+1, W] banned token; V unused

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor))

    @staticmethod
    def nbytes_for(seats: int, vocab: int) -> int:
        n = seats + 1
        return n * (vocab * (4 + 4 + 1) + 8 * ((BAD_WORD_LEN - 1) * (1 + BAD_WORDS) + 2 * BAD_WORDS))

    @torch.inference_mode()
    def fill(self, seat: int, prompt, output, logit_bias=(), allowed_token_ids=(), bad_words=()) -> None:
        """Seat `seat` for a request: its bias row, prompt mask, counts of its output so far and
        its bad words (ValueError when they exceed the seat). The host loop's setup when a
        request gets a seat (and again after a preemption); csrc/model_step.h's blink_fill_seat
        is its twin on the device, filling from the ring."""
        if not 0 <= seat < self.seats:
            raise ValueError(f"seat {seat} outside 0..{self.seats - 1}")
        multi = [tuple(w) for w in bad_words if len(w) > 1]
        if len(multi) > BAD_WORDS or any(len(w) > BAD_WORD_LEN for w in multi):
            raise ValueError(f"bad words beyond what a graph seat holds ({BAD_WORDS} multi-token words "
                             f"of at most {BAD_WORD_LEN} tokens)")
        dev, v = self.bias.device, self.vocab
        row = torch.zeros(v, dtype=torch.float32)
        if allowed_token_ids:
            keep = torch.zeros(v, dtype=torch.bool)
            keep[torch.tensor(list(allowed_token_ids), dtype=torch.long)] = True
            row.masked_fill_(~keep, float("-inf"))
        singles = [w[0] for w in bad_words if len(w) == 1]
        if singles:
            row[torch.tensor(singles, dtype=torch.long)] = float("-inf")
        if logit_bias:
            ids = torch.tensor([t for t, _ in logit_bias], dtype=torch.long)
            row.index_put_((ids,), torch.tensor([b for _, b in logit_bias], dtype=torch.float32), accumulate=True)
        self.bias[seat].copy_(row.to(dev))
        mask = torch.zeros(v, dtype=torch.bool)
        if len(prompt):
            mask[torch.as_tensor(list(prompt), dtype=torch.long)] = True
        self.prompt_mask[seat].copy_(mask.to(dev))
        counts = torch.zeros(v, dtype=torch.float32)
        out = list(output)
        if out:
            counts.index_put_((torch.tensor(out, dtype=torch.long),), torch.ones(len(out)), accumulate=True)
        self.counts[seat].copy_(counts.to(dev))
        recent = torch.full((BAD_WORD_LEN - 1,), -1, dtype=torch.int64)
        tail = out[-(BAD_WORD_LEN - 1):]
        if tail:
            recent[-len(tail):] = torch.tensor(tail, dtype=torch.int64)
        self.recent[seat].copy_(recent.to(dev))
        prefix = torch.full((BAD_WORDS, BAD_WORD_LEN - 1), -1, dtype=torch.int64)
        plen = torch.full((BAD_WORDS,), -1, dtype=torch.int64)
        last = torch.full((BAD_WORDS,), v, dtype=torch.int64)
        for j, w in enumerate(multi):
            prefix[j, BAD_WORD_LEN - len(w):] = torch.tensor(w[:-1], dtype=torch.int64)
            plen[j], last[j] = len(w) - 1, w[-1]
        self.bad_prefix[seat].copy_(prefix.to(dev))
        self.bad_len[seat].copy_(plen.to(dev))
        self.bad_last[seat].copy_(last.to(dev))
        if self.bias.is_cuda:       # the graph runs on another stream: the seat is complete before it launches
            torch.cuda.current_stream(self.bias.device).synchronize()


def _hits(rows: int, vocab: int, ids: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """[R, V] bool: token ids[r, j] (V or more: none) marked where on[r, j]. Static shapes:
    a scatter-add into one spare column past the vocabulary takes the unused entries."""
    hits = torch.zeros(rows, vocab + 1, dtype=torch.float32, device=ids.device)
    hits.scatter_add_(1, ids.clamp(0, vocab), on.to(torch.float32))
    return hits[:, :vocab] > 0


def process(logits: torch.Tensor, p: RowParams, s: SeatState) -> torch.Tensor:
    """raw logits [R, V] float32 -> processed logits [R, V] (logits_processors.apply's rules)."""
    r, v = logits.shape
    x = logits + s.bias.index_select(0, p.seat)                                      # [R, V]
    # multi-token bad words: the seat's recent tokens end with the word's prefix
    prefix = s.bad_prefix.index_select(0, p.seat)                                    # [R, W, L-1]
    recent = s.recent.index_select(0, p.seat)[:, None, :]                            # [R, 1, L-1]
    plen = s.bad_len.index_select(0, p.seat)                                         # [R, W]
    match = ((prefix == recent) | (prefix < 0)).all(dim=-1) & (plen >= 0) & (plen <= p.index[:, None])
    banned = _hits(r, v, s.bad_last.index_select(0, p.seat), match)
    # stop ids (EOS included unless ignore_eos) while the output is shorter than min_tokens
    stop = (p.stop_ids >= 0) & (p.index < p.min_tokens)[:, None]                    # [R, STOPS]
    banned |= _hits(r, v, torch.where(p.stop_ids >= 0, p.stop_ids, torch.full_like(p.stop_ids, v)), stop)
    # structured output: every token the automaton does not allow now (a static condition: the
    # buffers exist or not, never a data-dependent branch)
    if p.automaton_allowed is not None and p.automaton_allowed.shape[-1] == v:
        banned |= p.automaton_on[:, None] & ~p.automaton_allowed
    x = x.masked_fill(banned, float("-inf"))
    # penalties, vLLM's formulas (neutral values leave x unchanged bit for bit)
    counts = s.counts.index_select(0, p.seat)                                        # [R, V]
    out_mask = counts > 0
    seen = out_mask | s.prompt_mask.index_select(0, p.seat)
    rep = p.repetition[:, None]
    penalty = torch.where(seen, rep, torch.ones_like(x))
    x = x * torch.where(x > 0, 1.0 / penalty, penalty)
    return x - p.frequency[:, None] * counts - p.presence[:, None] * out_mask.to(x.dtype)


def filtered_sorted(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                    top_k: torch.Tensor, min_p: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] -> (probabilities in descending-logit order [R, V], that order [R, V])."""
    v = logits.shape[-1]
    t = torch.where(temperature < MIN_TEMPERATURE, torch.ones_like(temperature), temperature)   # [R]
    x = logits / t[:, None]                                                                     # [R, V]
    if min_p is not None:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)                       # [R, V]: ties by id
    k = torch.where((top_k > 0) & (top_k < v), top_k, torch.full_like(top_k, v))                # [R]
    kth = sorted_x.gather(1, (k - 1)[:, None])                                                  # [R, 1]
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    limit = torch.where(top_p < 1.0, top_p, torch.full_like(top_p, float("inf")))[:, None]      # 1: off
    drop = (torch.cumsum(probs, dim=-1) - probs) >= limit                                       # [R, V]
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.softmax(sorted_x, dim=-1), order


def draw(x: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, seed: torch.Tensor,
         index: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """processed logits [R, V] -> tokens [R] int64: argmax for greedy and degenerate rows, else
    the filtered distribution's inverse CDF, in token-id order (as the CPU daemon draws,
    sampling.draw), at the row's hash uniform: the first id whose cumulative probability exceeds
    u x the total, never past the last id the filters keep."""
    v = x.shape[-1]
    greedy = x.argmax(dim=-1)                                                                   # [R]
    probs, order = filtered_sorted(x, temperature, top_p, top_k, min_p)                         # [R, V]
    by_id = torch.zeros_like(probs).scatter_(1, order, probs)                                   # [R, V]
    cdf = torch.cumsum(by_id, dim=-1)                                                           # [R, V]
    u = uniform(seed, index) * cdf[:, -1]                                                       # [R]
    pick = torch.searchsorted(cdf, u[:, None], right=True)[:, 0]                               # [R]
    ids = torch.arange(v, device=x.device)
    last = torch.where(by_id > 0, ids, torch.full_like(ids, -1)).amax(dim=-1)                   # [R]
    drawn = torch.minimum(pick, last.clamp(min=0))
    ok = torch.isfinite(probs).all(dim=-1) & (temperature >= MIN_TEMPERATURE)
    return torch.where(ok, drawn, greedy)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Temperature, top-k and top-p only: logits [R, V] float32; temperature, top_p [R] float32;
    top_k, seed, index [R] int64 -> tokens [R] int64."""
    return draw(logits, temperature, top_p, top_k, seed, index)


@dataclasses.dataclass
class StepSample:
    tokens: torch.Tensor          # [R] i64
    logprob: torch.Tensor         # [R] f32: the token's logprob under the raw logits
    rank: torch.Tensor            # [R] i64: 1 = most likely
    top_ids: torch.Tensor         # [R, TOP_LOGPROBS] i64, most likely first
    top_logprobs: torch.Tensor    # [R, TOP_LOGPROBS] f32


def logprobs(raw: torch.Tensor, tokens: torch.Tensor, k: int = TOP_LOGPROBS):
    """raw logits [R, V] + tokens [R] -> (logprob [R], rank [R], top ids [R, k], top logprobs [R, k])
    (logprobs.records' values, before packing)."""
    lp = torch.log_softmax(raw.float(), dim=-1)                                                 # [R, V]
    chosen = lp.gather(1, tokens[:, None])                                                      # [R, 1]
    rank = (lp > chosen).sum(dim=-1) + 1                                                        # [R]
    top = torch.topk(lp, k, dim=-1)
    return chosen[:, 0], rank, top.indices, top.values


def update(s: SeatState, p: RowParams, tokens: torch.Tensor) -> None:
    """Count each seated row's token in its seat and append it to the seat's recent tokens
    (in place; sink rows write the sink's own values back)."""
    seated = p.seat != s.sink                                                                   # [R]
    # a scatter-add over the flattened counts: one plain kernel (no sort), safe to capture
    s.counts.view(-1).scatter_add_(0, p.seat * s.vocab + tokens, seated.to(torch.float32))
    old = s.recent.index_select(0, p.seat)                                                      # [R, L-1]
    new = torch.cat([old[:, 1:], tokens[:, None]], dim=1)
    s.recent.index_copy_(0, p.seat, torch.where(seated[:, None], new, old))


def sample_step(logits: torch.Tensor, p: RowParams, s: SeatState, kernels: str = "torch") -> StepSample:
    """The graph's sampling: raw logits [R, V] -> StepSample; the seats updated in place. kernels
    "triton": the processing, the draw, the logprobs and the seat update by triton_sampler's fused
    kernels (the same results; a draw may part from this one where u falls within rounding of a CDF
    step, logprobs by rounding; rows whose logprob record nobody reads, p.lp_want 0, get zeros)."""
    k = min(TOP_LOGPROBS, logits.shape[-1])
    if kernels == "triton":
        from . import triton_sampler
        process_, draw_, update_ = triton_sampler.process, triton_sampler.draw, triton_sampler.update

        def logprobs_(raw, tokens):
            return triton_sampler.logprobs(raw, tokens, k, p.lp_want)
    else:
        process_, draw_, update_ = process, draw, update

        def logprobs_(raw, tokens):
            return logprobs(raw, tokens, k)
    raw = logits.float()
    x = process_(raw, p, s)
    tokens = draw_(x, p.temperature, p.top_p, p.top_k, p.seed, p.index, p.min_p)
    lp, rank, ids, vals = logprobs_(raw, tokens)
    update_(s, p, tokens)
    return StepSample(tokens, lp, rank, ids, vals)
