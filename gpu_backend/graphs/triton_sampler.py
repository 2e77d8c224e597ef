"""Fused Triton kernels for the step graphs' sampling (graphs/sampler.py): ~120 of its ~170 kernels
are the logits processing (48 PyTorch operators) and the counter-based uniform (69 int64
operators); here they are 3 kernels (and the seat update's 8 one), with the same results bit for
bit; the draw's ~40 are 2 kernels, and no sort.

    process(logits, RowParams, SeatState) -> processed logits [R, V]   (2 kernels)
      _process_kernel, one program per (row, column tile):
        x = logit + bias[seat]; -inf where the row's automaton does not allow the token;
        repetition (x > 0: x * (1 / p), else x * p on prompt or output tokens), frequency
        (- f * count), presence (- p * [count > 0]), each rounded as PyTorch's operators round
        (float32, no fused multiply-add, division correctly rounded)
      _ban_kernel, one program per row: the bad words whose prefix ends the seat's recent
        tokens, and the stop ids while the output is shorter than min_tokens -> -inf at those
        ids (after the penalties: a banned logit is -inf either way, penalties being > 0)
    uniform(seed, index) -> [R] float32 in [0, 1)                      (1 kernel)
      sampler.uniform's murmur3-style hash in 32-bit unsigned integers
    update(SeatState, RowParams, tokens)                               (1 kernel)
      each seated row's token counted in its seat and appended to the seat's recent tokens
    draw(x, temperature, top_p, top_k, seed, index, min_p) -> tokens   (2 kernels, no sort)
      _draw_prep_kernel: the greedy token, x / temperature, min_p's cut, each row's largest value;
      _draw_pick_kernel, one program a sampling row (greedy rows stop at the argmax): top-k's
      threshold and top-p's cut by a radix descent over the values' order keys (4 bits a pass, 8
      passes over the row each), then the inverse CDF in token-id order (the hash uniform inline).
      Its sums run in another order than PyTorch's softmax and cumsum (and its exp is the GPU's):
      a draw may differ from sampler.draw's where u or top_p falls within rounding of a boundary

The PyTorch versions in sampler.py stay the reference (and the CPU graphs' code); sample_step
takes these where the step's kernels are "triton" (graphs/fused_forward.py). CPU tests run them
under Triton's interpreter against the reference (tests/gpu_backend/graphs/test_triton_sampler.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kernels import INTERPRETED, _check_device

BAN_WORDS_BLOCK = 64         # bad words a seat holds (sampler.BAD_WORDS), one tile
BAN_LEN_BLOCK = 64           # their prefix length (sampler.BAD_WORD_LEN - 1 = 63), padded
PROCESS_BLOCK = 1024         # columns of one program of _process_kernel
UNIFORM_BLOCK = 128          # rows of one program of _uniform_kernel (one variant for every graph)


@triton.jit(do_not_specialize=["vocab", "stride_l", "stride_s", "stride_a"])
def _process_kernel(logits_ptr, out_ptr, seat_ptr, bias_ptr, counts_ptr, prompt_ptr, rep_ptr, freq_ptr, pres_ptr,
                    auto_on_ptr, auto_allowed_ptr, vocab, stride_l, stride_s, stride_a,
                    HAS_AUTOMATON: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = v < vocab
    seat = tl.load(seat_ptr + r)
    x = tl.load(logits_ptr + r * stride_l + v, mask=m, other=0.0)
    x = x + tl.load(bias_ptr + seat * stride_s + v, mask=m, other=0.0)
    if HAS_AUTOMATON:
        on = tl.load(auto_on_ptr + r).to(tl.int1)
        allowed = tl.load(auto_allowed_ptr + r * stride_a + v, mask=m, other=1).to(tl.int1)
        x = tl.where(on & (allowed == 0), float("-inf"), x)
    counts = tl.load(counts_ptr + seat * stride_s + v, mask=m, other=0.0)
    out_mask = counts > 0
    seen = out_mask | (tl.load(prompt_ptr + seat * stride_s + v, mask=m, other=0).to(tl.int1))
    rep = tl.load(rep_ptr + r)
    penalty = tl.where(seen, rep, 1.0)
    x = x * tl.where(x > 0, tl.math.div_rn(1.0, penalty), penalty)
    x = x - tl.load(freq_ptr + r) * counts
    x = x - tl.load(pres_ptr + r) * out_mask.to(tl.float32)
    tl.store(out_ptr + r * stride_l + v, x, mask=m)


@triton.jit(do_not_specialize=["vocab", "stride_o", "n_words", "word_len", "n_stops"])
def _ban_kernel(out_ptr, seat_ptr, index_ptr, min_tokens_ptr, stop_ptr, recent_ptr, prefix_ptr, plen_ptr, last_ptr,
                vocab, stride_o, n_words, word_len, n_stops,
                WORDS: tl.constexpr, LEN: tl.constexpr, STOPS: tl.constexpr):
    r = tl.program_id(0)
    seat = tl.load(seat_ptr + r)
    index = tl.load(index_ptr + r)
    # multi-token bad words: prefix (right-aligned, -1 padding) == the seat's last tokens
    w = tl.arange(0, WORDS)
    j = tl.arange(0, LEN)
    wm = w < n_words
    jm = j < word_len
    recent = tl.load(recent_ptr + seat * word_len + j, mask=jm, other=-1)                      # [LEN]
    prefix = tl.load(prefix_ptr + (seat * n_words + w[:, None]) * word_len + j[None, :],
                     mask=wm[:, None] & jm[None, :], other=-1)                                  # [WORDS, LEN]
    same = (prefix == recent[None, :]) | (prefix < 0)
    match = tl.min(same.to(tl.int32), axis=1) > 0                                             # [WORDS]
    plen = tl.load(plen_ptr + seat * n_words + w, mask=wm, other=-1)
    last = tl.load(last_ptr + seat * n_words + w, mask=wm, other=vocab)
    ban = wm & match & (plen >= 0) & (plen <= index) & (last >= 0) & (last < vocab)
    tl.store(out_ptr + r * stride_o + last, tl.full([WORDS], float("-inf"), tl.float32), mask=ban)
    # stop ids (EOS included unless ignore_eos) while the output is shorter than min_tokens
    k = tl.arange(0, STOPS)
    ids = tl.load(stop_ptr + r * n_stops + k, mask=k < n_stops, other=-1)
    on = (ids >= 0) & (ids < vocab) & (index < tl.load(min_tokens_ptr + r))
    tl.store(out_ptr + r * stride_o + ids, tl.full([STOPS], float("-inf"), tl.float32), mask=on)


def process(logits: torch.Tensor, p, s) -> torch.Tensor:
    """sampler.process in 2 kernels: raw logits [R, V] float32 (contiguous) -> processed [R, V]."""
    _check_device(logits)
    logits = logits.contiguous()
    r, v = logits.shape
    out = torch.empty_like(logits)
    if r == 0:
        return out
    auto = p.automaton_allowed is not None and p.automaton_allowed.shape[-1] == v
    allowed = p.automaton_allowed if auto else logits
    _process_kernel[(r, triton.cdiv(v, PROCESS_BLOCK))](
        logits, out, p.seat, s.bias, s.counts, s.prompt_mask, p.repetition, p.frequency, p.presence,
        p.automaton_on if auto else p.seat, allowed, v, logits.stride(0), s.bias.stride(0),
        allowed.stride(0), HAS_AUTOMATON=auto, BLOCK=PROCESS_BLOCK, num_warps=4, **_no_fma())
    words, word_len = s.bad_last.shape[1], s.recent.shape[1]
    if words > BAN_WORDS_BLOCK or word_len > BAN_LEN_BLOCK:
        raise ValueError(f"seats of {words} bad words of {word_len + 1} tokens exceed the ban kernel's tiles")
    _ban_kernel[(r,)](out, p.seat, p.index, p.min_tokens, p.stop_ids, s.recent, s.bad_prefix, s.bad_len,
                      s.bad_last, v, out.stride(0), words, word_len, p.stop_ids.shape[1],
                      WORDS=BAN_WORDS_BLOCK, LEN=BAN_LEN_BLOCK, STOPS=triton.next_power_of_2(p.stop_ids.shape[1]),
                      num_warps=4)
    return out


def _no_fma() -> dict:  # triton_aot.options says the same for its ahead-of-time compile
    """x - f * count rounded twice, as PyTorch's two operators round it (no contraction into an FMA)."""
    return {} if INTERPRETED else {"enable_fp_fusion": False}


@triton.jit
def _fmix32(h):
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


@triton.jit
def _hash_uniform(seed, index):
    """sampler.uniform of int64 seeds and token indices: float32 in [0, 1). 64-bit unsigned
    products kept to their low 32 bits: (h * c) mod 2^32 exactly."""
    lo = (seed & 0xFFFFFFFF).to(tl.uint64)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint64)
    h = _fmix32((index & 0xFFFFFFFF).to(tl.uint64) ^ 0x9E3779B9)
    h = _fmix32(lo ^ h)
    h = _fmix32(hi ^ ((h * 0x27D4EB2D) & 0xFFFFFFFF))
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit(do_not_specialize=["n"])
def _uniform_kernel(seed_ptr, index_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    u = _hash_uniform(tl.load(seed_ptr + i, mask=m, other=0), tl.load(index_ptr + i, mask=m, other=0))
    tl.store(out_ptr + i, u, mask=m)


def uniform(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """sampler.uniform in one kernel: [R] int64 seeds and token indices -> [R] float32 in [0, 1)."""
    _check_device(seed)
    n = seed.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=seed.device)
    if n:
        _uniform_kernel[(triton.cdiv(n, UNIFORM_BLOCK),)](seed, index, out, n, BLOCK=UNIFORM_BLOCK, num_warps=1)
    return out


# ---------------------------------------------------------------------------------------------
# logprobs of the raw logits, only for the rows whose record is read

LOGPROB_BLOCK = 1024         # columns of one tile of the logprobs kernel
TOP_BLOCK = 32               # the top entries kept while walking a row (>= TOP_LOGPROBS, a power of two)
LOGPROB_CANDIDATES = True    # two walks: lane maxima bound the top entries, then only candidates are merged
LOGPROB_STAGES = 3           # its walks' tiles loaded through tl.range's pipeline (see DRAW_STAGES), as
                             # timed on the H200 (seventh run): 0.13-0.17 ms a row, every tile merged 0.34-0.38
_LOWEST = tl.constexpr(-9223372036854775808)


@triton.jit
def _sortable(y, v):
    """Values and ids -> int64 keys ordered by value, then by smaller id (for tl.topk)."""
    return ((_order_key(y) - 2147483648) << 32) + (4294967295 - v.to(tl.int64))


@triton.jit
def _merge_top(best, keys, TOP: tl.constexpr):
    """The TOP largest of best [TOP] and a tile of composite keys."""
    return tl.topk(tl.reshape(tl.join(best, tl.topk(keys, TOP)), [2 * TOP]), TOP)


@triton.jit(do_not_specialize=["vocab", "stride", "k", "cap"])
def _logprobs_kernel(raw_ptr, tokens_ptr, want_ptr, lp_ptr, rank_ptr, ids_ptr, vals_ptr, cand_ptr, vocab, stride, k,
                     cap, HAS_WANT: tl.constexpr, TOP: tl.constexpr, BLOCK: tl.constexpr, CANDIDATES: tl.constexpr,
                     STAGES: tl.constexpr):
    """One row a program, for a row whose record is wanted: the log-sum-exp (online max), the
    token's logprob and rank (1 + the ids above it), the k most likely (ids and logprobs, most
    likely first, equal values by id: composite keys, value then smaller id, all distinct). A row
    not wanted writes zeros and reads nothing.

    CANDIDATES (the default): the first walk also keeps each lane's largest key (a lane: one column
    of every tile); the TOP-th largest of those lane maxima, L, has TOP distinct keys at or above
    it (or is the lowest key, where fewer than TOP lanes hold a value, and all are kept), so the
    row's top TOP are among the keys >= L, and those lie in the TOP lanes whose maxima
    are >= L: at most TOP keys a tile (`cap` slots of cand_ptr's row, candidate_cap). A second walk
    writes them there (a running count and a scan), and tl.topk merges them a tile at a time: two
    walks and typically one merge. Without it every tile of the row is merged into the best so far
    (tl.topk of each tile: ~0.3 ms a row over 49,152 logits on the H200, sixth run). The walks
    load through tl.range's pipeline (STAGES, as the draw's)."""
    r = tl.program_id(0)
    j = tl.arange(0, TOP)
    if HAS_WANT:
        want = tl.load(want_ptr + r)
    else:
        want = 1
    lp = 0.0
    rank = tl.program_id(0).to(tl.int64) * 0
    ids = tl.zeros([TOP], tl.int64)
    vals = tl.zeros([TOP], tl.float32)
    if want != 0:
        row = raw_ptr + r * stride
        x_tok = tl.load(row + tl.load(tokens_ptr + r))
        cols = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        above = tl.zeros([BLOCK], tl.int32)
        best = tl.full([TOP], _LOWEST, tl.int64)
        lane_max = tl.full([BLOCK], _LOWEST, tl.int64)
        for n0 in tl.range(0, vocab, BLOCK, num_stages=STAGES):
            v, inside, x, _ = _tile(row, n0, cols, vocab)
            m_new = tl.maximum(m, x)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
            m = m_new
            above += (x > x_tok).to(tl.int32)
            key = tl.where(inside, _sortable(x, v), _LOWEST)
            if CANDIDATES:
                lane_max = tl.maximum(lane_max, key)
            else:
                best = _merge_top(best, key, TOP)
        if CANDIDATES:
            low = tl.min(tl.topk(lane_max, TOP), axis=0)      # L: TOP distinct keys are >= it
            kept = 0
            for n0 in tl.range(0, vocab, BLOCK, num_stages=STAGES):
                v, inside, x, _ = _tile(row, n0, cols, vocab)
                key = tl.where(inside, _sortable(x, v), _LOWEST)
                keep = (inside & (key >= low)).to(tl.int32)
                pos = kept + tl.cumsum(keep, axis=0) - keep
                tl.store(cand_ptr + r * cap + pos, key, mask=(keep > 0) & (pos < cap))
                kept += tl.sum(keep, axis=0)
            tl.debug_barrier()                                # the candidates written, block-wide
            n = tl.minimum(kept, cap)
            for c0 in range(0, n, BLOCK):
                c = c0 + cols
                best = _merge_top(best, tl.load(cand_ptr + r * cap + c, mask=c < n, other=_LOWEST), TOP)
        top = tl.max(m, axis=0)
        log_sum = tl.log(tl.sum(s * tl.exp(m - top), axis=0))
        lp = (x_tok - top) - log_sum                                             # log_softmax's formula
        rank = (tl.sum(above, axis=0) + 1).to(tl.int64)
        ids = 4294967295 - (best & 4294967295)
        vals = (_key_value((best >> 32) + 2147483648) - top) - log_sum
    tl.store(lp_ptr + r, lp)
    tl.store(rank_ptr + r, rank)
    tl.store(ids_ptr + r * k + j, ids, mask=j < k)
    tl.store(vals_ptr + r * k + j, vals, mask=j < k)


def candidate_cap(vocab: int) -> int:
    """Candidate slots a row of the logprobs kernel needs: TOP_BLOCK lanes, a key per tile each."""
    return TOP_BLOCK * triton.cdiv(vocab, LOGPROB_BLOCK)


def logprobs(raw: torch.Tensor, tokens: torch.Tensor, k: int, want: torch.Tensor | None = None,
             candidates: bool = LOGPROB_CANDIDATES):
    """sampler.logprobs in one kernel, for the rows where want != 0 (all without it): raw logits [R, V]
    float32 + tokens [R] -> (logprob [R], rank [R], top ids [R, k], top logprobs [R, k]); zeros in the
    rows not wanted. The same values but for rounding (its sums run in another order; exp and log
    are the GPU's), ranks counted on the raw logits. candidates=False: every tile merged (the A/B)."""
    _check_device(raw)
    raw = raw.contiguous()
    r, v = raw.shape
    if not 0 < k <= min(TOP_BLOCK, v):
        raise ValueError(f"logprobs: k {k} outside 1..{min(TOP_BLOCK, v)}")
    dev = raw.device
    lp, rank = torch.empty(r, dtype=torch.float32, device=dev), torch.empty(r, dtype=torch.int64, device=dev)
    ids, vals = torch.empty((r, k), dtype=torch.int64, device=dev), torch.empty((r, k), dtype=torch.float32, device=dev)
    cap = candidate_cap(v) if candidates else 1
    cand = torch.empty((r, cap), dtype=torch.int64, device=dev)       # the candidates' keys (scratch)
    if r:
        _logprobs_kernel[(r,)](raw, tokens, want if want is not None else tokens, lp, rank, ids, vals, cand, v,
                               raw.stride(0), k, cap, HAS_WANT=want is not None, TOP=TOP_BLOCK, BLOCK=LOGPROB_BLOCK,
                               CANDIDATES=candidates, STAGES=LOGPROB_STAGES, num_warps=8)
    return lp, rank, ids, vals


@triton.jit(do_not_specialize=["vocab", "sink", "recent_len"])
def _update_kernel(tokens_ptr, seat_ptr, counts_ptr, recent_ptr, vocab, sink, recent_len, LEN: tl.constexpr):
    r = tl.program_id(0)
    seat = tl.load(seat_ptr + r)
    if seat != sink:
        token = tl.load(tokens_ptr + r)
        tl.atomic_add(counts_ptr + seat * vocab + token, 1.0)
        j = tl.arange(0, LEN)
        row = recent_ptr + seat * recent_len
        nxt = tl.load(row + j + 1, mask=j + 1 < recent_len, other=0)              # shifted left by one
        nxt = tl.where(j == recent_len - 1, token, nxt)                            # the token appended
        tl.debug_barrier()                                                         # every load before a store
        tl.store(row + j, nxt, mask=j < recent_len)


def update(s, p, tokens: torch.Tensor) -> None:
    """sampler.update in one kernel: each seated row's token counted in its seat (an atomic add on
    device memory: rows never share a seat, the sink aside) and appended to its recent tokens."""
    _check_device(tokens)
    r = tokens.shape[0]
    if r == 0:
        return
    n = s.recent.shape[1]
    _update_kernel[(r,)](tokens, p.seat, s.counts, s.recent, s.vocab, s.sink, n,
                         LEN=triton.next_power_of_2(n), num_warps=1)


# ---------------------------------------------------------------------------------------------
# the draw, without a sort: temperature, min_p and the greedy token; then, for each sampling row
# alone, top-k's and top-p's thresholds by a radix descent over the values' order keys, and the
# inverse CDF in token-id order

DRAW_BLOCK = 1024            # columns of one tile of the draw kernels
PICK_WARPS = 8              # the pick's program: a row's walks, 15 [DRAW_BLOCK] descent accumulators
# Loads of a walk's tiles in flight ahead of the tile being summed (tl.range's software pipeline:
# cp.async into shared memory, STAGES - 1 tiles ahead; 1: none). The draw's walks run without it:
# on the H200 (seventh lent run, bench.cuda_draw's A/B column in both step profiles) 3 stages
# made the draw ~10% slower (1.10-1.11x the time summed over rows and mixes; top-k + top-p 0.86 ->
# 0.77 ms a row, top-p 0.58 -> 0.52), the same tokens
DRAW_STAGES = 1
MIN_TEMPERATURE = 1e-5       # sampler.MIN_TEMPERATURE
_NO_PICK = tl.constexpr(2147483647)   # no id yet (a constexpr: the kernels read it)


@triton.jit(do_not_specialize=["vocab", "stride"])
def _draw_prep_kernel(x_ptr, y_ptr, greedy_ptr, top_ptr, temp_ptr, min_p_ptr, vocab, stride, BLOCK: tl.constexpr,
                      STAGES: tl.constexpr):
    """Per row: the greedy token (first argmax of x). Sampling rows also: y = x / temperature, -inf
    where min_p cuts (softmax(y) < min_p * its largest), and top = the largest y (NaN where y holds
    a NaN: the pick keeps the greedy token, as the reference does for a distribution not finite)."""
    r = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    temp = tl.load(temp_ptr + r)
    sampling = temp >= 1e-5
    t = tl.where(sampling, temp, 1.0)
    min_p = tl.load(min_p_ptr + r)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = cols                                        # a row of -inf: token 0, as argmax gives
    y_max = tl.full([BLOCK], float("-inf"), tl.float32)
    nans = tl.zeros([BLOCK], tl.int32)
    stored = tl.where(sampling, vocab, 0)
    for n0 in tl.range(0, vocab, BLOCK, num_stages=STAGES):
        v = n0 + cols
        m = v < vocab
        x = tl.load(x_ptr + r * stride + v, mask=m, other=float("-inf"))
        take = x > best                                  # strictly: the first index of each lane's max
        best_i = tl.where(take, v, best_i)
        best = tl.where(take, x, best)
        y = tl.math.div_rn(x, t)                         # correctly rounded, as PyTorch's x / t
        y_max = tl.maximum(y_max, y)
        nans += (y != y).to(tl.int32)
        tl.store(y_ptr + r * stride + v, y, mask=v < stored)     # greedy rows store nothing
    top = tl.max(best, axis=0)
    tl.store(greedy_ptr + r, tl.min(tl.where(best == top, best_i, 2147483647), axis=0).to(tl.int64))
    ym = tl.max(y_max, axis=0)
    tl.store(top_ptr + r, tl.where(tl.sum(nans, axis=0) > 0, float("nan"), ym))
    if sampling & (min_p > 0):
        z = tl.zeros([BLOCK], tl.float32)
        for n0 in tl.range(0, vocab, BLOCK, num_stages=STAGES):
            v = n0 + cols
            y = tl.load(y_ptr + r * stride + v, mask=v < vocab, other=float("-inf"))
            z += tl.exp(y - ym)
        total = tl.sum(z, axis=0)
        cut = min_p * (1.0 / total)                      # min_p x the largest probability (1 / total)
        for n0 in tl.range(0, vocab, BLOCK, num_stages=STAGES):
            v = n0 + cols
            m = v < vocab
            y = tl.load(y_ptr + r * stride + v, mask=m, other=float("-inf"))
            y = tl.where(tl.exp(y - ym) / total < cut, float("-inf"), y)
            tl.store(y_ptr + r * stride + v, y, mask=m)


@triton.jit
def _order_key(y):
    """float32 values -> int64 keys in [0, 2^32) ordered as the values are (-0 and +0 one key)."""
    b = tl.where(y == 0.0, 0.0, y).to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(b >= 0, b + 2147483648, -1 - b)


@triton.jit
def _key_value(t):
    """An order key -> its float32 value (_order_key's inverse)."""
    b = tl.where(t >= 2147483648, t - 2147483648, -1 - t)
    return b.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _tile(row_ptr, n0, cols, vocab):
    """A row's tile from column n0: ids, in-row mask, values (-inf past the row), order keys."""
    v = n0 + cols
    m = v < vocab
    y = tl.load(row_ptr + v, mask=m, other=float("-inf"))
    return v, m, y, _order_key(y)


@triton.jit
def _weights(y, m, s0, kth, MASS: tl.constexpr):
    """MASS: exp(y - s0) on the values top-k keeps (>= kth), else 0; otherwise 1 a value (a count)."""
    if MASS:
        w = tl.where(m & (y >= kth), tl.exp(y - s0), 0.0)
    else:
        w = tl.where(m, 1.0, 0.0)
    return w


@triton.jit
def _descend(row_ptr, vocab, s0, kth, target, MASS: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """The largest order key t whose F(t) >= target, F(t) being the weight (_weights) of the row's
    values with key >= t; 0 where none is. Four key bits a pass from the top: 8 passes over the
    row. A pass sums F at the 16 candidates t + d * step the bits decided so far leave: each value's
    digit q (its key's offset from t in steps, clamped to -1..15) adds its weight, once computed,
    to the accumulators d = 1..15 with q >= d (F at d = 0 is F(t), known >= target). Every
    accumulator is a [BLOCK] tensor of one layout, summed lane by lane in tile order and reduced
    once a pass in one order, so F never grows with t, and _above_and_ties sums as this does.
    (Until the sixth lent run a [BLOCK, 16] accumulator: 16 threads each loaded and weighed every
    value, and the pick took ~75 us a pass on the H200.)"""
    cols = tl.arange(0, BLOCK)
    t = tl.program_id(0).to(tl.int64) * 0
    for level in range(8):
        shift = 28 - 4 * level
        f1 = tl.zeros([BLOCK], tl.float32)
        f2 = tl.zeros([BLOCK], tl.float32)
        f3 = tl.zeros([BLOCK], tl.float32)
        f4 = tl.zeros([BLOCK], tl.float32)
        f5 = tl.zeros([BLOCK], tl.float32)
        f6 = tl.zeros([BLOCK], tl.float32)
        f7 = tl.zeros([BLOCK], tl.float32)
        f8 = tl.zeros([BLOCK], tl.float32)
        f9 = tl.zeros([BLOCK], tl.float32)
        f10 = tl.zeros([BLOCK], tl.float32)
        f11 = tl.zeros([BLOCK], tl.float32)
        f12 = tl.zeros([BLOCK], tl.float32)
        f13 = tl.zeros([BLOCK], tl.float32)
        f14 = tl.zeros([BLOCK], tl.float32)
        f15 = tl.zeros([BLOCK], tl.float32)
        for n0 in tl.range(0, vocab, BLOCK, num_stages=STAGES):
            v, m, y, key = _tile(row_ptr, n0, cols, vocab)
            w = _weights(y, m, s0, kth, MASS)
            q = tl.minimum(tl.maximum((key - t) >> shift, -1), 15).to(tl.int32)
            f1 += tl.where(q >= 1, w, 0.0)
            f2 += tl.where(q >= 2, w, 0.0)
            f3 += tl.where(q >= 3, w, 0.0)
            f4 += tl.where(q >= 4, w, 0.0)
            f5 += tl.where(q >= 5, w, 0.0)
            f6 += tl.where(q >= 6, w, 0.0)
            f7 += tl.where(q >= 7, w, 0.0)
            f8 += tl.where(q >= 8, w, 0.0)
            f9 += tl.where(q >= 9, w, 0.0)
            f10 += tl.where(q >= 10, w, 0.0)
            f11 += tl.where(q >= 11, w, 0.0)
            f12 += tl.where(q >= 12, w, 0.0)
            f13 += tl.where(q >= 13, w, 0.0)
            f14 += tl.where(q >= 14, w, 0.0)
            f15 += tl.where(q >= 15, w, 0.0)
        # F falls as d grows: the largest d with F(d) >= target is how many of d = 1..15 reach it
        d = ((tl.sum(f1, axis=0) >= target).to(tl.int64) +
             (tl.sum(f2, axis=0) >= target).to(tl.int64) +
             (tl.sum(f3, axis=0) >= target).to(tl.int64) +
             (tl.sum(f4, axis=0) >= target).to(tl.int64) +
             (tl.sum(f5, axis=0) >= target).to(tl.int64) +
             (tl.sum(f6, axis=0) >= target).to(tl.int64) +
             (tl.sum(f7, axis=0) >= target).to(tl.int64) +
             (tl.sum(f8, axis=0) >= target).to(tl.int64) +
             (tl.sum(f9, axis=0) >= target).to(tl.int64) +
             (tl.sum(f10, axis=0) >= target).to(tl.int64) +
             (tl.sum(f11, axis=0) >= target).to(tl.int64) +
             (tl.sum(f12, axis=0) >= target).to(tl.int64) +
             (tl.sum(f13, axis=0) >= target).to(tl.int64) +
             (tl.sum(f14, axis=0) >= target).to(tl.int64) +
             (tl.sum(f15, axis=0) >= target).to(tl.int64))
        t = t + (d << shift)
    return t


@triton.jit
def _above_and_ties(row_ptr, vocab, s0, kth, t, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """The weight of the values top-k keeps with key > t (F(t + 1), summed as _descend sums), and
    how many of them have key t."""
    cols = tl.arange(0, BLOCK)
    a = tl.zeros([BLOCK], tl.float32)
    n = tl.zeros([BLOCK], tl.int32)
    for n0 in tl.range(0, vocab, BLOCK, num_stages=STAGES):
        v, m, y, key = _tile(row_ptr, n0, cols, vocab)
        a += tl.where(key > t, _weights(y, m, s0, kth, True), 0.0)
        n += (m & (y >= kth) & (key == t)).to(tl.int32)
    return tl.sum(a, axis=0), tl.sum(n, axis=0)


@triton.jit
def _inverse_cdf(row_ptr, vocab, s0, kth, tp, n_tp, target, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """The first id, in id order over the kept values (>= kth, and key > tp or among the first n_tp
    ids of key tp), whose cumulative weight exceeds target; past the total (rounding): the last kept
    id of positive weight; -1 where none has."""
    cols = tl.arange(0, BLOCK)
    run = 0.0
    ties = 0
    pick = _NO_PICK
    last = -1
    for n0 in tl.range(0, vocab, BLOCK, num_stages=STAGES):
        v, m, y, key = _tile(row_ptr, n0, cols, vocab)
        tie = (m & (y >= kth) & (key == tp)).to(tl.int32)
        rank = ties + tl.cumsum(tie, axis=0) - tie                                # among key tp, in id order
        kept = (key > tp) | ((tie > 0) & (rank < n_tp))
        w = tl.where(kept, _weights(y, m, s0, kth, True), 0.0)
        cum = run + tl.cumsum(w, axis=0)
        pick = tl.minimum(pick, tl.min(tl.where((w > 0) & (cum > target), v, _NO_PICK), axis=0))
        last = tl.maximum(last, tl.max(tl.where(w > 0, v, -1), axis=0))
        run += tl.sum(w, axis=0)
        ties += tl.sum(tie, axis=0)
    return tl.where(pick < _NO_PICK, pick, last)


@triton.jit(do_not_specialize=["vocab", "stride"])
def _draw_pick_kernel(y_ptr, top_ptr, greedy_ptr, temp_ptr, top_p_ptr, top_k_ptr, seed_ptr, index_ptr, tokens_ptr,
                      vocab, stride, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Per sampling row, over its values y in id order (no sort): top-k keeps the values >= the
    k-th largest (ties kept), top-p the values, in descending order and among equal ones by id,
    while those before them hold less than top_p; then the inverse CDF in id order at the row's
    hash uniform. The greedy token for greedy rows and rows whose distribution is not finite."""
    r = tl.program_id(0)
    token = tl.load(greedy_ptr + r)
    temp = tl.load(temp_ptr + r)
    s0 = tl.load(top_ptr + r)                            # the largest value: weights exp(y - s0) <= 1
    if (temp >= 1e-5) & (s0 > float("-inf")) & (s0 < float("inf")):
        row = y_ptr + r * stride
        k = tl.load(top_k_ptr + r)
        kth = s0 * 0.0 + float("-inf")
        tp_none = k.to(tl.int64) * 0 - 1
        if (k > 0) & (k < vocab):                        # the k-th largest value: F counts values
            kth = _key_value(_descend(row, vocab, s0, kth, k.to(tl.float32), False, BLOCK, STAGES))
        z, _ = _above_and_ties(row, vocab, s0, kth, tp_none, BLOCK, STAGES)             # the mass top-k keeps
        top_p = tl.load(top_p_ptr + r)
        tp = tp_none                                     # top-p's cut key; -1: none
        n_tp = k.to(tl.int32) * 0
        if top_p < 1.0:
            limit = top_p * z
            tp = _descend(row, vocab, s0, kth, limit, True, BLOCK, STAGES)    # where the running mass reaches limit
            above, n_tie = _above_and_ties(row, vocab, s0, kth, tp, BLOCK, STAGES)
            w_tie = tl.exp(_key_value(tp) - s0)                        # NaN where tp is 0 (no cut)
            some = (n_tie > 0) & (w_tie > 0)
            # the values of key tp stay, by id, while the mass before them is below limit
            stay = tl.ceil(tl.math.div_rn(limit - above, tl.where(some, w_tie, 1.0)))
            stay = tl.minimum(tl.maximum(stay, 1.0), n_tie.to(tl.float32))
            stay = tl.where((stay > 1.0) & (above + (stay - 1.0) * w_tie >= limit), stay - 1.0, stay)
            n_tp = tl.where(some, stay.to(tl.int32), n_tie)
            z = above + tl.where(n_tp > 0, n_tp.to(tl.float32) * w_tie, 0.0)
        target = _hash_uniform(tl.load(seed_ptr + r), tl.load(index_ptr + r)) * z
        pick = _inverse_cdf(row, vocab, s0, kth, tp, n_tp, target, BLOCK, STAGES)
        token = tl.where(pick >= 0, pick.to(tl.int64), token)
    tl.store(tokens_ptr + r, token)


def draw(x: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, seed: torch.Tensor,
         index: torch.Tensor, min_p: torch.Tensor | None = None, stages: int = DRAW_STAGES) -> torch.Tensor:
    """sampler.draw in 2 kernels and no sort: processed logits [R, V] float32 -> tokens [R]. The same
    rules and the same hash uniform; sums in another order than PyTorch's softmax and cumsum, so a
    draw can differ from sampler.draw's where u (or top_p) falls within rounding of a boundary."""
    _check_device(x)
    r, v = x.shape
    tokens = torch.empty(r, dtype=torch.int64, device=x.device)
    if r == 0:
        return tokens
    x = x.contiguous()
    y = torch.empty_like(x)
    greedy = torch.empty(r, dtype=torch.int64, device=x.device)
    top = torch.empty(r, dtype=torch.float32, device=x.device)
    mp = min_p if min_p is not None else torch.zeros_like(temperature)
    _draw_prep_kernel[(r,)](x, y, greedy, top, temperature, mp, v, x.stride(0), BLOCK=DRAW_BLOCK, STAGES=stages,
                            num_warps=4, **_no_fma())
    _draw_pick_kernel[(r,)](y, top, greedy, temperature, top_p, top_k, seed, index, tokens, v, y.stride(0),
                            BLOCK=DRAW_BLOCK, STAGES=stages, num_warps=PICK_WARPS, **_no_fma())
    return tokens
