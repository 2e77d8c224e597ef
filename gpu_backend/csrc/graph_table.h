/* The graph cache as the scheduler sees it: which captured step graph serves a
 * step, and how the step's chunks become that graph's rows. Plain host+device
 * C; gpu_backend/graphs/buckets.py builds the tables and holds the Python twin
 * of every function here (diff-tested through host_twin.cc).
 *
 *   step chunks (start, len) -> blink_step_key -> (rows, len, ctx)
 *     -> blink_graph_lookup: one load from a dense table indexed by
 *        (rows, ceil(len / len_granularity), ceil(ctx / ctx_granularity))
 *        -> graph id (the tightest captured graph covering the step; cells no
 *           graph covers, and keys beyond the table, give the max-shape fallback)
 *     -> blink_fill_rows: chunk pieces of at most split_len tokens, one per row
 *
 * A graph of shape (rows R, len S, ctx C) computes R rows of S query tokens each
 * against up to C cached tokens per row. Decode graphs have S = 1.
 */
#ifndef BLINK_GRAPH_TABLE_H
#define BLINK_GRAPH_TABLE_H

#include "blink_ring_layout.h"

#define BLINK_GRAPH_KIND_PREFILL 1u   /* = BLINK_STEP_PREFILL */
#define BLINK_GRAPH_KIND_DECODE 2u    /* = BLINK_STEP_DECODE */
#define BLINK_ROW_SAMPLE 0x80000000u  /* row_flags: the row ends a chunk that samples a token */
#define BLINK_ROW_LOGPROBS 0x40000000u  /* row_flags: the host loop wants the row's logprob record */
#define BLINK_ROW_CHUNK 0x3fffffffu   /* row_flags: the row's chunk index */

typedef struct BLINK_ALIGN8 blink_graph_lut {
    const uint16_t *ids;          /* [(max_rows + 1) * n_len * n_ctx] graph ids */
    uint32_t max_rows;            /* a step of more rows uses the fallback */
    uint32_t n_len, n_ctx;        /* cells per dimension (decode: n_len = 1) */
    uint32_t len_granularity, ctx_granularity;
    uint32_t fallback;            /* the kind's max-shape graph */
} blink_graph_lut_t;

typedef struct BLINK_ALIGN8 blink_graph_table {
    const uint64_t *execs;        /* [n_graphs * 2] cudaGraphExec_t, two instances per graph used alternately */
    const uint32_t *shapes;       /* [n_graphs * 4] kind, rows, len, ctx; NULL: one stand-in graph, no rows */
    blink_graph_lut_t prefill, decode;
    uint32_t n_graphs;
    uint32_t split_len;           /* prefill chunks longer than this are cut into rows of this many tokens */
} blink_graph_table_t;

static inline BLINK_HD uint32_t blink_ceil_div(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

/* The key of a step: rows, longest row, longest context after the step. */
static inline BLINK_HD void blink_step_key(const blink_graph_table_t *g, uint32_t kind, const uint32_t *chunk_start,
                                           const uint32_t *chunk_len, uint32_t n, uint32_t *rows, uint32_t *len,
                                           uint32_t *ctx) {
    uint32_t longest = 0, context = 0;
    for (uint32_t c = 0; c < n; ++c) {
        if (chunk_len[c] > longest) longest = chunk_len[c];
        if (chunk_start[c] + chunk_len[c] > context) context = chunk_start[c] + chunk_len[c];
    }
    *ctx = context;
    if (kind == BLINK_GRAPH_KIND_DECODE || g->split_len == 0 || longest <= g->split_len) {
        *rows = n;
        *len = longest;
        return;
    }
    uint32_t r = 0;
    for (uint32_t c = 0; c < n; ++c) r += blink_ceil_div(chunk_len[c], g->split_len);
    *rows = r;
    *len = g->split_len;
}

/* O(1): the graph id for a step key. */
static inline BLINK_HD uint32_t blink_graph_lookup(const blink_graph_table_t *g, uint32_t kind, uint32_t rows,
                                                   uint32_t len, uint32_t ctx) {
    if (g->shapes == 0) return 0;
    const blink_graph_lut_t *t = kind == BLINK_GRAPH_KIND_DECODE ? &g->decode : &g->prefill;
    const uint32_t lc = t->n_len == 1 ? 0 : blink_ceil_div(len, t->len_granularity);
    const uint32_t cc = blink_ceil_div(ctx, t->ctx_granularity);
    if (rows > t->max_rows || lc >= t->n_len || cc >= t->n_ctx) return t->fallback;
    return t->ids[((uint64_t)rows * t->n_len + lc) * t->n_ctx + cc];
}

/* Does graph `id` hold a step of this key? */
static inline BLINK_HD int blink_graph_fits(const blink_graph_table_t *g, uint32_t id, uint32_t kind, uint32_t rows,
                                            uint32_t len, uint32_t ctx) {
    if (g->shapes == 0) return 1;
    if (id >= g->n_graphs) return 0;
    const uint32_t *s = g->shapes + 4 * (uint64_t)id;
    return s[0] == kind && rows <= s[1] && len <= s[2] && ctx <= s[3];
}

/* Chunks -> rows: each chunk in pieces of at most `piece` tokens (0: no limit), in
 * chunk order. Only a chunk's last piece may sample. Returns the rows written. */
static inline BLINK_HD uint32_t blink_fill_rows(uint32_t piece, const uint32_t *chunk_slot, const uint32_t *chunk_start,
                                                const uint32_t *chunk_len, const uint32_t *chunk_sample, uint32_t n,
                                                uint32_t *row_slot, uint32_t *row_start, uint32_t *row_len,
                                                uint32_t *row_flags) {
    uint32_t r = 0;
    for (uint32_t c = 0; c < n; ++c) {
        uint32_t off = 0;
        do {
            const uint32_t left = chunk_len[c] - off;
            const uint32_t len = piece != 0 && left > piece ? piece : left;
            row_slot[r] = chunk_slot[c];
            row_start[r] = chunk_start[c] + off;
            row_len[r] = len;
            off += len;
            row_flags[r] = c | (off == chunk_len[c] && chunk_sample[c] ? BLINK_ROW_SAMPLE : 0u);
            ++r;
        } while (off < chunk_len[c]);
    }
    return r;
}

#endif /* BLINK_GRAPH_TABLE_H */
