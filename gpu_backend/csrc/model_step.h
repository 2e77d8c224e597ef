/* The model step graph's own kernels, around the captured PyTorch forward:
 *
 *   blink_stage_row   (first node, one block per row) the step's rows
 *                     (row_*, written by the scheduler or the host loop), the
 *                     request copies (reqs) and block tables (kv_tables) and
 *                     the token ids in the ring's arenas -> the graph's static
 *                     input tensors: ids, positions, KV slots, block tables,
 *                     query lengths, the sampling parameters of each row and
 *                     whether its logprob record is wanted (lp_want)
 *   ... the captured forward + in-graph sampling (gpu_backend/graphs/step.py)
 *       reads those tensors and writes io->tokens[row] ...
 *   blink_finish_rows (last node) each sampling row's token -> step_tokens[chunk];
 *                     with BLINK_FLAG_LOGPROBS in the request copy (the device
 *                     scheduler's; the host loop publishes its own) the row's
 *                     logprob record -> the ring's logprob arena at the record of
 *                     the token being published; then the kernel stores step_no
 *                     into *done (the last write)
 *
 * Sampling data per row (graphs/sampler.RowParams): temperature, top_p, top_k,
 * seed, token index, min_p, penalties, min_tokens and the ids it masks, and the
 * request's sampler seat, on the sampling row only (every other row, padding
 * included, gets the sink seat, whose in-graph update is a no-op). What a seat
 * holds (bias row, prompt mask, output counts, recent tokens, bad words) is filled
 * when the request got it: by the host loop in Python (graphs/hostloop.SeatTable),
 * or, for the persistent scheduler, here: a seat taken at admission is marked
 * fresh, and the staging of the request's next sampling row fills it from the
 * ring (the slot's sampling data in the prompt arena, its prompt, its output so
 * far) before the sampler reads it (blink_fill_seat, SeatState.fill's twin).
 *
 * The contract with the scheduler is the stand-in echo's (echo_step.h): read the
 * step descriptor, write one token per sampled chunk into step_tokens, then the
 * done flag. Written once for the device and the CPU twin (template over the
 * platform), so CI runs the very staging code the graph runs.
 *
 * Token ids are re-read from the ring's arenas at every (re)prefill; an id the
 * frontend scribbled out of the vocabulary since intake becomes 0 rather than an
 * out-of-range embedding index (a device-side assert would end the context).
 *
 * Padding: rows past state->n_rows and tokens past a row's length get id 0,
 * position 0 and a KV slot in the sink block (one block past the pool, never
 * handed out), and block-table entries past the row's blocks point there too,
 * so the fixed-shape forward writes and reads only memory it owns.
 */
#ifndef BLINK_MODEL_STEP_H
#define BLINK_MODEL_STEP_H

#include <string.h>

#include "automaton.h"
#include "sched_types.h"

typedef struct BLINK_ALIGN8 blink_step_io {
    int64_t *input_ids;           /* [rows * len] token ids */
    int64_t *positions;           /* [rows * len] positions in the sequence */
    int64_t *slot_mapping;        /* [rows * len] KV slot: block * block_size + offset */
    int64_t *block_tables;        /* [rows * (ctx / block_size)] */
    int64_t *q_lens;              /* [rows] tokens of the row; 0 for padding rows */
    float *temperature;           /* [rows] */
    float *top_p;                 /* [rows] */
    int64_t *top_k;               /* [rows] */
    int64_t *seeds;               /* [rows] */
    int64_t *token_index;         /* [rows] tokens generated before the one a sampling row draws */
    int64_t *tokens;              /* [rows] written by the graph: each row's sampled token */
    float *min_p;                 /* [rows] */
    float *presence;              /* [rows] */
    float *frequency;             /* [rows] */
    float *repetition;            /* [rows] 1 = off */
    int64_t *min_tokens;          /* [rows] */
    int64_t *stop_ids;            /* [rows * BLINK_ROW_STOPS] masked before min_tokens; -1 = unused */
    int64_t *seat;                /* [rows] sampler seat; sink_seat for rows without one */
    float *lp_token;              /* [rows] written by the graph: the token's logprob (raw logits) */
    int64_t *lp_rank;             /* [rows] its rank, 1 = most likely */
    int64_t *lp_top_ids;          /* [rows * BLINK_TOP_LOGPROBS] most likely first */
    float *lp_top_vals;           /* [rows * BLINK_TOP_LOGPROBS] */
    float *seat_bias;             /* [seats + 1, vocab] graphs/sampler.SeatState, filled by blink_fill_seat */
    float *seat_counts;           /* [seats + 1, vocab] */
    uint8_t *seat_prompt_mask;    /* [seats + 1, vocab] torch.bool */
    int64_t *seat_recent;         /* [seats + 1, BLINK_BAD_WORD_LEN - 1] right-aligned, -1 = none */
    int64_t *seat_bad_prefix;     /* [seats + 1, BLINK_BAD_WORDS, BLINK_BAD_WORD_LEN - 1] right-aligned, -1 pad */
    int64_t *seat_bad_len;        /* [seats + 1, BLINK_BAD_WORDS] prefix tokens; -1 = unused */
    int64_t *seat_bad_last;       /* [seats + 1, BLINK_BAD_WORDS] the banned token; vocab = unused */
    uint8_t *automaton_on;        /* [rows] torch.bool: the row samples under a token automaton */
    uint8_t *automaton_allowed;   /* [rows, vocab] torch.bool: its allowed tokens now (-inf elsewhere) */
    int64_t *lp_want;             /* [rows] 1: the row's logprob record is read (a sampling row whose
                                     request asks logprobs); the in-graph logprobs skip the others */
    uint32_t block_size;
    uint32_t sink_block;          /* == the pool's block count: padding's K/V lands there */
    uint32_t sink_seat;           /* == the seats the graph holds: the neutral seat */
    uint32_t vocab;               /* the seats' row width */
} blink_step_io_t;

/* Row r's sampling parameters beyond temperature / top_p / top_k / seed (q 0: a padding row, neutral). */
static inline BLINK_HD void blink_stage_sampling(const blink_step_io_t *io, uint32_t r, const blink_req_t *q,
                                                 uint32_t seat) {
    int64_t *stops = io->stop_ids + (uint64_t)r * BLINK_ROW_STOPS;
    const uint32_t n_stops = q ? (q->n_mask_stops < BLINK_ROW_STOPS ? q->n_mask_stops : BLINK_ROW_STOPS) : 0;
    for (uint32_t k = 0; k < BLINK_ROW_STOPS; ++k) stops[k] = k < n_stops ? (int64_t)q->mask_stops[k] : -1;
    io->min_p[r] = q ? q->min_p : 0.0f;
    io->presence[r] = q ? q->presence_penalty : 0.0f;
    io->frequency[r] = q ? q->frequency_penalty : 0.0f;
    io->repetition[r] = q && q->repetition_penalty != 0.0f ? q->repetition_penalty : 1.0f;
    io->min_tokens[r] = q ? (int64_t)q->min_tokens : 0;
    io->seat[r] = seat;
}

/* The row's threads in step (the twin stages a row on one thread: nothing to wait for). */
template <class P>
BLINK_DEV void blink_row_sync(P &plat, unsigned nt) {
    if (nt > 1) plat.sync();
}

/* Seat `seat` for request q, as graphs/sampler.SeatState.fill does it: the bias row (-inf outside
 * the allowed ids, -inf on one-token bad words, + logit_bias), the prompt mask, the output counts,
 * the last BLINK_BAD_WORD_LEN - 1 output tokens and the multi-token bad words. Intake checked the
 * data (blink_extra_ok); every thread of the row calls it. */
template <class P>
BLINK_DEV void blink_fill_seat(P &plat, const blink_sched_params_t *p, const blink_step_io_t *io,
                               const blink_req_t *q, uint32_t seat, unsigned tid, unsigned nt) {
    const uint32_t V = io->vocab, L = BLINK_BAD_WORD_LEN - 1;
    float *bias = io->seat_bias + (uint64_t)seat * V;
    float *counts = io->seat_counts + (uint64_t)seat * V;
    uint8_t *mask = io->seat_prompt_mask + (uint64_t)seat * V;
    const float neg_inf = -__builtin_huge_valf();
    for (uint32_t i = tid; i < V; i += nt) {
        bias[i] = q->n_allowed_ids ? neg_inf : 0.0f;
        counts[i] = 0.0f;
        mask[i] = 0;
    }
    blink_row_sync(plat, nt);
    const int32_t *extra = blink_prompt_arena(p) + q->extra_offset;
    const int32_t *prompt = blink_prompt_arena(p) + q->prompt_offset;
    const uint32_t a0 = 2 * q->n_logit_bias, w0 = a0 + q->n_allowed_ids;
    for (uint32_t j = tid; j < q->n_allowed_ids; j += nt) bias[plat.ld32(&extra[a0 + j])] = 0.0f;
    for (uint32_t t = tid; t < q->prompt_len; t += nt) {   /* same value from every writer: no atomic */
        const uint32_t tok = plat.ld32(&prompt[t]);
        if (tok < V) mask[tok] = 1;
    }
    blink_row_sync(plat, nt);
    if (tid != 0) return;
    for (uint32_t i = 0; i < q->bad_words_words;) {          /* one-token words: -inf; the others: the table */
        const uint32_t n = plat.ld32(&extra[w0 + i]);
        if (n == 1) bias[plat.ld32(&extra[w0 + i + 1])] = neg_inf;
        i += 1 + n;
    }
    for (uint32_t j = 0; j < q->n_logit_bias; ++j) {         /* in order: repeated ids add up, as index_put_ */
        const uint32_t bits = plat.ld32(&extra[q->n_logit_bias + j]);
        float b;
        memcpy(&b, &bits, 4);
        bias[plat.ld32(&extra[j])] += b;
    }
    const int32_t *out = blink_output_arena(p) + q->output_offset;
    const uint32_t gen = q->generated;
    for (uint32_t t = 0; t < gen; ++t) {
        const uint32_t tok = plat.ld32(&out[t]);
        if (tok < V) counts[tok] += 1.0f;
    }
    int64_t *recent = io->seat_recent + (uint64_t)seat * L;
    for (uint32_t k = 0; k < L; ++k) {                       /* right-aligned: the newest last */
        const int64_t back = (int64_t)L - (int64_t)k;        /* 1 .. L tokens back */
        recent[k] = back <= (int64_t)gen ? (int64_t)plat.ld32(&out[gen - back]) : -1;
    }
    int64_t *prefix = io->seat_bad_prefix + (uint64_t)seat * BLINK_BAD_WORDS * L;
    int64_t *plen = io->seat_bad_len + (uint64_t)seat * BLINK_BAD_WORDS;
    int64_t *last = io->seat_bad_last + (uint64_t)seat * BLINK_BAD_WORDS;
    uint32_t m = 0;
    for (uint32_t i = 0; i < q->bad_words_words;) {
        const uint32_t n = plat.ld32(&extra[w0 + i]);
        if (n > 1 && m < BLINK_BAD_WORDS) {
            int64_t *row = prefix + (uint64_t)m * L;
            for (uint32_t k = 0; k < L; ++k) {
                const uint32_t from_end = L - k;             /* prefix token n-1-from_end, right-aligned */
                row[k] = from_end <= n - 1 ? (int64_t)plat.ld32(&extra[w0 + i + 1 + (n - 1 - from_end)]) : -1;
            }
            plen[m] = n - 1;
            last[m] = plat.ld32(&extra[w0 + i + n]);
            ++m;
        }
        i += 1 + n;
    }
    for (; m < BLINK_BAD_WORDS; ++m) {
        for (uint32_t k = 0; k < L; ++k) prefix[(uint64_t)m * L + k] = -1;
        plen[m] = -1;
        last[m] = V;
    }
}

/* Row r's allowed tokens under q's automaton at its current state (logits_processors.automaton_mask:
 * the state's runs, and the stop ids, EOS among them, at an accepting or dead state); the sampler
 * sets every other logit to -inf. Intake checked the words; every thread of the row calls it. */
template <class P>
BLINK_DEV void blink_stage_automaton(P &plat, const blink_sched_params_t *p, const blink_step_io_t *io,
                                     const blink_req_t *q, uint32_t r, unsigned tid, unsigned nt) {
    const uint32_t V = io->vocab;
    uint8_t *allowed = io->automaton_allowed + (uint64_t)r * V;
    const int32_t *w = blink_prompt_arena(p) + q->automaton_offset;
    auto ld = [&](uint32_t i) { return plat.ld32(&w[i]); };
    const blink_automaton_view_t av = blink_automaton_view(ld);
    const uint32_t state = blink_automaton_current(&av, q->automaton_state);
    for (uint32_t i = tid; i < V; i += nt) allowed[i] = 0;
    blink_row_sync(plat, nt);
    blink_automaton_allow_runs(ld, &av, state, V, allowed, tid, nt);
    if (tid == 0) blink_automaton_allow_stops(ld, state, q->mask_stops, q->n_mask_stops, V, allowed);
}

/* Row r of a graph of shape (R, S, C); threads tid of nt share the row. */
template <class P>
BLINK_DEV void blink_stage_row(P &plat, const blink_sched_params_t *p, const blink_step_io_t *io, uint32_t S,
                               uint32_t C, uint32_t r, unsigned tid, unsigned nt) {
    const uint32_t bs = io->block_size, mb = C / bs, sink = io->sink_block;
    int64_t *ids = io->input_ids + (uint64_t)r * S;
    int64_t *pos = io->positions + (uint64_t)r * S;
    int64_t *kv_slot = io->slot_mapping + (uint64_t)r * S;
    int64_t *table_out = io->block_tables + (uint64_t)r * mb;
    if (r >= p->state->n_rows) {                       /* a padding row */
        for (uint32_t i = tid; i < S; i += nt) {
            ids[i] = 0;
            pos[i] = 0;
            kv_slot[i] = (int64_t)sink * bs + i % bs;
        }
        for (uint32_t j = tid; j < mb; j += nt) table_out[j] = sink;
        if (tid == 0) {
            io->automaton_on[r] = 0;
            io->lp_want[r] = 0;
            io->q_lens[r] = 0;
            io->temperature[r] = 0.0f;
            io->top_p[r] = 1.0f;
            io->top_k[r] = 0;
            io->seeds[r] = 0;
            io->token_index[r] = 0;
            blink_stage_sampling(io, r, 0, io->sink_seat);
        }
        return;
    }
    const uint32_t slot = p->row_slot[r];
    const blink_req_t *q = &p->reqs[slot];
    const uint32_t *table = p->kv_tables + (uint64_t)slot * p->kv_max_blocks;
    const uint32_t start = p->row_start[r], n = p->row_len[r], plen = q->prompt_len;
    const int32_t *prompt = blink_prompt_arena(p) + q->prompt_offset;
    const int32_t *output = blink_output_arena(p) + q->output_offset;
    const uint32_t vocab = p->policy.vocab_size;
    for (uint32_t i = tid; i < S; i += nt) {
        if (i < n) {
            const uint32_t t = start + i;
            /* volatile loads: on the host-mapped ring a cached line could hold an older prompt */
            const uint32_t tok = plat.ld32(t < plen ? &prompt[t] : &output[t - plen]);
            ids[i] = tok < vocab ? (int32_t)tok : 0;
            pos[i] = t;
            kv_slot[i] = (int64_t)table[t / bs] * bs + t % bs;
        } else {
            ids[i] = 0;
            pos[i] = 0;
            kv_slot[i] = (int64_t)sink * bs + i % bs;
        }
    }
    const int samples = (p->row_flags[r] & BLINK_ROW_SAMPLE) != 0;
    if (samples && q->seat_fresh && q->seat < io->sink_seat)   /* uniform over the row's threads */
        blink_fill_seat(plat, p, io, q, q->seat, tid, nt);
    const int constrained = samples && q->automaton_words;   /* uniform over the row's threads */
    if (constrained) blink_stage_automaton(plat, p, io, q, r, tid, nt);
    const uint32_t held = q->num_blocks < mb ? q->num_blocks : mb;
    for (uint32_t j = tid; j < mb; j += nt) table_out[j] = j < held ? (int64_t)table[j] : (int64_t)sink;
    if (tid == 0) {
        io->automaton_on[r] = (uint8_t)constrained;
        /* the device scheduler's request copy says it; the host loop's (which publishes the records
         * itself, no BLINK_FLAG_LOGPROBS) marks the row */
        io->lp_want[r] = samples && ((q->flags & BLINK_FLAG_LOGPROBS) || (p->row_flags[r] & BLINK_ROW_LOGPROBS));
        io->q_lens[r] = n;
        io->temperature[r] = q->temperature;
        io->top_p[r] = q->top_p;
        io->top_k[r] = q->top_k;
        io->seeds[r] = (int64_t)q->seed;
        io->token_index[r] = (int64_t)(start + n) - (int64_t)plen;
        blink_stage_sampling(io, r, q, samples && q->seat < io->sink_seat ? q->seat : io->sink_seat);
    }
}

/* Row r's logprob record (shared_layout's layout: logprob, rank, k ids, k logprobs) into the
 * ring at the record of the token the scheduler publishes next (q->generated: not yet counted).
 * Intake checked that max_tokens records from logprobs_offset fit the arena and k <= 20. */
template <class P>
BLINK_DEV void blink_write_logprobs(P &plat, const blink_sched_params_t *p, const blink_step_io_t *io,
                                    const blink_req_t *q, uint32_t r) {
    const uint32_t k = q->logprobs < BLINK_TOP_LOGPROBS ? q->logprobs : BLINK_TOP_LOGPROBS;
    const uint32_t stride = BLINK_LOGPROB_RECORD_WORDS(k);
    if (q->generated >= q->max_tokens) return;
    int32_t *w = blink_logprob_arena(p) + q->logprobs_offset + (uint64_t)q->generated * stride;
    uint32_t bits;
    memcpy(&bits, &io->lp_token[r], 4);
    plat.st32(&w[0], bits);
    plat.st32(&w[1], (uint32_t)io->lp_rank[r]);
    for (uint32_t j = 0; j < k; ++j) {
        plat.st32(&w[2 + j], (uint32_t)io->lp_top_ids[(uint64_t)r * BLINK_TOP_LOGPROBS + j]);
        memcpy(&bits, &io->lp_top_vals[(uint64_t)r * BLINK_TOP_LOGPROBS + j], 4);
        plat.st32(&w[2 + k + j], bits);
    }
}

/* Each sampling row's token into its chunk's step_tokens entry (and its logprob record). */
template <class P>
BLINK_DEV void blink_finish_rows(P &plat, const blink_sched_params_t *p, const blink_step_io_t *io, unsigned tid,
                                 unsigned nt) {
    const uint32_t n_rows = p->state->n_rows;
    for (uint32_t r = tid; r < n_rows; r += nt) {
        const uint32_t f = p->row_flags[r];
        if (!(f & BLINK_ROW_SAMPLE)) continue;
        const uint32_t chunk = f & BLINK_ROW_CHUNK;
        p->step_tokens[chunk] = (int32_t)io->tokens[r];
        const blink_req_t *q = &p->reqs[p->chunk_slot[chunk]];
        if (q->flags & BLINK_FLAG_LOGPROBS) blink_write_logprobs(plat, p, io, q, r);
    }
}

#endif /* BLINK_MODEL_STEP_H */
