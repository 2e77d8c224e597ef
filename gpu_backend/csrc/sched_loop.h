/* The persistent scheduler's loop, written once for two platforms: the CUDA
 * kernel (one block of 256 threads, sched_platform.cuh) and the CPU twin
 * (a few host threads and a barrier, host_twin.cc). It is the mechanism around
 * the decisions of sched_policy.h and mirrors gpu_backend/engine.py step for
 * step, with the slot scan overlapped with the step graph in flight:
 *
 *   control  (thread 0)  stop / abort / ring shutdown, heartbeat, frontend epoch; the
 *                        frontend doorbell: scan only when it moved (blink_scan_decide)
 *   scan     (all)       every slot's (state, cancel) word: claim PENDING with a
 *                        plain store (one thread owns each slot in a scan; the
 *                        frontend never writes a PENDING slot's state), mark
 *                        cancelled or stale requests for the reap
 *   intake   (all)       copy + validate the claimed requests (the sampling surface and its
 *                        data too, a structured output's token automaton: automaton.h;
 *                        prompt logprobs refused), stamp what the policy reads (times:
 *                        priority, arrival, SLOs), queue them by seq
 *   wait     (thread 0)  poll the flag the step graph's last kernel writes
 *   publish  (all)       token, fence, count; a structured output's automaton steps over the
 *                        token; finish (STOP / LENGTH) -> DECODE_COMPLETED; the keys of the
 *                        blocks it filled (ring reads, in parallel across requests)
 *                        (scan and publish raise flags where a request is to be reaped, dropped
 *                        or committed, so the schedule phase walks its lists only then)
 *   commit   (all)       where each published chunk has one block to commit: the blocks into
 *                        the prefix cache, the walk's result (blink_phase_commit)
 *   survey   (all)       each running request: dropped by the reap, decoding one token, or
 *                        not; which cross a block boundary (bitmaps by warp ballot); where
 *                        the reap is due, the running list without the dropped ones. The
 *                        schedule phase then reaps only those, and under FCFS, where every
 *                        running request decodes, plans the steady decode step
 *                        (blink_fast_plan) or the PREFILL step that admits waiting requests
 *                        into freed seats (blink_fast_admit) without walking the running list
 *   schedule (thread 0)  commit the blocks the step filled (where the commit phase did not), drop
 *                        finished, reap aborted (their KV blocks back to the allocator),
 *                        look up each waiting request's cached prefix (key chain over its
 *                        ring tokens), blink_plan_step_policy under the daemon's policy
 *                        (FCFS, PRIORITY or LVF), preempt, admit (taking the cached
 *                        prefix: shared, refcounted), allocate KV blocks (kv_alloc.h
 *                        blink_pkv_*: LRU eviction of cached ones) and sampler seats,
 *                        write a prefill step's chunks, or tail-launch a fresh
 *                        instance when this one's launch window is full
 *                        (window_limit attempts, well inside the device's cap of
 *                        120 fire-and-forget launches per graph execution)
 *   fill     (all)       a decode step: its chunks and rows, one request per thread,
 *                        and its longest context (a shared max); after a fast plan also
 *                        the survey's kept list back into the running list and the KV
 *                        blocks the needy requests take (blink_fill_block)
 *   launch   (thread 0)  the step graph (graph_table.h: key, O(1) lookup, a prefill
 *                        step's chunks -> rows), fence, launch it fire-and-forget
 *
 * Every piece of state that must outlive an instance lives in global memory
 * (params->state, reqs, queues); the block-shared struct holds only values of
 * one iteration and the instance's launch count.
 */
#ifndef BLINK_SCHED_LOOP_H
#define BLINK_SCHED_LOOP_H

#include <string.h>

#include "automaton.h"
#include "echo_step.h"
#include "sched_policy.h"

typedef struct blink_sched_shared {
    uint64_t fe_epoch;       /* the header's frontend_epoch, read by the control phase */
    uint32_t exit;           /* BLINK_EXIT_*: every thread leaves the loop */
    uint32_t launches;       /* fire-and-forget launch attempts by this instance (the window) */
    uint32_t n_arrivals;     /* slots claimed by this iteration's scan */
    uint32_t n_valid;        /* of those, accepted into the waiting queue */
    uint32_t n_tokens;       /* tokens published this iteration */
    uint32_t n_completed;    /* slots completed by the parallel phases this iteration */
    uint32_t draining;       /* copy of state->draining for the scan */
    uint32_t in_flight;      /* copy of state->in_flight for the publish phase */
    int64_t now_us;          /* the control phase's clock: arrivals of this iteration's intake */
    int64_t pub_us;          /* the wait phase's clock: the time of the tokens it publishes (LVF's last_us) */
    uint32_t reap_waiting;   /* the scan marked a waiting request aborted */
    uint32_t reap_running;   /* the scan marked a running request aborted, or publish finished one */
    uint32_t commit;         /* publish: chunks whose requests have full blocks to commit (bits of BLINK_LIST_COMMIT) */
    uint32_t scan;           /* control: this iteration scans the slots (the doorbell or epoch moved, or due) */
    uint32_t launch;         /* schedule: a step is planned and applied; the fill and launch phases follow */
    uint32_t step_kind;      /* its kind */
    uint32_t step_parallel;  /* a decode step: its chunks and rows are filled by every thread (blink_phase_fill) */
    uint32_t step_ctx;       /* fill: the longest context after the step (max over its rows) */
    int32_t step_err;        /* schedule: nonzero when an allocation failed (the step's requests fail) */
    uint64_t t_sched, t_reap, t_policy, t_apply;   /* the schedule phase's clock: plan_ns in parts */
    uint64_t t_survey;       /* the survey's start (plan_ns and reap_ns count it) */
    uint32_t survey;         /* wait: this iteration surveys the running list (blink_survey_decide) */
    uint32_t sv_other;       /* survey: running requests that do not decode one token next */
    uint32_t sv_gone;        /* survey: running requests the reap will drop (finished or aborted) */
    uint32_t sv_need;        /* survey: KV blocks the decoding ones need for their next token */
    uint32_t sv_needy;       /* survey: decoding ones that need a block (each needs one: sv_needy == sv_need) */
    uint32_t sv_over;        /* survey: needy ones whose block table is full (the full apply fails their step) */
    uint32_t par_alloc;      /* schedule: the fill phase takes the needy ones' blocks (blink_fill_block) */
    uint32_t checking;       /* this iteration checks the survey's results against the full walks */
    uint32_t alloc_top;      /* the free stack's height before those blocks left it */
    uint32_t evict_from;     /* needy ranks from here on take cached blocks the LRU gives up (BLINK_LIST_VICTIMS) */
    uint32_t evict;          /* how many: their keys leave the table in the fill phase (blink_evict_keys) */
    uint32_t evict_check;    /* schedule: the fill phase checks the table after (the first fast_plan_checks times) */
    uint32_t evict_bad;      /* fill: threads whose share of the table check failed */
    uint32_t evict_entries;  /* fill: the table's entries, counted by every thread's share */
    uint32_t step_ids;       /* schedule: where a decode step's chunks are listed (BLINK_IDS_*) */
    uint32_t par_commit;     /* wait: this iteration may commit in parallel (blink_phase_commit) */
    uint32_t commit_multi;   /* publish: a chunk has more than one block to commit (thread 0's walk commits) */
    uint32_t commit_serial;  /* commit phase: two candidates share a block, or the check disagreed (the walk commits) */
    uint32_t commit_won;     /* commit phase: blocks it put in the prefix cache */
    uint32_t keys_ns;        /* publish: the longest any thread spent on block keys (stats pub_keys_ns) */
} blink_sched_shared_t;

/* shared_state (blink_local_params): an instance's copies, which it works on; in the block's shared
 * memory in the kernel that has them (scheduler.cu blink_scheduler_shared). */
typedef struct blink_sched_local {
    blink_sched_params_t lp;
    blink_sched_state_t l_state;
    blink_sched_control_t l_stats;
    blink_pkv_t l_pkv;
} blink_sched_local_t;

/* All threads, at an instance's start: the parameter block it works from. With shared_state, a copy
 * in `loc` (the block's shared memory) whose state, stats and pkv point at copies there too (`home`:
 * the block in device memory they came from): thread 0's walks between two steps are chains of
 * dependent loads, and each counter's `+= 1` a load after a store, here from shared memory rather than
 * L1 or L2. The copies go back to device memory before each launch (the state: the step graph reads its
 * n_rows, n_chunks and step_no there; blink_home_state) and at each beat and the exit (all of them:
 * blink_home_all), where the host and the next instance read them. The device has a kernel of its own
 * for it (scheduler.cu blink_scheduler_shared): one loop over a pointer that may be either memory would
 * compile every params load of the device-memory kernel (blink_scheduler) to a generic one. */
static inline BLINK_HD void blink_copy_words(void *dst, const void *src, uint32_t bytes, unsigned tid, unsigned nt) {
    for (uint32_t i = tid; i < bytes / 8; i += nt) ((uint64_t *)dst)[i] = ((const uint64_t *)src)[i];
}
template <class P>
BLINK_DEV const blink_sched_params_t *blink_copy_local(P &plat, const blink_sched_params_t *gp,
                                                       blink_sched_local_t *loc, unsigned tid, unsigned nt) {
    blink_copy_words(&loc->lp, gp, sizeof(blink_sched_params_t), tid, nt);
    blink_copy_words(&loc->l_state, gp->state, sizeof(blink_sched_state_t), tid, nt);
    blink_copy_words(&loc->l_stats, gp->stats, sizeof(blink_sched_control_t), tid, nt);
    blink_copy_words(&loc->l_pkv, gp->pkv, sizeof(blink_pkv_t), tid, nt);
    plat.sync();
    if (tid == 0) {
        loc->lp.state = &loc->l_state;
        loc->lp.stats = &loc->l_stats;
        loc->lp.pkv = &loc->l_pkv;
        loc->lp.home = gp;
    }
    plat.sync();
    return &loc->lp;
}
/* The twin's choice (the device's is the kernel it runs): the copies with shared_state, else gp. */
template <class P>
BLINK_DEV const blink_sched_params_t *blink_local_params(P &plat, const blink_sched_params_t *gp,
                                                         blink_sched_local_t *loc, unsigned tid, unsigned nt) {
    return gp->shared_state ? blink_copy_local(plat, gp, loc, tid, nt) : gp;   /* uniform: one word, read by all */
}
static inline BLINK_HD void blink_home_state(const blink_sched_params_t *p) {
    if (p->home) *p->home->state = *p->state;
}
static inline BLINK_HD void blink_home_all(const blink_sched_params_t *p) {
    if (!p->home) return;
    *p->home->state = *p->state;
    *p->home->stats = *p->stats;
    *p->home->pkv = *p->pkv;
}

/* blink_sched_shared_t.step_ids: the planner's decode list; the running list itself (a fast plan);
 * the survey's kept list, which the fill phase copies back to the running list (a fast plan after
 * the survey's reap). */
#define BLINK_IDS_PLAN 0u
#define BLINK_IDS_RUNNING 1u
#define BLINK_IDS_KEPT 2u

/* Sampler seats (thread 0 of the schedule phase, and abort_all): a running request that needs
 * one (blink_needs_seat) takes a free seat at admission, marked fresh so the step graph's
 * staging fills it (model_step.h) before its next sample; it gives the seat back whenever it
 * leaves the running list (finish, abort, preemption: refilled from its output on return). */
static inline BLINK_HD void blink_seat_take(const blink_sched_params_t *p, uint32_t slot) {
    blink_req_t *r = &p->reqs[slot];
    if (r->seat != BLINK_NO_SEAT ||
        !blink_needs_seat(r->presence_penalty, r->frequency_penalty, r->repetition_penalty, r->n_logit_bias,
                          r->n_allowed_ids, r->bad_words_words))
        return;
    for (uint32_t i = 0; i < p->n_seats; ++i)
        if (p->seat_owner[i] == 0) {   /* n_seats == max_batch_size: a running request always finds one */
            p->seat_owner[i] = slot + 1;
            r->seat = i;
            r->seat_fresh = 1;
            return;
        }
}

static inline BLINK_HD void blink_seat_release(const blink_sched_params_t *p, blink_req_t *r) {
    if (r->seat != BLINK_NO_SEAT && r->seat < p->n_seats) p->seat_owner[r->seat] = 0;
    r->seat = BLINK_NO_SEAT;
    r->seat_fresh = 0;
}

/* ---- KV blocks: the prefix-caching allocator (kv_alloc.h blink_pkv_*) over each slot's table ---- */

static inline BLINK_HD uint32_t *blink_table(const blink_sched_params_t *p, uint32_t slot) {
    return p->kv_tables + (uint64_t)slot * p->kv_max_blocks;
}

/* The allocator's state from the parameter block's arrays, every block free (first instance, abort). */
static inline BLINK_HD void blink_pkv_setup(const blink_sched_params_t *p) {
    blink_pkv_t *k = p->pkv;
    k->free_stack = p->kv_free_stack;
    k->refs = p->pkv_refs;
    k->key = p->pkv_key;
    k->has_key = p->pkv_has_key;
    k->lru_prev = p->pkv_lru_prev;
    k->lru_next = p->pkv_lru_next;
    k->table_key = p->pkv_table_key;
    k->table_block = p->pkv_table_block;
    k->num_blocks = p->policy.num_blocks;
    k->table_cap = p->pkv_table_cap;
    blink_pkv_init(k);
    for (uint32_t i = 0; i < p->policy.num_blocks; ++i) p->pkv_claimed[i] = 0;
    p->state->free_blocks = blink_pkv_free_count(k);
}

/* A request's blocks back (finish, abort, preemption, a failed step), last first: one holder
 * less each; a cached block nobody holds stays in the cache, evictable (scheduler.remove/_preempt). */
static inline BLINK_HD void blink_blocks_release(const blink_sched_params_t *p, uint32_t slot, blink_req_t *r) {
    blink_pkv_free(p->pkv, blink_table(p, slot), r->num_blocks);
    r->num_blocks = r->num_committed = 0;
    p->state->free_blocks = blink_pkv_free_count(p->pkv);
}

/* The prefix-cache keys (kv_alloc.h's blink_block_hash chain, scheduler._keys) are made a token at a
 * time as the request's tokens become known: its prompt at intake, read from the ring
 * (blink_keys_read), each generated token at publish from the register it is in (blink_key_feed).
 * Reading them back from the ring made a block's key cost ~20 us on the H200 over the host-mapped
 * ring (16 loads issued back to back, thread 0's publish waiting for them: 18.4 of publish's 22.9 us
 * a step at 256 running with mixed lengths, 2026-11-27), and a generated token is in a register
 * when it is published. r->key_pos counts the tokens hashed: keys for the full blocks among them,
 * r->key_run the chain's state in the block they end in. */
#define BLINK_KEY_STEP 0x9E3779B97F4A7C15ull   /* kv_alloc.h's blink_block_hash increment */

static inline BLINK_HD void blink_keys_reset(blink_req_t *r) {
    r->n_keys = r->key_pos = 0;
    r->key_run = blink_kv_mix64(BLINK_KV_ROOT_HASH + BLINK_KEY_STEP);
}

/* The token at position r->key_pos into the chain; at a block's last token its key joins kv_keys. */
static inline BLINK_HD void blink_key_feed(const blink_sched_params_t *p, uint32_t slot, blink_req_t *r,
                                           uint32_t tok) {
    if (r->n_keys >= p->kv_max_blocks) return;   /* every key a block table can use is made */
    uint64_t h = blink_kv_mix64((r->key_run ^ (uint64_t)tok) + BLINK_KEY_STEP);
    if (++r->key_pos % p->policy.block_size == 0) {
        p->kv_keys[(uint64_t)slot * p->kv_max_blocks + r->n_keys++] = h;
        h = blink_kv_mix64(h + BLINK_KEY_STEP);
    }
    r->key_run = h;
}

/* Tokens [r->key_pos, upto) read from the ring's two arenas into the chain, 16 loads in flight at a
 * time: every address computed before the first load (the compiler re-reads memory operands after
 * each volatile access, and a re-read between two ring loads waits for the first's round trip). */
template <class P>
BLINK_DEV void blink_keys_read(P &plat, const blink_sched_params_t *p, uint32_t slot, blink_req_t *r,
                               uint32_t upto) {
    uint64_t *keys = p->kv_keys + (uint64_t)slot * p->kv_max_blocks;
    const uint32_t bs = p->policy.block_size, cap = p->kv_max_blocks, plen = r->prompt_len;
    const int32_t *prompt = blink_prompt_arena(p) + r->prompt_offset;
    const int32_t *output = blink_output_arena(p) + r->output_offset;
    uint32_t pos = r->key_pos, nk = r->n_keys;
    uint64_t h = r->key_run;
    while (pos < upto && nk < cap) {
        const uint32_t m = upto - pos < 16 ? upto - pos : 16;
        const int32_t *at[16];
        for (uint32_t q = 0; q < 16; ++q) {   /* past upto (q >= m): pos's token, unread */
            const uint32_t t = pos + (q < m ? q : 0);
            at[q] = t < plen ? prompt + t : output + (t - plen);
        }
        uint32_t tok[16];
        for (uint32_t q = 0; q < 16; ++q)
            if (q < m) tok[q] = plat.ld32(at[q]);
        for (uint32_t q = 0; q < m && nk < cap; ++q) {
            h = blink_kv_mix64((h ^ (uint64_t)tok[q]) + BLINK_KEY_STEP);
            if (++pos % bs == 0) {
                keys[nk++] = h;
                h = blink_kv_mix64(h + BLINK_KEY_STEP);
            }
        }
    }
    r->key_pos = pos;
    r->n_keys = nk;
    r->key_run = h;
}

/* The keys of the slot's first n full blocks (n <= the request's tokens / block_size). Made
 * already where intake and publish kept the chain up with the tokens; otherwise read from the ring,
 * up to every token the request has, so the chain is up again and publish feeds the next one. */
template <class P>
BLINK_DEV const uint64_t *blink_keys(P &plat, const blink_sched_params_t *p, uint32_t slot, blink_req_t *r,
                                     uint32_t n) {
    const uint32_t last = n < p->kv_max_blocks ? n : p->kv_max_blocks;
    if (last > r->n_keys) blink_keys_read(plat, p, slot, r, blink_req_tokens(r));
    return p->kv_keys + (uint64_t)slot * p->kv_max_blocks;
}

/* The request's blocks that are full and computed: what the prefix cache may hold of it. */
static inline BLINK_HD uint32_t blink_full_blocks(const blink_sched_params_t *p, const blink_req_t *r) {
    const uint32_t full = r->num_computed / p->policy.block_size;
    return full < r->num_blocks ? full : r->num_blocks;
}

/* The keys of every full block the request has computed (what blink_commit_blocks will commit),
 * made before by intake and publish (blink_key_feed); where the chain fell behind the tokens, read
 * here by the thread that publishes its chunk, in parallel across requests, so the commit finds
 * them done. The time ring reads take is added to `dt` (stats pub_keys_ns: 0 where the chain kept
 * up; the clock stays off a decode step's usual path). Returns how many
 * blocks it has to commit (a request's full blocks change only where its chunk is published). */
template <class P>
BLINK_DEV uint32_t blink_keys_ahead(P &plat, const blink_sched_params_t *p, uint32_t slot, blink_req_t *r,
                                    uint64_t &dt) {
    const uint32_t full = blink_full_blocks(p, r);
    if (full > r->n_keys) {
        const uint64_t t0 = plat.now_ns(p);
        blink_keys(plat, p, slot, r, full);
        dt += plat.now_ns(p) - t0;
    }
    return full > r->num_committed ? full - r->num_committed : 0;
}

/* plan_scratch holds twenty-five lists of max_batch_size entries: the planner's seven outputs; the
 * chunks whose requests have full blocks to commit, a bitmap publish marks for the schedule phase
 * of the same iteration; the survey's bitmap of running positions that need a KV block, and the fast
 * plan's new-block lists made from it (blink_fast_plan); the survey's bitmap of running positions
 * the reap drops, the running list without them and, for each kept request, its rank among the
 * needy ones (blink_phase_survey); the commit phase's candidates (a bitmap by chunk, each one's
 * block and key) and winners (a bitmap), and its check's list of winners (blink_phase_commit); the
 * cached blocks the fill phase evicts, their table entries and which of them removes its run's
 * marks (blink_evict_keys). */
enum {
    BLINK_LIST_PREFILL_ID, BLINK_LIST_PREFILL_LEN, BLINK_LIST_DECODE_ID, BLINK_LIST_PREEMPTED_ID,
    BLINK_LIST_ADMITTED_ID, BLINK_LIST_NEW_BLOCKS_ID, BLINK_LIST_NEW_BLOCKS_N, BLINK_LIST_COMMIT,
    BLINK_LIST_NEEDY_BITS, BLINK_LIST_NEEDY_ID, BLINK_LIST_NEEDY_N, BLINK_LIST_GONE_BITS, BLINK_LIST_KEPT,
    BLINK_LIST_KEPT_RANK, BLINK_LIST_CAND_BITS, BLINK_LIST_WIN_BITS, BLINK_LIST_CAND_BLOCK, BLINK_LIST_CAND_KLO,
    BLINK_LIST_CAND_KHI, BLINK_LIST_CHECK_BLOCK, BLINK_LIST_CHECK_KLO, BLINK_LIST_CHECK_KHI, BLINK_LIST_VICTIMS,
    BLINK_LIST_TOMBS, BLINK_LIST_LEADER, BLINK_SCRATCH_LISTS
};
static inline BLINK_HD uint32_t *blink_scratch_list(const blink_sched_params_t *p, uint32_t which) {
    return p->plan_scratch + which * p->policy.max_batch_size;
}

/* scheduler._commit: the blocks that became full and computed enter the prefix cache. */
template <class P>
BLINK_DEV void blink_commit_blocks(P &plat, const blink_sched_params_t *p, uint32_t slot, blink_req_t *r) {
    const uint32_t full = blink_full_blocks(p, r);
    if (full <= r->num_committed) return;
    const uint64_t *keys = blink_keys(plat, p, slot, r, full);
    const uint32_t *table = blink_table(p, slot);
    for (uint32_t j = r->num_committed; j < full; ++j) blink_pkv_commit(p->pkv, table[j], keys[j]);
    r->num_committed = full;
}

/* scheduler._hit for the waiting request at `slot`: the cached blocks of the longest run of its
 * leading full blocks (at least one token left to compute) into its own table (unused while it
 * waits; admission takes them), num_cached / cached_idle for the policy. A block no request holds
 * counts idle for the first waiting request that hits it in this plan (pkv_claimed). */
template <class P>
BLINK_DEV void blink_prefix_hit(P &plat, const blink_sched_params_t *p, uint32_t slot, blink_req_t *r) {
    r->num_cached = r->cached_idle = 0;
    if (!p->prefix_caching) return;
    const uint32_t bs = p->policy.block_size, n = (blink_req_tokens(r) - 1) / bs;
    uint32_t *table = blink_table(p, slot);
    const uint32_t hit = blink_pkv_lookup(p->pkv, blink_keys(plat, p, slot, r, n), n < p->kv_max_blocks ? n : p->kv_max_blocks, table);
    const uint32_t stamp = p->state->plan_stamp;
    for (uint32_t j = 0; j < hit; ++j) {
        const uint32_t b = table[j];
        if (p->pkv->refs[b] == 0 && p->pkv_claimed[b] != stamp) {
            p->pkv_claimed[b] = stamp;
            r->cached_idle += 1;
        }
    }
    r->num_cached = hit * bs;
}

/* A float ring word, read through the platform's volatile 32-bit load. */
template <class P>
BLINK_DEV float blink_ld_f32(P &plat, const float *w) {
    const uint32_t bits = plat.ld32(w);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Ring writes that end a request: finish reason and error, then the state word. A request that
 * never had a token stamped gets t_last_ns now; `stamped`: the caller has just stamped it (publish),
 * which spares reading it back (a PCIe round trip on the host-mapped ring, on the step's path). */
template <class P>
BLINK_DEV void blink_complete_slot(P &plat, const blink_sched_params_t *p, uint32_t slot, uint32_t finish,
                                   uint32_t error, int stamped = 0) {
    blink_slot_t *s = blink_slot_ptr(p, slot);
    plat.st32(&s->finish_reason, finish);
    plat.st32(&s->error_code, error);
    if (!stamped && plat.ld64(&s->t_last_ns) == 0) plat.st64(&s->t_last_ns, plat.now_ns(p));
    plat.fence_sys();   /* finish reason, error, count and tokens before the state word that hands the slot back */
    plat.st32(&s->state, BLINK_DECODE_COMPLETED);
}

template <class P>
BLINK_DEV void blink_beat(P &plat, const blink_sched_params_t *p, uint64_t now) {
    blink_ring_header_t *h = blink_header_ptr(p);
    blink_sched_control_t *st = p->stats, *ctl = p->control;
    p->state->last_beat_ns = now;
    st->heartbeat += 1;
    plat.st64(&h->backend_heartbeat_ns, now);
    plat.fence_sys();   /* the beat's time before the counter that announces it */
    plat.st64(&h->backend_heartbeat, st->heartbeat);
    /* Counters to the host: plain stores into host-mapped memory, no reads back. */
    const uint64_t *src = &st->heartbeat;
    uint64_t *dst = &ctl->heartbeat;
    const unsigned n = (unsigned)((&st->BLINK_LAST_COUNTER - &st->heartbeat) + 1);
    for (unsigned i = 0; i < n; ++i) plat.st64(&dst[i], src[i]);
    plat.st32(&ctl->last_launch_error, (uint32_t)st->last_launch_error);
    plat.st32(&ctl->max_window_launches, st->max_window_launches);
    /* The KV pool and the prefix cache on the ring header, as the CPU engine reports them
     * (engine._publish_kv): plain stores of backend-owned words, read by /metrics. */
    plat.st32(&h->kv_blocks_total, p->policy.num_blocks);
    plat.st32(&h->kv_blocks_free, p->state->free_blocks);
    plat.st32(&h->prefix_caching, p->prefix_caching);
    plat.st32(&h->kv_blocks_cached, p->pkv->cached);
    plat.st64(&h->prefix_hit_tokens, st->prefix_hit_tokens);
    plat.st64(&h->prefix_miss_tokens, st->prefix_miss_tokens);
    plat.st64(&h->prefix_hit_blocks, st->prefix_hit_blocks);
    plat.st64(&h->prefix_miss_blocks, st->prefix_miss_blocks);
    blink_home_all(p);   /* shared_state: the host and a successor read them in device memory */
}

/* End every queued and running request (engine.abort_all: running, then waiting). */
template <class P>
BLINK_DEV void blink_abort_all(P &plat, const blink_sched_params_t *p, uint32_t error) {
    blink_sched_state_t *st = p->state;
    for (uint32_t i = 0; i < st->n_running; ++i) {
        blink_req_t *r = &p->reqs[p->running[i]];
        blink_seat_release(p, r);
        if (r->status == BLINK_REQ_RUNNING) {
            r->status = BLINK_REQ_FREE;
            blink_complete_slot(plat, p, p->running[i], BLINK_FINISH_ABORT, error);
            p->stats->completed += 1;
        }
    }
    for (uint32_t k = 0; k < st->w_count; ++k) {
        uint32_t slot = p->waiting[(st->w_head + k) % p->slot_count];
        p->reqs[slot].status = BLINK_REQ_FREE;
        blink_complete_slot(plat, p, slot, BLINK_FINISH_ABORT, error);
        p->stats->completed += 1;
    }
    st->n_running = 0;
    st->w_count = 0;
    blink_pkv_setup(p);   /* nobody holds a block any more; the prefix cache starts over */
}

/* thread 0, before an abort ends every request: the step in flight, if any, finishes first (within
 * the drain's grace period from now, and the step timeout, beating meanwhile: the host's wait for an
 * aborted scheduler is longer than the grace). It reads the requests' seats and copies while it stages
 * its rows, and writes their logprob records into the ring's arenas: completing its slots under it
 * would let the frontend reuse that memory while the graph still writes it, and a seat released
 * mid-staging could split a row's threads at the staging kernel's barriers. The twin runs its step
 * inline: never in flight here. Returns 0 where the step still runs then (the abort proceeds: the
 * step is stuck). */
template <class P>
BLINK_DEV int blink_settle_step(P &plat, const blink_sched_params_t *p) {
    blink_sched_state_t *st = p->state;
    if (!st->in_flight) return 1;
    const uint64_t t0 = plat.now_ns(p);
    while (plat.ld32(p->done) != st->step_no) {
        const uint64_t now = plat.now_ns(p);
        if (now - t0 > p->grace_ns || now - st->step_launched_ns > p->step_timeout_ns) return 0;
        if (now - st->last_beat_ns >= p->beat_interval_ns) blink_beat(plat, p, now);
    }
    plat.fence_dev();
    st->in_flight = 0;   /* its tokens are not published: every request it served is being aborted */
    return 1;
}

/* thread 0: does this iteration scan the slots? Every slot's word costs a load (over PCIe on a
 * host-mapped ring: ~10 us for 4,096 slots on an H200), so with full_scan_us set the scan runs only
 * when the frontend rang its doorbell (a header word it bumps after each batch of submissions or
 * cancels, after their state words and flags), when a new frontend attached (its epoch turns the
 * requests of the old one stale), when no scan recorded a bell yet (a fresh state), and at least
 * every full_scan_us, for a writer that does not ring. The bell is recorded before the scan reads
 * any slot, so a submission whose bell lands after that load is seen by the next iteration's scan. */
template <class P>
BLINK_DEV void blink_scan_decide(P &plat, const blink_sched_params_t *p, blink_sched_shared_t *sh, uint64_t bell,
                                 uint64_t now) {
    blink_sched_state_t *st = p->state;
    sh->scan = p->full_scan_us == 0 || !st->scan_valid || bell != st->scan_bell || sh->fe_epoch != st->scan_epoch ||
               now - st->scan_ns >= (uint64_t)p->full_scan_us * 1000u;
    if (!sh->scan || p->full_scan_us == 0) return;
    st->scan_valid = 1;
    st->scan_bell = bell;
    st->scan_epoch = sh->fe_epoch;
    st->scan_ns = now;
    plat.fence_sys();   /* the doorbell load before the slot loads of the scan it starts */
}

/* thread 0: stop and abort requests, the drain deadline, the heartbeat. */
template <class P>
BLINK_DEV void blink_phase_control(P &plat, const blink_sched_params_t *p, blink_sched_shared_t *sh) {
    blink_sched_state_t *st = p->state;
    blink_ring_header_t *h = blink_header_ptr(p);
    /* Five independent loads, issued together: on the host-mapped ring each is a PCIe round trip. */
    const uint32_t abort = plat.ld32(&p->control->abort);
    const uint32_t stop = plat.ld32(&p->control->stop);
    const uint32_t shutdown = plat.ld32(&h->shutdown);
    sh->fe_epoch = plat.ld64(&h->frontend_epoch);
    const uint64_t bell = p->full_scan_us ? plat.ld64(&h->frontend_doorbell) : 0;
    const uint64_t now = plat.now_ns(p);
    blink_scan_decide(plat, p, sh, bell, now);
    sh->now_us = (int64_t)(now / 1000);
    p->stats->iterations += 1;
    if (abort) {
        blink_settle_step(plat, p);
        blink_abort_all(plat, p, BLINK_ERR_BACKEND_SHUTDOWN);
        sh->exit = BLINK_EXIT_SHUTDOWN;
        return;
    }
    if (!st->draining && (stop || shutdown)) {
        st->draining = 1;
        st->drain_deadline_ns = now + p->grace_ns;
    }
    if (st->draining) {
        if (!st->in_flight && st->w_count == 0 && st->n_running == 0) {
            sh->exit = BLINK_EXIT_SHUTDOWN;
            return;
        }
        if (now >= st->drain_deadline_ns) {
            blink_settle_step(plat, p);
            blink_abort_all(plat, p, BLINK_ERR_BACKEND_SHUTDOWN);
            sh->exit = BLINK_EXIT_SHUTDOWN;
            return;
        }
    }
    if (now - st->last_beat_ns >= p->beat_interval_ns) blink_beat(plat, p, now);
    sh->draining = st->draining;
    sh->in_flight = st->in_flight;
}

/* all threads: one (state, cancel) load per slot, interleaved so a warp's loads are adjacent.
 * Each thread issues BLINK_SCAN_BATCH loads before looking at any of them: a load that
 * crosses PCIe (host-mapped ring) takes a microsecond or two, and a thread stalls at the
 * first use of a loaded word, so batching turns 16 round trips per scan into 2. */
#define BLINK_SCAN_BATCH 8
template <class P>
BLINK_DEV void blink_scan_slot(P &plat, const blink_sched_params_t *p, blink_sched_shared_t *sh, uint64_t i,
                               uint64_t word) {
    blink_slot_t *s = blink_slot_ptr(p, i);
    const uint32_t state = (uint32_t)word, cancel = (uint32_t)(word >> 32);   /* state at byte 0, cancel at 4 */
    if (state == BLINK_PREFILL_PENDING) {
        if (sh->draining) return;
        plat.st64(&s->t_picked_ns, plat.now_ns(p));   /* PENDING is ours already; the stamp may precede the claim */
        plat.fence_sys();   /* the pick-up stamp before the state word; also orders our later reads of the request */
        /* A plain store, no CAS: from PENDING on the slot is ours alone (the frontend writes only
         * its cancel word until DECODE_COMPLETED), and this thread is the only one scanning it. */
        plat.st32(&s->state, BLINK_PREFILL_PROCESSING);
        p->arrivals[plat.add_shared(&sh->n_arrivals, 1)] = (uint32_t)i;
        return;
    }
    blink_req_t *r = &p->reqs[i];
    if ((r->status == BLINK_REQ_WAITING || r->status == BLINK_REQ_RUNNING) && r->abort_finish == 0) {
        if (r->epoch != sh->fe_epoch) {
            r->abort_error = BLINK_ERR_STALE_EPOCH;
            r->abort_finish = BLINK_FINISH_ABORT;
        } else if (cancel) {
            r->abort_error = BLINK_ERR_NONE;
            r->abort_finish = BLINK_FINISH_ABORT;
        }
        if (r->abort_finish)   /* the schedule phase walks a list only where one of its requests is marked */
            plat.add_shared(r->status == BLINK_REQ_WAITING ? &sh->reap_waiting : &sh->reap_running, 1);
    }
}

template <class P>
BLINK_DEV void blink_phase_scan(P &plat, const blink_sched_params_t *p, blink_sched_shared_t *sh, unsigned tid,
                                unsigned nt) {
    const uint64_t n = p->slot_count;
    for (uint64_t base = tid; base < n; base += (uint64_t)BLINK_SCAN_BATCH * nt) {
        uint64_t word[BLINK_SCAN_BATCH];
BLINK_UNROLL
        for (int k = 0; k < BLINK_SCAN_BATCH; ++k) {
            const uint64_t i = base + (uint64_t)k * nt;
            word[k] = i < n ? plat.ld64(&blink_slot_ptr(p, i)->state) : 0;
        }
BLINK_UNROLL
        for (int k = 0; k < BLINK_SCAN_BATCH; ++k) {
            const uint64_t i = base + (uint64_t)k * nt;
            if (i < n && word[k] != 0) blink_scan_slot(plat, p, sh, i, word[k]);   /* 0: EMPTY, no cancel */
        }
    }
}

/* Whether the token ids w[t] for t = lo, lo + step, ... < hi are all in the vocabulary [0, vocab):
 * 16 ring loads in flight at a time, the addresses and the bound in registers (see blink_keys),
 * so a prompt over PCIe costs a round trip per 16 tokens, not one per token. */
template <class P>
BLINK_DEV int blink_tokens_ok(P &plat, const int32_t *w, uint32_t lo, uint32_t hi, uint32_t step, uint32_t vocab) {
    int ok = 1;
    for (uint32_t t0 = lo; t0 < hi; t0 += 16 * step) {
        uint32_t tok[16];
        for (uint32_t q = 0; q < 16; ++q)
            if (t0 + q * step < hi) tok[q] = plat.ld32(&w[t0 + q * step]);
        for (uint32_t q = 0; q < 16; ++q)
            if (t0 + q * step < hi) ok &= (int32_t)tok[q] >= 0 && tok[q] < vocab;
    }
    return ok;
}

/* all threads: claimed slots -> blink_req_t copies, checked as intake._read does;
 * the accepted ones join the waiting queue ordered by (seq, slot). */
template <class P>
BLINK_DEV void blink_phase_intake(P &plat, const blink_sched_params_t *p, blink_sched_shared_t *sh, unsigned tid,
                                  unsigned nt) {
    const uint32_t n = sh->n_arrivals;
    if (n == 0) return;
    blink_sched_state_t *st = p->state;
    const blink_policy_config_t *cfg = &p->policy;
    plat.fence_sys();   /* the request fields and prompt were written before the PENDING state the scan saw */
    for (uint32_t a = tid; a < n; a += nt) {
        const uint32_t slot = p->arrivals[a];
        blink_slot_t *s = blink_slot_ptr(p, slot);
        blink_slot_t v;   /* one volatile read of every request field */
        v.epoch = plat.ld64(&s->epoch);
        v.cancel = plat.ld32(&s->cancel);
        v.seq = plat.ld64(&s->seq);
        v.prompt_offset = plat.ld32(&s->prompt_offset);
        v.prompt_len = plat.ld32(&s->prompt_len);
        v.output_offset = plat.ld32(&s->output_offset);
        v.max_tokens = plat.ld32(&s->max_tokens);
        uint32_t bits = plat.ld32(&s->temperature);
        memcpy(&v.temperature, &bits, 4);
        bits = plat.ld32(&s->top_p);
        memcpy(&v.top_p, &bits, 4);
        v.top_k = (int32_t)plat.ld32(&s->top_k);
        v.flags = plat.ld32(&s->flags);
        v.seed = plat.ld64(&s->seed);
        v.n_stop_ids = plat.ld32(&s->n_stop_ids);
        v.presence_penalty = blink_ld_f32(plat, &s->presence_penalty);
        v.frequency_penalty = blink_ld_f32(plat, &s->frequency_penalty);
        v.repetition_penalty = blink_ld_f32(plat, &s->repetition_penalty);
        v.min_p = blink_ld_f32(plat, &s->min_p);
        v.min_tokens = plat.ld32(&s->min_tokens);
        v.logprobs = plat.ld32(&s->logprobs);
        v.prompt_logprobs = plat.ld32(&s->prompt_logprobs);
        v.logprobs_offset = plat.ld32(&s->logprobs_offset);
        v.prompt_logprobs_offset = plat.ld32(&s->prompt_logprobs_offset);
        v.extra_offset = plat.ld32(&s->extra_offset);
        v.n_logit_bias = plat.ld32(&s->n_logit_bias);
        v.n_allowed_ids = plat.ld32(&s->n_allowed_ids);
        v.bad_words_words = plat.ld32(&s->bad_words_words);
        v.automaton_words = plat.ld32(&s->automaton_words);
        v.group_size = plat.ld32(&s->group_size);
        v.group_index = plat.ld32(&s->group_index);
        v.group_seq = plat.ld64(&s->group_seq);
        v.priority = (int32_t)plat.ld32(&s->priority);
        v.ttft_slo_ms = plat.ld32(&s->ttft_slo_ms);
        v.tbt_slo_ms = plat.ld32(&s->tbt_slo_ms);
        blink_req_t *r = &p->reqs[slot];
        r->seq = v.seq;
        r->epoch = v.epoch;
        r->prompt_offset = v.prompt_offset;
        r->prompt_len = v.prompt_len;
        r->output_offset = v.output_offset;
        r->max_tokens = v.max_tokens;
        r->flags = v.flags;
        const uint32_t n_stop = v.n_stop_ids < BLINK_MAX_STOP_IDS ? v.n_stop_ids : BLINK_MAX_STOP_IDS;
        uint32_t stops[BLINK_MAX_STOP_IDS];   /* every load issued before the first store that uses one */
        for (uint32_t k = 0; k < BLINK_MAX_STOP_IDS; ++k) stops[k] = k < n_stop ? plat.ld32(&s->stop_ids[k]) : 0;
        r->n_stop = n_stop;
        for (uint32_t k = 0; k < BLINK_MAX_STOP_IDS; ++k) r->stop_ids[k] = (int32_t)stops[k];
        r->temperature = v.temperature;
        r->top_p = v.top_p;
        r->top_k = v.top_k;
        r->seed = (v.flags & BLINK_FLAG_HAS_SEED) ? v.seed : blink_derive_seed(v.seq, v.epoch, slot, plat.now_ns(p));
        r->min_p = v.min_p;
        r->presence_penalty = v.presence_penalty;
        r->frequency_penalty = v.frequency_penalty;
        r->repetition_penalty = v.repetition_penalty;
        r->min_tokens = v.min_tokens;
        r->n_mask_stops = 0;   /* the sampler's min_tokens mask: the stop ids, then EOS unless ignore_eos */
        for (uint32_t k = 0; k < r->n_stop; ++k) r->mask_stops[r->n_mask_stops++] = r->stop_ids[k];
        if (!(v.flags & BLINK_FLAG_IGNORE_EOS) || v.automaton_words)   /* a finished structure ends with EOS */
            for (uint32_t k = 0; k < cfg->n_eos && k < BLINK_MAX_EOS_IDS; ++k)
                r->mask_stops[r->n_mask_stops++] = cfg->eos_ids[k];
        r->logprobs = v.logprobs;
        r->logprobs_offset = v.logprobs_offset;
        r->seat = BLINK_NO_SEAT;
        r->seat_fresh = 0;
        r->extra_offset = v.extra_offset;
        r->n_logit_bias = v.n_logit_bias;
        r->n_allowed_ids = v.n_allowed_ids;
        r->bad_words_words = v.bad_words_words;
        r->automaton_words = v.automaton_words;
        r->automaton_offset = v.extra_offset + 2 * v.n_logit_bias + v.n_allowed_ids + v.bad_words_words;
        r->automaton_state = -1;
        r->num_cached = r->cached_idle = r->num_committed = 0;
        blink_keys_reset(r);
        blink_req_time_t *tm = &p->times[slot];   /* what the policy reads (intake.py's Sequence fields) */
        tm->id = slot;
        tm->priority = v.priority;
        tm->arrival_us = sh->now_us;              /* one clock per scan: ties go to the lower slot */
        tm->last_us = -1;
        tm->run_us = 0;
        tm->ttft_slo_us = v.ttft_slo_ms ? (int64_t)v.ttft_slo_ms * 1000 : p->ttft_slo_us;
        tm->tbt_slo_us = v.tbt_slo_ms ? (int64_t)v.tbt_slo_ms * 1000 : p->tbt_slo_us;
        r->generated = r->num_computed = r->num_blocks = 0;
        r->status = BLINK_REQ_FREE;
        r->ring_state = BLINK_PREFILL_PROCESSING;
        r->abort_finish = r->abort_error = 0;
        r->intake_error = blink_intake_check(cfg, p->prompt_arena_tokens, p->output_arena_tokens,
                                             p->logprob_arena_words, sh->fe_epoch, &v);
        if (!r->intake_error) r->intake_error = blink_device_unsupported(&v, p->n_seats);
    }
    plat.sync();
    /* Prompt token ids: few arrivals -> the block strides over each prompt; many -> one thread per prompt. */
    const int32_t *arena = blink_prompt_arena(p);
    if (n * 8 <= nt) {
        for (uint32_t a = 0; a < n; ++a) {
            blink_req_t *r = &p->reqs[p->arrivals[a]];
            if (r->intake_error) continue;          /* uniform: every thread reads the same word */
            int bad = !blink_tokens_ok(plat, arena + r->prompt_offset, tid, r->prompt_len, nt, cfg->vocab_size);
            bad = plat.sync_or(bad);
            if (bad && tid == 0) r->intake_error = BLINK_FINISH_ERROR << 16 | BLINK_ERR_INVALID_TOKEN;
        }
    } else {
        for (uint32_t a = tid; a < n; a += nt) {
            blink_req_t *r = &p->reqs[p->arrivals[a]];
            if (r->intake_error) continue;
            if (!blink_tokens_ok(plat, arena + r->prompt_offset, 0, r->prompt_len, 1, cfg->vocab_size))
                r->intake_error = BLINK_FINISH_ERROR << 16 | BLINK_ERR_INVALID_TOKEN;
        }
    }
    plat.sync();
    /* The sampling data a seat is filled from (bounds checked by blink_intake_check), as intake.py's
     * decode_extra checks it: one thread per arrival (rare, and at most a few thousand words). */
    for (uint32_t a = tid; a < n; a += nt) {
        blink_req_t *r = &p->reqs[p->arrivals[a]];
        if (r->intake_error || !(r->n_logit_bias || r->n_allowed_ids || r->bad_words_words)) continue;
        const int32_t *w = arena + r->extra_offset;
        if (!blink_extra_ok([&](uint32_t i) { return plat.ld32(&w[i]); }, cfg->vocab_size, r->n_logit_bias,
                            r->n_allowed_ids, r->bad_words_words))
            r->intake_error = BLINK_FINISH_ERROR << 16 | BLINK_ERR_INVALID_REQUEST;
    }
    plat.sync();
    /* Structured outputs: automaton.decode's checks on the words the device will read (header,
     * then every state and the runs and transitions it points at), the block striding over the
     * states of one request at a time (rare, up to ~1M words: one thread alone would take long
     * over PCIe). The loop is uniform: every thread reads the same request copy. */
    for (uint32_t a = 0; a < n; ++a) {
        blink_req_t *r = &p->reqs[p->arrivals[a]];
        if (r->intake_error || !r->automaton_words) continue;
        const int32_t *w = arena + r->automaton_offset;
        auto ld = [&](uint32_t i) { return plat.ld32(&w[i]); };
        int bad = !blink_automaton_header_ok(ld, r->automaton_words);
        if (!bad) {
            const blink_automaton_view_t av = blink_automaton_view(ld);
            for (uint32_t k = tid; k < av.n_states && !bad; k += nt)
                bad = !blink_automaton_state_ok(ld, &av, k, cfg->vocab_size);
        }
        bad = plat.sync_or(bad);
        if (bad && tid == 0) r->intake_error = BLINK_FINISH_ERROR << 16 | BLINK_ERR_INVALID_REQUEST;
    }
    plat.sync();
    /* Reject, or queue at the rank of (seq, slot) among this scan's accepted arrivals. */
    for (uint32_t a = tid; a < n; a += nt) {
        const uint32_t slot = p->arrivals[a];
        blink_req_t *r = &p->reqs[slot];
        if (r->intake_error) {
            blink_complete_slot(plat, p, slot, r->intake_error >> 16, r->intake_error & 0xffffu);
            plat.add_shared(&sh->n_completed, 1);
            continue;
        }
        uint32_t rank = 0;
        for (uint32_t b = 0; b < n; ++b) {
            const uint32_t other = p->arrivals[b];
            const blink_req_t *o = &p->reqs[other];
            if (o->intake_error) continue;
            if (o->seq < r->seq || (o->seq == r->seq && other < slot)) ++rank;
        }
        p->waiting[(st->w_head + st->w_count + rank) % p->slot_count] = slot;
        plat.add_shared(&sh->n_valid, 1);
        /* its prompt into the key chain (the block keys the prefix-cache lookup at admission reads;
         * publish goes on with the generated tokens): here, one thread per arrival, rather than in
         * the serial schedule phase */
        if (p->prefix_caching) blink_keys_read(plat, p, slot, r, r->prompt_len);
    }
    plat.sync();
    if (tid == 0) {
        for (uint32_t k = 0; k < sh->n_valid; ++k)
            p->reqs[p->waiting[(st->w_head + st->w_count + k) % p->slot_count]].status = BLINK_REQ_WAITING;
        st->w_count += sh->n_valid;
        p->stats->claimed += n;
    }
}

/* thread 0: poll the completion flag of the step in flight, beating meanwhile. */
template <class P>
BLINK_DEV void blink_phase_wait(P &plat, const blink_sched_params_t *p, blink_sched_shared_t *sh) {
    blink_sched_state_t *st = p->state;
    if (!st->in_flight) return;
    const uint64_t t0 = plat.now_ns(p);
    while (plat.ld_acq32(p->done) != st->step_no) {   /* acquire: the step's tokens before its flag */
        const uint64_t now = plat.now_ns(p);
        if (now - st->last_beat_ns >= p->beat_interval_ns) {
            blink_beat(plat, p, now);
            if (plat.ld32(&p->control->abort)) {
                blink_settle_step(plat, p);
                blink_abort_all(plat, p, BLINK_ERR_BACKEND_SHUTDOWN);
                sh->exit = BLINK_EXIT_SHUTDOWN;
                return;
            }
        }
        if (now - st->step_launched_ns > p->step_timeout_ns) {   /* stuck: aborted under it (blink_settle_step) */
            blink_abort_all(plat, p, BLINK_ERR_INTERNAL);
            sh->exit = BLINK_EXIT_STEP_TIMEOUT;
            return;
        }
    }
    const uint64_t t1 = plat.now_ns(p);
    p->stats->wait_ns += t1 - t0;
    sh->pub_us = (int64_t)(t1 / 1000);   /* scheduler.update's clock: one time for the step's tokens */
}

/* all threads: the step's tokens into the ring (token, fence, count), then finish or move on. */
template <class P>
BLINK_DEV void blink_phase_publish(P &plat, const blink_sched_params_t *p, blink_sched_shared_t *sh, unsigned tid,
                                   unsigned nt) {
    if (!sh->in_flight) return;
    const blink_sched_state_t *st = p->state;
    int32_t *out = blink_output_arena(p);
    uint64_t keys_dt = 0;   /* this thread's time on block keys, all its chunks (stats pub_keys_ns) */
    for (uint32_t c = tid; c < st->n_chunks; c += nt) {
        const uint32_t slot = p->chunk_slot[c];
        blink_req_t *r = &p->reqs[slot];
        if (r->status != BLINK_REQ_RUNNING) continue;
        r->num_computed += p->chunk_len[c];
        const uint32_t to_commit = p->prefix_caching ? blink_keys_ahead(plat, p, slot, r, keys_dt) : 0;
        if (to_commit) {
            /* for the commit: a bit per chunk, so it is walked in chunk order without sorting */
            plat.or_bit(blink_scratch_list(p, BLINK_LIST_COMMIT), c);
            plat.add_shared(&sh->commit, 1);
            if (to_commit > 1) plat.add_shared(&sh->commit_multi, 1);
        }
        if (!p->chunk_sample[c]) continue;
        r->seat_fresh = 0;   /* the step that sampled filled the seat */
        const int32_t token = p->step_tokens[c];
        blink_slot_t *s = blink_slot_ptr(p, slot);
        plat.st32(&out[r->output_offset + r->generated], (uint32_t)token);
#ifndef BLINK_KEYS_FROM_RING   /* (a twin built with it reads each generated token back from the ring: the tests' A/B) */
#ifdef BLINK_KEYS_SKIP_FEED     /* (the tests' twin that lets the chain fall behind now and then) */
        if (r->generated % 7 != 3)
#endif
        if (p->prefix_caching && r->key_pos == r->prompt_len + r->generated)   /* the chain is up with the tokens */
            blink_key_feed(p, slot, r, (uint32_t)token);
#endif
        const uint64_t now = plat.now_ns(p);
        if (r->generated == 0) plat.st64(&s->t_first_ns, now);
        plat.st64(&s->t_last_ns, now);
        plat.fence_sys();   /* the token and its stamps before the count that makes them visible */
        r->generated += 1;
        plat.st32(&s->generated, r->generated);
        p->times[slot].last_us = sh->pub_us;
        plat.add_shared(&sh->n_tokens, 1);
        if (r->automaton_words) {   /* structured output: the state after the token (logits_processors.advance) */
            const int32_t *w = blink_prompt_arena(p) + r->automaton_offset;
            auto ld = [&](uint32_t i) { return plat.ld32(&w[i]); };
            const blink_automaton_view_t av = blink_automaton_view(ld);
            r->automaton_state = blink_automaton_advance(ld, &av, r->automaton_state, token);
        }
        const uint32_t finish = blink_finish_reason(&p->policy, r, token);
        if (finish != BLINK_FINISH_NONE) {
            r->status = BLINK_REQ_FINISHED;
            blink_complete_slot(plat, p, slot, finish, BLINK_ERR_NONE, 1);   /* t_last_ns stamped above */
            plat.add_shared(&sh->n_completed, 1);
            plat.add_shared(&sh->reap_running, 1);
        } else if (r->ring_state != BLINK_DECODE_PROCESSING) {
            /* No new payload since the fence above: the count is already ordered before this state. */
            plat.st32(&s->state, BLINK_DECODE_PROCESSING);
            r->ring_state = BLINK_DECODE_PROCESSING;
        }
    }
    if (keys_dt) plat.max_shared(&sh->keys_ns, keys_dt < 0xffffffffull ? (uint32_t)keys_dt : 0xffffffffu);
}

/* ---- The steady decode step, planned in parallel ----
 * Under FCFS, with nobody waiting or no seat free, and every running request decoding one token,
 * the planner's rules reduce to: decode them all, in running order, each with the KV block its next
 * token needs, unless the pool lacks blocks (rule 3 preempts then). Thread 0 walking 64-256 requests for that, twice in
 * blink_plan_core and once to allocate, paid a dependent global load or two per request each time:
 * the schedule phase's main cost per step on the H200 (43 / 160 us at 64 / 256 running). The survey
 * has every thread check its requests instead; thread 0 then only allocates for the few that cross
 * a block boundary. Anything else (an arrival waiting, a prefill, too few free blocks, another
 * policy) goes to the full planner; the CPU twin runs that planner beside every fast plan and
 * counts a disagreement (stats fast_plan_mismatches, which the tests hold at 0). The reap likewise:
 * where a request finished (most steps at 256 running with mixed lengths) thread 0 walked every
 * running request to drop it; the survey lists the kept ones in parallel, thread 0 walks the
 * dropped ones only, and the fill phase copies the kept list back while it writes the rows. */

#define BLINK_NO_RANK 0xffffffffu

/* Bit i of a bitmap of 32-bit words, and the set bits before it. */
static inline BLINK_HD uint32_t blink_bit(const uint32_t *bits, uint32_t i) { return (bits[i >> 5] >> (i & 31u)) & 1u; }

/* fn(i) for each set bit i of the first n bits, in ascending order. */
template <class F>
BLINK_DEV void blink_each_bit(const uint32_t *bits, uint32_t n, F fn) {
    for (uint32_t w = 0; w < (n + 31) / 32; ++w)
        for (uint32_t b = bits[w]; b; b &= b - 1) fn(w * 32 + blink_ctz32(b));
}

/* The reap's test: a running request that this iteration drops (finished, or aborted). */
static inline BLINK_HD int blink_reaped(const blink_req_t *r) {
    return r->status == BLINK_REQ_FINISHED || r->abort_finish;
}
static inline BLINK_HD uint32_t blink_bits_before(const uint32_t *bits, uint32_t i) {
    uint32_t n = blink_popc32(bits[i >> 5] & ((1u << (i & 31u)) - 1u));
    for (uint32_t w = 0; w < (i >> 5); ++w) n += blink_popc32(bits[w]);
    return n;
}

/* thread 0, after the wait phase (the intake has queued this iteration's arrivals): whether this
 * iteration surveys (the same value to every thread after the next barrier), its counters and needy
 * bitmap zeroed. */
static inline BLINK_HD void blink_survey_decide(const blink_sched_params_t *p, blink_sched_shared_t *sh) {
    const blink_sched_state_t *st = p->state;
    sh->survey = p->fast_plan && !st->fast_plan_off && st->n_running > 0;
    sh->checking = st->fast_checked < p->fast_plan_checks;
    sh->sv_other = sh->sv_gone = sh->sv_need = sh->sv_needy = sh->sv_over = 0;
    if (!sh->survey) return;
    uint32_t *needy = blink_scratch_list(p, BLINK_LIST_NEEDY_BITS), *gone = blink_scratch_list(p, BLINK_LIST_GONE_BITS);
    for (uint32_t w = 0; w < (st->n_running + 31) / 32; ++w) needy[w] = gone[w] = 0;
}

/* all threads, after publish: running position i -> gone (the reap drops it: finished, or
 * aborted), other (not one token to decode), or a decoder, marked in the needy bitmap where its
 * next token needs a KV block. Every thread runs every round (the ballot wants whole warps; nt is
 * a multiple of 32 on the device), so position i of round i0 is i0 + tid. Where the reap is due,
 * a second pass lists the running requests it keeps, in order: request i goes to i less the gone
 * ones before it (popcounts of the gone bitmap), so thread 0 walks only the gone ones. */
template <class P>
BLINK_DEV void blink_phase_survey(P &plat, const blink_sched_params_t *p, blink_sched_shared_t *sh, unsigned tid,
                                  unsigned nt) {
    const uint32_t n = p->state->n_running;
    const int64_t bs = p->policy.block_size;
    uint32_t *bits = blink_scratch_list(p, BLINK_LIST_NEEDY_BITS);
    uint32_t *gone_bits = blink_scratch_list(p, BLINK_LIST_GONE_BITS);
    uint32_t other = 0, gone = 0, need = 0, needy_n = 0, over = 0;
    for (uint32_t i0 = 0; i0 < n; i0 += nt) {
        const uint32_t i = i0 + tid;
        int needy = 0, dropped = 0;
        if (i < n) {
            const blink_req_t *r = &p->reqs[p->running[i]];
            if (blink_reaped(r)) {
                ++gone;
                dropped = 1;
            } else if ((int64_t)blink_req_tokens(r) - r->num_computed != 1) {
                ++other;
            } else {
                const int64_t k = blink_blocks_needed((int64_t)r->num_computed + 1, bs) - r->num_blocks;
                if (k > 0) {
                    need += (uint32_t)k;
                    needy = 1;
                    ++needy_n;
                    over += r->num_blocks + (uint32_t)k > p->kv_max_blocks;
                }
#ifdef BLINK_PLANT_SURVEY_FAULT   /* a test variant of the twin only: the bitmap misses position 0's block */
                if (i == 0) needy = 0;
#endif
            }
        }
        plat.ballot_bit(bits, i, needy, n);
        plat.ballot_bit(gone_bits, i, dropped, n);
    }
    if (other) plat.add_shared(&sh->sv_other, other);
    if (gone) plat.add_shared(&sh->sv_gone, gone);
    if (need) plat.add_shared(&sh->sv_need, need);
    if (needy_n) plat.add_shared(&sh->sv_needy, needy_n);
    if (over) plat.add_shared(&sh->sv_over, over);
    if (!sh->reap_running) return;   /* the same in every thread: raised before the barrier ahead */
    plat.sync();
    uint32_t *kept = blink_scratch_list(p, BLINK_LIST_KEPT), *rank = blink_scratch_list(p, BLINK_LIST_KEPT_RANK);
    for (uint32_t i = tid; i < n; i += nt) {
        if (blink_bit(gone_bits, i)) continue;
        const uint32_t k = i - blink_bits_before(gone_bits, i);
        kept[k] = p->running[i];
        rank[k] = blink_bit(bits, i) ? blink_bits_before(bits, i) : BLINK_NO_RANK;
    }
}

/* all threads, in the fill phase of a fast plan with par_alloc: the block decode chunk k's request
 * needs, taken as blink_pkv_alloc would in running order: the needy one of rank j (the needy before
 * it) gets the free stack's entry j from the top, which the schedule phase took off the stack, or
 * past the stack's height, the LRU's entry j - height from its head, which the schedule phase
 * unlinked (blink_pkv_lru_pop; blink_evict_keys takes its key out of the table). */
static inline BLINK_HD void blink_fill_block(const blink_sched_params_t *p, const blink_sched_shared_t *sh, uint32_t k,
                                             uint32_t slot) {
    const uint32_t *bits = blink_scratch_list(p, BLINK_LIST_NEEDY_BITS);
    const uint32_t j = sh->step_ids == BLINK_IDS_KEPT ? blink_scratch_list(p, BLINK_LIST_KEPT_RANK)[k]
                       : blink_bit(bits, k)           ? blink_bits_before(bits, k)
                                                      : BLINK_NO_RANK;
    if (j == BLINK_NO_RANK) return;
    blink_req_t *r = &p->reqs[slot];
    blink_pkv_t *kv = p->pkv;
    const uint32_t b = j < sh->evict_from ? kv->free_stack[sh->alloc_top - 1 - j]
                                          : blink_scratch_list(p, BLINK_LIST_VICTIMS)[j - sh->evict_from];
    kv->refs[b] = 1;
    blink_table(p, slot)[r->num_blocks] = b;
    r->num_blocks += 1;
}

/* thread 0, before the reap: whether the fill phase can take the needy ones' blocks in parallel:
 * one block each, no block table full, and the pool has them all, on the free stack or evictable
 * (the reap only adds free blocks). Else the apply allocates them one by one (blink_pkv_alloc). */
static inline BLINK_HD int blink_par_alloc_ok(const blink_sched_params_t *p, const blink_sched_shared_t *sh) {
    return sh->sv_needy == sh->sv_need && sh->sv_over == 0 && blink_pkv_free_count(p->pkv) >= sh->sv_need;
}

/* all threads, in the fill phase where it evicted: the evicted blocks' keys out of the prefix cache's
 * table, with blink_pkv_table_del's result (the same keys gone; entries may sit elsewhere in their
 * runs). At 256 running in step, every block_size steps 256 blocks are evicted at once, and thread 0's
 * blink_pkv_alloc paid a probe and a backward shift of dependent loads for each. Here each thread
 * marks its victims' entries (a mark is no gap: probes still pass it), then the first mark of each run
 * (entries between two gaps) names a thread that removes every mark of that run by backward shift,
 * in order, up to the run's end as it was (a removal may open a gap inside the run, with marks after
 * it); runs are disjoint and a shift never leaves its run, so the runs go in parallel. */
template <class P>
BLINK_DEV void blink_evict_keys(P &plat, const blink_sched_params_t *p, blink_sched_shared_t *sh, unsigned tid,
                                unsigned nt) {
    blink_pkv_t *kv = p->pkv;
    const uint32_t mask = kv->table_cap - 1, e = sh->evict;
    const uint32_t *victims = blink_scratch_list(p, BLINK_LIST_VICTIMS);
    uint32_t *tombs = blink_scratch_list(p, BLINK_LIST_TOMBS), *leader = blink_scratch_list(p, BLINK_LIST_LEADER);
    for (uint32_t i = tid; i < e; i += nt) {   /* mark: each victim's entry (found by key and block) */
        const uint32_t b = victims[i];
        const uint64_t k = kv->key[b];
        uint32_t t = (uint32_t)k & mask, at;
        /* Other threads mark their victims' entries meanwhile (block -> TOMB): relaxed accesses, and
         * either value is neither NIL nor b, so the probe ends where it would alone. */
        while ((at = plat.ld_blk32(&kv->table_block[t])) != BLINK_KV_NIL && !(at == b && kv->table_key[t] == k))
            t = (t + 1) & mask;
        tombs[i] = at == b ? t : BLINK_KV_NIL;   /* a keyed block's key is in the table */
        if (at == b) plat.st_blk32(&kv->table_block[t], BLINK_KV_TOMB);
    }
    plat.sync();
    for (uint32_t i = tid; i < e; i += nt) {   /* lead: the first mark of its run (read only) */
        const uint32_t t = tombs[i];
        uint32_t lead = t != BLINK_KV_NIL;
        uint32_t j = t;
        while (lead && kv->table_block[(j - 1) & mask] != BLINK_KV_NIL) {   /* a gap ends every run: cap >= 2 x blocks */
            j = (j - 1) & mask;
            lead = kv->table_block[j] != BLINK_KV_TOMB;
        }
        leader[i] = lead;
    }
    plat.sync();
    for (uint32_t i = tid; i < e; i += nt) {   /* remove: each run's marks, by its leader */
#ifdef BLINK_PLANT_EVICT_FAULT   /* a test variant of the twin only: the marks stay in the table */
        continue;
#endif
        if (!leader[i]) continue;
        uint32_t end = tombs[i];   /* the run's gap, before anything moves: a removal may open gaps inside the run */
        while (kv->table_block[end] != BLINK_KV_NIL) end = (end + 1) & mask;
        for (uint32_t j = tombs[i]; j != end;) {
            if (kv->table_block[j] == BLINK_KV_TOMB) blink_pkv_table_del_at(kv, j);   /* a later entry moves in, or a gap */
            else j = (j + 1) & mask;
        }
    }
    if (!sh->evict_check) return;   /* the same in every thread: set before the barrier ahead of the fill */
    plat.sync();
    uint32_t entries;   /* the whole table checked by every thread's share, for the launch phase */
    if (blink_pkv_table_check_part(kv, tid, nt, &entries)) plat.add_shared(&sh->evict_bad, 1);
    if (entries) plat.add_shared(&sh->evict_entries, entries);
}

/* thread 0, before the reap compacts the running list: the survey's counts describe the list the
 * planner will see when no request it skipped is left behind (the reap drops them only when flagged);
 * the needy positions, in running order, become slots while the positions still hold (where
 * `lists`: the apply allocates for them, or the twin checks the fill phase's allocation). */
static inline BLINK_DEV uint32_t blink_survey_needy(const blink_sched_params_t *p, const blink_sched_shared_t *sh,
                                                    int lists) {
    if (!sh->survey || p->rules.policy != BLINK_POLICY_FCFS || sh->sv_other || (sh->sv_gone && !sh->reap_running))
        return 0;
    if (!lists) return sh->sv_needy + 1;
    uint32_t *ids = blink_scratch_list(p, BLINK_LIST_NEEDY_ID), k = 0;
    blink_each_bit(blink_scratch_list(p, BLINK_LIST_NEEDY_BITS), p->state->n_running,
                   [&](uint32_t i) { ids[k++] = p->running[i]; });
    return k + 1;   /* 0: no fast plan; else 1 + the number of needy requests */
}

/* Rule 1 with every running request a decoder (the survey's case): a PREFILL step admits waiting
 * requests into free seats unless the last step was the PREFILL step (decode resumes then). */
static inline BLINK_HD int blink_admission_due(const blink_sched_params_t *p) {
    const blink_sched_state_t *st = p->state;
    return st->w_count && st->n_running < p->policy.max_batch_size && st->prev_kind != BLINK_STEP_PREFILL;
}

/* thread 0, after the reap and the waiting requests' prefix lookups: rule 1's PREFILL step from the
 * survey's counts where every running request decodes one token next (FCFS, as the survey asks).
 * Then the full planner's rule 2a has nobody to chunk, its reserve is the survey's needy count and
 * nothing is freed by victims, so rule 2b (blink_plan_admit) runs as the full planner would without
 * one walk of the running list (three walks there, a dependent load or two a request each: at 256
 * running with mixed lengths, where most steps admit into a seat the step before freed, the policy
 * was 33 us a step on the H200). 1: `plan` admits (its lists set by the caller); 0: nobody admitted,
 * and the full planner would go on to rule 3 (the fast decode plan, `none_admitted`). */
static inline BLINK_HD int blink_fast_admit(const blink_sched_params_t *p, const blink_sched_shared_t *sh,
                                            int64_t free_blocks, blink_plan_t *plan) {
    const blink_sched_state_t *st = p->state;
    const uint32_t cap = (uint32_t)p->slot_count;
    plan->kind = BLINK_STEP_IDLE;
    plan->n_prefill = plan->n_decode = plan->n_preempted = plan->n_admitted = plan->n_new_blocks = 0;
    int64_t seats = (int64_t)p->policy.max_batch_size - st->n_running;
#ifdef BLINK_PLANT_ADMIT_FAULT   /* a test variant of the twin only: one seat too many (within the lists' room) */
    if (seats < (int64_t)p->policy.max_batch_size) seats += 1;
#endif
    blink_plan_admit(&p->policy, p->reqs, p->waiting, st->w_head, st->w_count, cap, p->policy.max_prefill_tokens,
                     free_blocks, sh->sv_needy, seats, 0, plan, p->waiting, st->w_head, cap);
    if (plan->n_prefill == 0) return 0;
    plan->kind = BLINK_STEP_PREFILL;
    return 1;
}

/* The twin's and the device's check of an admission from the survey: the full planner's plan `want`
 * (its rule 2a listed nobody) against it, entry for entry. */
static inline BLINK_HD int blink_admits_agree(const blink_plan_t *want, const blink_plan_t *got) {
    if (want->kind != got->kind || want->n_prefill != got->n_prefill || want->n_decode || want->n_preempted ||
        want->n_admitted != got->n_admitted || want->n_new_blocks != got->n_new_blocks)
        return 0;
    for (uint32_t k = 0; k < got->n_prefill; ++k)
        if (want->prefill_id[k] != got->prefill_id[k] || want->prefill_len[k] != got->prefill_len[k] ||
            want->admitted_id[k] != got->admitted_id[k] || want->new_blocks_id[k] != got->new_blocks_id[k] ||
            want->new_blocks_n[k] != got->new_blocks_n[k])
            return 0;
    return 1;
}

/* thread 0, after the reap: the fast plan (the full planner's own result for this case), or 0 where
 * it does not hold: nobody left running, a seat free for a waiting request that rule 1 would admit
 * (unless `none_admitted`: blink_fast_admit found rule 2b admits nobody), or a pool that cannot give
 * every decoder its block without preempting. */
static inline BLINK_HD int blink_fast_plan(const blink_sched_params_t *p, const blink_sched_shared_t *sh,
                                           const uint32_t *running, uint32_t n_needy, int lists,
                                           int64_t free_blocks, int none_admitted, blink_plan_t *plan) {
    const blink_sched_state_t *st = p->state;
    if (st->n_running == 0 || (blink_admission_due(p) && !none_admitted) || (int64_t)sh->sv_need > free_blocks)
        return 0;
    const int64_t bs = p->policy.block_size;
    plan->kind = BLINK_STEP_DECODE;
    plan->n_prefill = plan->n_preempted = plan->n_admitted = 0;
    plan->n_decode = st->n_running;
    plan->decode_id = (uint32_t *)running;
    plan->new_blocks_id = blink_scratch_list(p, BLINK_LIST_NEEDY_ID);
    plan->new_blocks_n = blink_scratch_list(p, BLINK_LIST_NEEDY_N);
    plan->n_new_blocks = lists ? n_needy : 0;   /* none listed: the fill phase takes them (par_alloc) */
    for (uint32_t k = 0; k < plan->n_new_blocks; ++k) {
        const blink_req_t *r = &p->reqs[plan->new_blocks_id[k]];
        plan->new_blocks_n[k] = (uint32_t)(blink_blocks_needed((int64_t)r->num_computed + 1, bs) - r->num_blocks);
    }
    return 1;
}

/* thread 0: one running request the reap drops (engine._reap / the finished of the publish phase). */
template <class P>
BLINK_DEV void blink_reap_running(P &plat, const blink_sched_params_t *p, uint32_t slot) {
    blink_req_t *r = &p->reqs[slot];
    if (r->status != BLINK_REQ_FINISHED) {
        blink_complete_slot(plat, p, slot, r->abort_finish, r->abort_error);
        p->stats->completed += 1;
    }
    blink_blocks_release(p, slot, r);
    blink_seat_release(p, r);
    r->status = BLINK_REQ_FREE;
}

/* A check of the survey's results disagreed with the full walks: counted, and the full walks plan
 * every step from then on (the scheduler heals itself; stats show it). */
static inline BLINK_HD void blink_fast_plan_failed(const blink_sched_params_t *p) {
    p->stats->fast_plan_mismatches += 1;
    p->state->fast_plan_off = 1;
}

/* thread 0: the reap from the survey's lists: only the gone positions walked (in running order,
 * as the full walk releases them); returns the kept list, which stands for the running list until
 * it is copied back (blink_running_settle, or the fill phase). While checking, the kept list is
 * first held against the full walk's, read-only: 0 where they disagree (the caller walks). */
template <class P>
BLINK_DEV const uint32_t *blink_survey_reap(P &plat, const blink_sched_params_t *p, const blink_sched_shared_t *sh) {
    blink_sched_state_t *st = p->state;
    const uint32_t n = st->n_running, n_kept = n - sh->sv_gone;
    const uint32_t *gone = blink_scratch_list(p, BLINK_LIST_GONE_BITS), *kept = blink_scratch_list(p, BLINK_LIST_KEPT);
    if (sh->checking) {
        uint32_t j = 0;
        int ok = 1;
        for (uint32_t i = 0; i < n; ++i) {
            const blink_req_t *r = &p->reqs[p->running[i]];
            if (blink_reaped(r)) continue;
            ok &= j < n_kept && kept[j] == p->running[i];
            ++j;
        }
        if (!ok || j != n_kept) {
            blink_fast_plan_failed(p);
            return 0;
        }
    }
    blink_each_bit(gone, n, [&](uint32_t i) { blink_reap_running(plat, p, p->running[i]); });
    st->n_running = n_kept;
    return kept;
}

/* thread 0: the running list back in p->running where the survey's kept list stood for it. */
static inline BLINK_HD const uint32_t *blink_running_settle(const blink_sched_params_t *p, const uint32_t *running) {
    if (running != p->running)
        for (uint32_t i = 0; i < p->state->n_running; ++i) p->running[i] = running[i];
    return p->running;
}

/* The CPU twin's check: the full planner's plan `want` against the fast plan `got` (its new blocks
 * without the zero entries the full planner lists). */
static inline BLINK_HD int blink_plans_agree(const blink_plan_t *want, const blink_plan_t *got) {
    if (want->kind != got->kind || want->n_prefill || want->n_preempted || want->n_admitted ||
        want->n_decode != got->n_decode)
        return 0;
    for (uint32_t k = 0; k < got->n_decode; ++k)
        if (want->decode_id[k] != got->decode_id[k]) return 0;
    uint32_t j = 0;
    for (uint32_t k = 0; k < want->n_new_blocks; ++k) {
        if (want->new_blocks_n[k] == 0) continue;
        if (j >= got->n_new_blocks || want->new_blocks_id[k] != got->new_blocks_id[j] ||
            want->new_blocks_n[k] != got->new_blocks_n[j])
            return 0;
        ++j;
    }
    return j == got->n_new_blocks;
}

/* ---- The prefix-cache commits, in parallel ----
 * Where 64-256 decoding requests cross a block boundary in the same step (requests that started
 * together do, every block_size steps), thread 0 committing them one by one paid a dependent global
 * load or several each (the request, its table, the block's refs and key, the table's probe twice).
 * When every chunk has one block to commit (decode steps; a prefill chunk that fills several goes to
 * the walk), the commit phase does it with every thread, with the walk's result: the walk commits
 * in chunk order, and a block enters the cache unless it has a key already or its key is in the
 * table, which an earlier chunk of the same step may have just put there. So a candidate is a chunk
 * whose block has no key and whose key the table lacks before the step; of the candidates with one
 * key, the first in chunk order wins. (Two candidates holding one block under different keys, which
 * the scheduler never makes, would need the walk's order: the walk commits then.) The winners' keys
 * differ and none is in the table, so they go in at once, each probe claiming an empty entry by
 * compare-and-swap. Entries may sit elsewhere in a probe run than the walk would put them; the table
 * maps the same keys to the same blocks, and that is all its readers see. The first
 * fast_plan_checks times (every time in the twin's tests) thread 0 first decides the winners by the
 * walk, read-only, and a disagreement is counted (fast_plan_mismatches), the walk commits and the
 * parallel paths are off from then on (blink_fast_plan_failed). */

/* Whether this iteration's commits go to the commit phase (the same value in every thread after
 * publish's barrier): the parallel paths on, and each listed chunk one block to commit. */
static inline BLINK_HD int blink_commit_parallel(const blink_sched_shared_t *sh) {
    return sh->par_commit && sh->commit && !sh->commit_multi;
}

/* Key k of a candidate list, kept as two 32-bit lists (plan_scratch's lists are 32-bit). */
static inline BLINK_HD uint64_t blink_list_key(const blink_sched_params_t *p, uint32_t lo, uint32_t i) {
    return (uint64_t)blink_scratch_list(p, lo)[i] | (uint64_t)blink_scratch_list(p, lo + 1)[i] << 32;
}
static inline BLINK_HD void blink_list_key_set(const blink_sched_params_t *p, uint32_t lo, uint32_t i, uint64_t k) {
    blink_scratch_list(p, lo)[i] = (uint32_t)k;
    blink_scratch_list(p, lo + 1)[i] = (uint32_t)(k >> 32);
}

/* The block and key chunk c's request commits (its one block to commit); whether the walk would
 * find it uncommitted before this step's commits: held, no key, its key not in the table. */
static inline BLINK_HD int blink_commit_candidate(const blink_sched_params_t *p, uint32_t c, uint32_t *block,
                                                  uint64_t *key) {
    const uint32_t slot = p->chunk_slot[c];
    const uint32_t j = p->reqs[slot].num_committed;
    *block = blink_table(p, slot)[j];
    *key = p->kv_keys[(uint64_t)slot * p->kv_max_blocks + j];
    const blink_pkv_t *k = p->pkv;
    return *block < k->num_blocks && k->refs[*block] && !k->has_key[*block] && blink_pkv_find(k, *key) == BLINK_KV_NIL;
}

/* thread 0, while checking: the winners by the walk's rule, read from the requests themselves
 * (not the candidate lists), against the parallel pass's winner bitmap; 1 where they agree. */
static inline BLINK_DEV int blink_commit_check(const blink_sched_params_t *p, uint32_t n_chunks) {
    const uint32_t *commit = blink_scratch_list(p, BLINK_LIST_COMMIT), *win = blink_scratch_list(p, BLINK_LIST_WIN_BITS);
    uint32_t *blocks = blink_scratch_list(p, BLINK_LIST_CHECK_BLOCK), n_won = 0;
    int ok = 1;
    blink_each_bit(commit, n_chunks, [&](uint32_t c) {
        uint32_t b;
        uint64_t k;
        int wins = blink_commit_candidate(p, c, &b, &k);
        for (uint32_t w = 0; wins && w < n_won; ++w)   /* an earlier winner has its key or its block */
            wins = blocks[w] != b && blink_list_key(p, BLINK_LIST_CHECK_KLO, w) != k;
        if (wins) {
            blocks[n_won] = b;
            blink_list_key_set(p, BLINK_LIST_CHECK_KLO, n_won++, k);
        }
        ok &= (uint32_t)wins == blink_bit(win, c);
    });
    return ok;
}

/* all threads, after publish, where sh->par_commit and publish listed chunks with one block each to
 * commit: the candidates, their winners, then the winners into the table (the walk's result, above). */
template <class P>
BLINK_DEV void blink_phase_commit(P &plat, const blink_sched_params_t *p, blink_sched_shared_t *sh, unsigned tid,
                                  unsigned nt) {
    const uint32_t n = p->state->n_chunks;
    const uint32_t *commit = blink_scratch_list(p, BLINK_LIST_COMMIT);
    uint32_t *cand = blink_scratch_list(p, BLINK_LIST_CAND_BITS), *win = blink_scratch_list(p, BLINK_LIST_WIN_BITS);
    uint32_t *cand_block = blink_scratch_list(p, BLINK_LIST_CAND_BLOCK);
    for (uint32_t c = tid; c < n; c += nt) {   /* the candidates: reads only, the table as before the step */
        if (!blink_bit(commit, c)) continue;
        uint32_t b;
        uint64_t k;
        if (!blink_commit_candidate(p, c, &b, &k)) continue;
        cand_block[c] = b;
        blink_list_key_set(p, BLINK_LIST_CAND_KLO, c, k);
        plat.or_bit(cand, c);
    }
    plat.sync();
    for (uint32_t c = tid; c < n; c += nt) {   /* the winners: no earlier candidate with the key */
        if (!blink_bit(cand, c)) continue;
        const uint64_t k = blink_list_key(p, BLINK_LIST_CAND_KLO, c);
        int wins = 1, shared_block = 0;
        for (uint32_t w = 0; w <= c >> 5; ++w) {
            uint32_t bits = cand[w] & (w < c >> 5 ? 0xffffffffu : (1u << (c & 31u)) - 1u);
            for (; bits; bits &= bits - 1) {
                const uint32_t e = w * 32 + blink_ctz32(bits);
                if (blink_list_key(p, BLINK_LIST_CAND_KLO, e) == k) wins = 0;
                else if (cand_block[e] == cand_block[c]) shared_block = 1;
            }
        }
        if (shared_block) plat.add_shared(&sh->commit_serial, 1);
#ifdef BLINK_PLANT_COMMIT_FAULT   /* a test variant of the twin only: a winner whose key an earlier one has */
        if (!wins) wins = 1;
#endif
        if (wins) plat.or_bit(win, c);
    }
    plat.sync();
    if (tid == 0 && !sh->commit_serial && p->state->commit_checked < p->fast_plan_checks) {
        p->state->commit_checked += 1;
        if (!blink_commit_check(p, n)) {
            blink_fast_plan_failed(p);
            sh->commit_serial = 1;
        }
    }
    plat.sync();
    if (sh->commit_serial) return;   /* the same in every thread: written before the barrier above */
    blink_pkv_t *pkv = p->pkv;
    const uint32_t mask = pkv->table_cap - 1;
    uint32_t won = 0;
    for (uint32_t c = tid; c < n; c += nt) {
        if (!blink_bit(commit, c)) continue;
        p->reqs[p->chunk_slot[c]].num_committed += 1;   /* = its full blocks: one to commit, as publish saw */
        if (!blink_bit(win, c)) continue;
        const uint32_t b = cand_block[c];
        const uint64_t k = blink_list_key(p, BLINK_LIST_CAND_KLO, c);
        uint32_t i = (uint32_t)k & mask;
        while (plat.cas32(&pkv->table_block[i], BLINK_KV_NIL, b) != BLINK_KV_NIL) i = (i + 1) & mask;
        pkv->table_key[i] = k;
        pkv->key[b] = k;
        pkv->has_key[b] = 1;
        ++won;
    }
    if (won) plat.add_shared(&sh->commit_won, won);
}

/* A plan's seven lists: the planner's (plan_scratch's first seven), or (`alternate`, for the check
 * of an admission from the survey against the full planner) lists nothing reads in a step that
 * admits: the fill phase's evictions (a fast decode plan's only) and the commit phase's (done for
 * this iteration). An admission writes no decode or preempted entries. */
static inline BLINK_HD void blink_plan_lists(const blink_sched_params_t *p, blink_plan_t *plan, int alternate) {
    plan->prefill_id = blink_scratch_list(p, alternate ? BLINK_LIST_VICTIMS : BLINK_LIST_PREFILL_ID);
    plan->prefill_len = blink_scratch_list(p, alternate ? BLINK_LIST_TOMBS : BLINK_LIST_PREFILL_LEN);
    plan->decode_id = blink_scratch_list(p, BLINK_LIST_DECODE_ID);
    plan->preempted_id = blink_scratch_list(p, BLINK_LIST_PREEMPTED_ID);
    plan->admitted_id = blink_scratch_list(p, alternate ? BLINK_LIST_LEADER : BLINK_LIST_ADMITTED_ID);
    plan->new_blocks_id = blink_scratch_list(p, alternate ? BLINK_LIST_CAND_BLOCK : BLINK_LIST_NEW_BLOCKS_ID);
    plan->new_blocks_n = blink_scratch_list(p, alternate ? BLINK_LIST_CHECK_BLOCK : BLINK_LIST_NEW_BLOCKS_N);
}

/* thread 0: the prefix-cache hit of the first `seats` waiting requests (scheduler._policy_input). */
template <class P>
BLINK_DEV void blink_waiting_hits(P &plat, const blink_sched_params_t *p, uint32_t seats) {
    const blink_sched_state_t *st = p->state;
    for (uint32_t k = 0; k < st->w_count && k < seats; ++k) {
        const uint32_t slot = p->waiting[(st->w_head + k) % p->slot_count];
        blink_prefix_hit(plat, p, slot, &p->reqs[slot]);
    }
}

/* thread 0: drop finished, reap aborted, then plan the next step and launch it. */
template <class P>
BLINK_DEV void blink_phase_schedule(P &plat, const blink_sched_params_t *p, blink_sched_shared_t *sh) {
    blink_sched_state_t *st = p->state;
    blink_sched_control_t *stats = p->stats;
    const uint64_t cap = p->slot_count;
    const uint64_t t0 = plat.now_ns(p);
    sh->launch = sh->par_alloc = 0;
    const uint32_t did_work = st->in_flight || sh->n_arrivals;
    st->in_flight = 0;
    stats->tokens += sh->n_tokens;
    stats->completed += sh->n_completed;
    sh->n_tokens = sh->n_completed = sh->n_arrivals = sh->n_valid = 0;
    const int alloc_ok = blink_par_alloc_ok(p, sh);   /* before the reap, which only adds free blocks */
    const int check = sh->checking, lists = !alloc_ok || check;
    const uint32_t fast_needy = blink_survey_needy(p, sh, lists);   /* before the reap moves positions */

    /* scheduler.update: the blocks the step filled enter the prefix cache (finished requests' too) */
    if (blink_commit_parallel(sh) && !sh->commit_serial) {   /* the commit phase committed them */
        p->pkv->cached += sh->commit_won;
        stats->par_commits += sh->commit_won;
    } else if (p->prefix_caching && sh->commit) {
        /* Only the chunks publish listed (a request's full blocks change only where its chunk was
         * published), in chunk order: the running order the Python scheduler commits in. One GPU
         * thread walking every running request here, at 256 of them, paid a dependent load or two
         * each in every step where some block filled (most steps). */
        blink_each_bit(blink_scratch_list(p, BLINK_LIST_COMMIT), st->n_chunks, [&](uint32_t c) {   /* publish's */
            const uint32_t slot = p->chunk_slot[c];
            blink_commit_blocks(plat, p, slot, &p->reqs[slot]);
        });
    }

    /* engine._reap (waiting, then running) and the finished of the publish phase: walked only where
     * the scan or publish flagged one */
    uint32_t kept = 0;
    for (uint32_t k = 0; sh->reap_waiting && k < st->w_count; ++k) {
        const uint32_t slot = p->waiting[(st->w_head + k) % cap];
        blink_req_t *r = &p->reqs[slot];
        if (r->abort_finish) {
            r->status = BLINK_REQ_FREE;
            blink_complete_slot(plat, p, slot, r->abort_finish, r->abort_error);
            stats->completed += 1;
        } else {
            p->waiting[(st->w_head + kept++) % cap] = slot;
        }
    }
    if (sh->reap_waiting) st->w_count = kept;
    /* the running list the plan reads: p->running, or the survey's kept list until it is settled */
    const uint32_t *running = sh->reap_running && sh->survey ? blink_survey_reap(plat, p, sh) : p->running;
    if (!running) running = p->running;   /* the survey's kept list disagreed with the walk below */
    if (sh->reap_running && running == p->running) {
        kept = 0;
        for (uint32_t i = 0; i < st->n_running; ++i) {
            const uint32_t slot = p->running[i];
            const blink_req_t *r = &p->reqs[slot];
            if (blink_reaped(r)) blink_reap_running(plat, p, slot);
            else p->running[kept++] = slot;
        }
        st->n_running = kept;
    }
    const uint64_t t_reap = plat.now_ns(p);

    blink_plan_t plan;
    const uint32_t mb = p->policy.max_batch_size;
    blink_plan_lists(p, &plan, 0);
    /* scheduler._policy_input: the clock, each waiting request's prefix-cache hit (under FCFS only
     * those a free seat can admit; any of them under the others), the free count less the blocks'
     * extra holders (a preempted sharer frees fewer than the policy would assume; not clamped) */
    blink_sched_rules_t rules = p->rules;
    rules.now_us = (int64_t)(t0 / 1000);
    st->plan_stamp += 1;
    const int64_t free_blocks = (int64_t)blink_pkv_free_count(p->pkv) - (int64_t)p->pkv->extra_refs;
    /* only the waiting requests the plan may admit are looked up: rule 2b stops at the seats, and a
     * hit is looked up again before it is read (FCFS; under the other policies seats == w_count) */
    const uint32_t seats = rules.policy == BLINK_POLICY_FCFS ? mb - st->n_running : st->w_count;
    blink_plan_t fast;
    auto full_plan = [&]() {   /* the full planner under the daemon's policy, into `plan` (the planner's lists) */
        blink_plan_step_policy(&p->policy, &rules, p->reqs, p->times, p->waiting, st->w_head, st->w_count,
                               (uint32_t)cap, running, st->n_running, free_blocks, st->prev_kind, &plan,
                               p->plan_w_out, p->plan_r_out, p->plan_victims, p->plan_lkey, p->plan_lid);
    };
    int planned = 0, looked_up = 0, use_admit = 0, none_admitted = 0;
    if (fast_needy && !st->fast_plan_off && blink_admission_due(p)) {   /* rule 1's PREFILL step */
        /* `running` may still be the survey's kept list: read-only here, and copied back (below) only
         * where the plan is not a fast decode plan, whose fill phase places blocks by the survey's
         * positions (the kept ranks) */
        blink_waiting_hits(plat, p, seats);
        looked_up = 1;
        const int admit_check = st->admit_checked < p->fast_plan_checks;
        blink_plan_lists(p, &fast, admit_check);
        use_admit = blink_fast_admit(p, sh, free_blocks, &fast);
        none_admitted = !use_admit;   /* (a fast decode plan follows: its own check holds this against the full
                                       * planner while it runs; an admission check only sees admissions) */
        if (use_admit && admit_check) {   /* the full planner beside it, read-only until one is applied */
            full_plan();
            st->admit_checked += 1;
            planned = 1;                  /* agreeing, the full plan is the same plan, in the planner's lists */
            if (!blink_admits_agree(&plan, &fast)) {
                blink_fast_plan_failed(p);
                use_admit = 0;
            }
        } else if (use_admit) {
            plan = fast;
            planned = 1;
        }
    }
    int use_fast = !planned && fast_needy && !st->fast_plan_off &&
                   blink_fast_plan(p, sh, running, fast_needy - 1, lists, free_blocks, none_admitted, &fast);
    if (!use_fast) running = blink_running_settle(p, running);   /* the full plan's apply edits p->running */
    if (!planned && (!use_fast || check)) {
        if (!looked_up) blink_waiting_hits(plat, p, seats);
        full_plan();
    }
    if (use_fast && check) {
        st->fast_checked += 1;
        if (!blink_plans_agree(&plan, &fast)) {   /* the full plan stands: its lists, p->running */
            blink_fast_plan_failed(p);
            use_fast = 0;
            running = blink_running_settle(p, running);
        } else {   /* the full plan's lists are gone, as where nothing wrote them */
            for (uint32_t which = BLINK_LIST_PREFILL_ID; which <= BLINK_LIST_NEW_BLOCKS_N; ++which)
                for (uint32_t k = 0; k < mb; ++k) blink_scratch_list(p, which)[k] = 0xffffffffu;
        }
    }
    if (use_fast) plan = fast;
    /* a fast plan's decode chunks: the running list, or the kept list the fill phase copies back */
    sh->step_ids = !use_fast ? BLINK_IDS_PLAN : running == p->running ? BLINK_IDS_RUNNING : BLINK_IDS_KEPT;
    const uint64_t t_policy = plat.now_ns(p);

    if (plan.kind != BLINK_STEP_IDLE && sh->launches >= p->window_limit) {
        /* Window full: nothing was applied, so a fresh instance plans this step again. */
        blink_running_settle(p, running);
        sh->exit = plat.tail_relaunch() == 0 ? BLINK_EXIT_RELAUNCH : BLINK_EXIT_LAUNCH_FAILED;
        return;
    }
    stats->fast_plans += (uint64_t)use_fast;   /* applied (a full window plans it again) */
    stats->fast_admits += (uint64_t)use_admit;
    sh->par_alloc = use_fast && alloc_ok;
    sh->evict = sh->evict_check = 0;
    if (sh->par_alloc) {   /* the needy ones' blocks leave the free stack and the LRU here; blink_fill_block takes them */
        blink_pkv_t *kv = p->pkv;
        sh->alloc_top = kv->never_cached;
        sh->evict_from = sh->sv_need < kv->never_cached ? sh->sv_need : kv->never_cached;
        sh->evict = sh->sv_need - sh->evict_from;
        uint32_t *victims = blink_scratch_list(p, BLINK_LIST_VICTIMS);
        blink_pkv_lru_pop(kv, sh->evict, victims);   /* the LRU's first, in order: one dependent load each */
        sh->evict_check = sh->evict && st->evict_checked < p->fast_plan_checks;
        sh->evict_bad = sh->evict_entries = 0;
        stats->fill_evictions += sh->evict;
        if (check)   /* what blink_pkv_alloc would give them, in order, for the launch phase's check */
            for (uint32_t j = 0; j < sh->sv_needy; ++j)
                blink_scratch_list(p, BLINK_LIST_NEEDY_N)[j] =
                    j < sh->evict_from ? kv->free_stack[sh->alloc_top - 1 - j] : victims[j - sh->evict_from];
        kv->never_cached -= sh->evict_from;
        stats->fill_blocks += sh->sv_need;
        plan.n_new_blocks = 0;
    }

    for (uint32_t v = 0; v < plan.n_preempted; ++v) {        /* engine._preempt */
        const uint32_t slot = plan.preempted_id[v];
        uint32_t i = 0;
        while (p->running[i] != slot) ++i;
        for (; i + 1 < st->n_running; ++i) p->running[i] = p->running[i + 1];
        st->n_running -= 1;
        blink_req_t *r = &p->reqs[slot];
        blink_blocks_release(p, slot, r);   /* its keys stay: readmitted, it looks its blocks up again */
        blink_seat_release(p, r);
        r->num_computed = 0;
        r->status = BLINK_REQ_WAITING;
        if (r->ring_state != BLINK_DECODE_PAUSED) {
            plat.fence_sys();   /* tokens and counts published before, then the state word */
            plat.st32(&blink_slot_ptr(p, slot)->state, BLINK_DECODE_PAUSED);
            r->ring_state = BLINK_DECODE_PAUSED;
        }
        st->w_head = (uint32_t)((st->w_head + cap - 1) % cap);
        p->waiting[st->w_head] = slot;
        st->w_count += 1;
        stats->preempted += 1;
    }
    if (plan.kind == BLINK_STEP_IDLE) {
        if (!did_work && !plan.n_preempted) plat.sleep_ns(p->idle_sleep_ns);
        return;
    }
    const uint32_t bs = p->policy.block_size;
    for (uint32_t k = 0; k < plan.n_admitted; ++k) {          /* scheduler._batch / _admit */
        const uint32_t slot = plan.admitted_id[k];
        uint32_t at = 0;                                       /* FCFS: the front; other policies: anywhere */
        while (at < st->w_count && p->waiting[(st->w_head + at) % cap] != slot) ++at;
        for (uint32_t j = at; j > 0; --j) p->waiting[(st->w_head + j) % cap] = p->waiting[(st->w_head + j - 1) % cap];
        st->w_head = (uint32_t)((st->w_head + 1) % cap);
        st->w_count -= 1;
        blink_req_t *r = &p->reqs[slot];
        const uint32_t hit = r->num_cached / bs;               /* its cached prefix, taken before any allocation */
        blink_pkv_take(p->pkv, blink_table(p, slot), hit);
        r->num_blocks = r->num_committed = hit;
        r->num_computed = hit * bs;
        const uint32_t tokens = blink_req_tokens(r);
        stats->prefix_hit_tokens += r->num_computed;
        stats->prefix_miss_tokens += tokens - r->num_computed;
        stats->prefix_hit_blocks += hit;
        stats->prefix_miss_blocks += (uint32_t)blink_blocks_needed(tokens, bs) - hit;
        p->times[slot].run_us = rules.now_us;
        r->status = BLINK_REQ_RUNNING;
        p->running[st->n_running++] = slot;
        blink_seat_take(p, slot);
    }
    int err = 0;
    for (uint32_t k = 0; k < plan.n_new_blocks; ++k) {        /* at prefill and at block boundaries */
        const uint32_t slot = plan.new_blocks_id[k], need = plan.new_blocks_n[k];
        blink_req_t *r = &p->reqs[slot];
        if (need == 0) continue;
        if (r->num_blocks + need <= p->kv_max_blocks &&
            blink_pkv_alloc(p->pkv, need, blink_table(p, slot) + r->num_blocks) == BLINK_KV_OK)
            r->num_blocks += need;
        else
            err = -1;   /* the policy never asks for more than is free: a bug, so the step's requests fail */
    }
    st->free_blocks = blink_pkv_free_count(p->pkv);
    const uint32_t n = plan.n_prefill + plan.n_decode;
    sh->step_parallel = plan.kind == BLINK_STEP_DECODE && plan.n_prefill == 0;
    if (!sh->step_parallel) {   /* the chunks in plan order; a decode step's are filled by every thread */
        for (uint32_t k = 0; k < n; ++k) {
            const int pre = k < plan.n_prefill;
            const uint32_t slot = pre ? plan.prefill_id[k] : plan.decode_id[k - plan.n_prefill];
            const uint32_t len = pre ? plan.prefill_len[k] : 1u;
            const blink_req_t *r = &p->reqs[slot];
            p->chunk_slot[k] = slot;
            p->chunk_start[k] = r->num_computed;
            p->chunk_len[k] = len;
            p->chunk_sample[k] = r->num_computed + len == blink_req_tokens(r);
        }
    }
    st->n_chunks = n;
    sh->step_kind = plan.kind;
    sh->step_err = err;
    sh->step_ctx = 0;
    sh->t_sched = sh->survey ? sh->t_survey : t0;   /* the survey is the plan's first part */
    sh->t_reap = t_reap;
    sh->t_policy = t_policy;
    sh->t_apply = plat.now_ns(p);
    sh->launch = 1;
}

/* all threads, a decode step (sh->step_parallel): chunk k is request plan.decode_id[k], one token,
 * and row k (decode rows are the chunks: blink_step_key / blink_fill_rows give the same); the
 * longest context by a shared max. One GPU thread walking 64-256 requests here, then again for
 * the key and the rows, cost a dependent global load or two per request each time. */
template <class P>
BLINK_DEV void blink_phase_fill(P &plat, const blink_sched_params_t *p, blink_sched_shared_t *sh, unsigned tid,
                                unsigned nt) {
    const uint32_t n = p->state->n_chunks;
    const uint32_t *decode_id = sh->step_ids == BLINK_IDS_RUNNING ? p->running
                                : blink_scratch_list(p, sh->step_ids == BLINK_IDS_KEPT ? BLINK_LIST_KEPT
                                                                                      : BLINK_LIST_DECODE_ID);
    const int settle = sh->step_ids == BLINK_IDS_KEPT;
    const int rows = p->graphs.shapes != 0 && n <= p->graphs.decode.max_rows;      /* within the row buffers */
    uint32_t ctx = 0;
    for (uint32_t k = tid; k < n; k += nt) {
        const uint32_t slot = decode_id[k];
        if (settle) p->running[k] = slot;   /* the survey's kept list becomes the running list */
        if (sh->par_alloc) blink_fill_block(p, sh, k, slot);
        const blink_req_t *r = &p->reqs[slot];
        const uint32_t start = r->num_computed;
        const uint32_t sample = start + 1 == blink_req_tokens(r);
        p->chunk_slot[k] = slot;
        p->chunk_start[k] = start;
        p->chunk_len[k] = 1;
        p->chunk_sample[k] = sample;
        if (rows) {
            p->row_slot[k] = slot;
            p->row_start[k] = start;
            p->row_len[k] = 1;
            p->row_flags[k] = k | (sample ? BLINK_ROW_SAMPLE : 0u);
        }
        if (start + 1 > ctx) ctx = start + 1;
    }
    if (ctx) plat.max_shared(&sh->step_ctx, ctx);
    if (sh->evict) blink_evict_keys(plat, p, sh, tid, nt);   /* the same in every thread: set before the barrier */
}

/* thread 0: the planned step's graph (key, O(1) lookup, rows), then its launch. */
template <class P>
BLINK_DEV void blink_phase_launch(P &plat, const blink_sched_params_t *p, blink_sched_shared_t *sh) {
    blink_sched_state_t *st = p->state;
    blink_sched_control_t *stats = p->stats;
    const uint32_t kind = sh->step_kind, n = st->n_chunks;
    int err = sh->step_err;
    if (sh->checking && sh->par_alloc)   /* the fill phase's blocks = blink_pkv_alloc's, or no more of them */
        for (uint32_t j = 0; j < sh->sv_needy; ++j) {
            const uint32_t slot = blink_scratch_list(p, BLINK_LIST_NEEDY_ID)[j];
            const blink_req_t *r = &p->reqs[slot];
            const uint32_t want = blink_scratch_list(p, BLINK_LIST_NEEDY_N)[j];
            if (r->num_blocks == 0 || blink_table(p, slot)[r->num_blocks - 1] != want) {
                blink_fast_plan_failed(p);
                break;
            }
        }
    if (sh->evict_check) {   /* the first parallel evictions, whenever they come: the fill phase checked */
        st->evict_checked += 1;
        if (sh->evict_bad || sh->evict_entries != p->pkv->cached) {
            blink_fast_plan_failed(p);
            blink_pkv_table_rebuild(p->pkv);   /* from the blocks' own keys: the cache as the walk leaves it */
        }
    }
    st->step_no += 1;
    st->prev_kind = kind;
    if (kind == BLINK_STEP_PREFILL) stats->steps_prefill += 1;
    else stats->steps_decode += 1;
    /* The step graph: O(1) lookup of the tightest captured shape, then the chunks as its rows. */
    const blink_graph_table_t *g = &p->graphs;
    uint32_t rows = 0, len = 0, ctx = 0, graph = 0;
    if (sh->step_parallel) {   /* blink_step_key of one-token chunks */
        rows = n;
        len = n ? 1u : 0u;
        ctx = sh->step_ctx;
    } else {
        blink_step_key(g, kind, p->chunk_start, p->chunk_len, n, &rows, &len, &ctx);
    }
    graph = blink_graph_lookup(g, kind, rows, len, ctx);
    st->n_rows = 0;
    if (err == 0 && !blink_graph_fits(g, graph, kind, rows, len, ctx)) err = -2;   /* beyond the max shape */
    if (err == 0 && g->shapes != 0) {
        st->n_rows = sh->step_parallel ? n   /* blink_phase_fill wrote them: n fits, as the graph holds n rows */
                                       : blink_fill_rows(g->split_len, p->chunk_slot, p->chunk_start, p->chunk_len,
                                                         p->chunk_sample, n, p->row_slot, p->row_start, p->row_len,
                                                         p->row_flags);
        const blink_graph_lut_t *t = kind == BLINK_STEP_DECODE ? &g->decode : &g->prefill;
        if (graph == t->fallback) stats->fallback_steps += 1;
    }
    st->graph = graph;
    const uint64_t t_rows = plat.now_ns(p);
    blink_home_state(p);   /* shared_state: the step graph reads n_rows, n_chunks and step_no in device memory */
    plat.fence_dev();   /* the step descriptor, rows, block tables and request copies before the child graph that reads them */
    const uint64_t t_launch = plat.now_ns(p);
    for (uint32_t tries = 0; err == 0; ++tries) {   /* err != 0 here: the step failed before its launch */
        sh->launches += 1;   /* every attempt counts toward the cap, refused ones included */
        const int rc = plat.launch_step(p, graph * BLINK_STEP_GRAPHS + st->step_no % BLINK_STEP_GRAPHS);
        if (rc == 0) break;
        stats->launch_retries += 1;
        stats->last_launch_error = rc;
        if (tries >= p->launch_retry_limit || sh->launches >= BLINK_DEVICE_LAUNCH_CAP) {
            err = rc;   /* refused for good: the step's requests fail below */
            break;
        }
        plat.sleep_ns(200u << (tries < 9 ? tries : 9));   /* that graph's previous launch is still winding down */
    }
    if (sh->launches > stats->max_window_launches) stats->max_window_launches = sh->launches;
    const uint64_t now = plat.now_ns(p);
    stats->launch_ns += now - t_launch;
    stats->plan_ns += now - sh->t_sched;
    stats->reap_ns += sh->t_reap - sh->t_sched;
    stats->policy_ns += sh->t_policy - sh->t_reap;
    stats->apply_ns += sh->t_apply - sh->t_policy;
    stats->rows_ns += t_rows - sh->t_apply;
    if (err != 0) {   /* engine.step: a failed step ends its requests ERROR/INTERNAL */
        for (uint32_t c = 0; c < n; ++c) p->reqs[p->chunk_slot[c]].status = BLINK_REQ_FINISHED;
        uint32_t kept = 0;
        for (uint32_t i = 0; i < st->n_running; ++i) {   /* dropped now: the next scan may reuse the slots */
            const uint32_t slot = p->running[i];
            blink_req_t *r = &p->reqs[slot];
            if (r->status != BLINK_REQ_FINISHED) {
                p->running[kept++] = slot;
                continue;
            }
            blink_blocks_release(p, slot, r);
            blink_seat_release(p, r);
            r->status = BLINK_REQ_FREE;
            blink_complete_slot(plat, p, slot, BLINK_FINISH_ERROR, BLINK_ERR_INTERNAL);
            stats->completed += 1;
        }
        st->n_running = kept;
        return;
    }
    stats->launches += 1;
    st->in_flight = 1;
    st->step_launched_ns = now;
}

/* One scheduler instance: runs until shutdown or until its launch window is
 * full (it then tail-launches its successor). Every thread of the block calls
 * it; returns the BLINK_EXIT_* code. */
template <class P>
BLINK_DEV uint32_t blink_sched_run(P &plat, const blink_sched_params_t *p, blink_sched_shared_t *sh, unsigned tid,
                                   unsigned nt) {
    if (tid == 0) {
        blink_sched_state_t *st = p->state;
        if (!st->started) {
            st->w_head = st->w_count = st->n_running = 0;
            blink_pkv_setup(p);
            st->plan_stamp = 0;
            for (uint32_t i = 0; i < p->n_seats; ++i) p->seat_owner[i] = 0;
            st->prev_kind = BLINK_STEP_IDLE;
            st->in_flight = 0;
            st->started = 1;
        }
        sh->exit = 0;
        sh->launches = sh->n_arrivals = sh->n_valid = sh->n_tokens = sh->n_completed = 0;
        p->stats->windows += 1;
        plat.st32(&p->control->running, 1);
    }
    plat.sync();
    for (;;) {
        /* Every thread has read the previous iteration's exit flag before thread 0 may write it again. */
        plat.sync();
        if (tid == 0) {
            sh->reap_waiting = sh->reap_running = sh->commit = sh->keys_ns = 0;
            sh->commit_multi = sh->commit_serial = sh->commit_won = 0;
            blink_phase_control(plat, p, sh);
        }
        plat.sync();
        if (sh->exit) break;
        if (sh->scan) {   /* the same value in every thread: written before the barrier above */
            const uint64_t t_scan = tid == 0 ? plat.now_ns(p) : 0;
            blink_phase_scan(plat, p, sh, tid, nt);
            plat.sync();
            if (tid == 0) {
                p->stats->scan_ns += plat.now_ns(p) - t_scan;
                p->stats->scans += 1;
            }
        }
        blink_phase_intake(plat, p, sh, tid, nt);
        plat.sync();
        if (tid == 0) {
            blink_phase_wait(plat, p, sh);
            blink_survey_decide(p, sh);
            /* publish's bitmap of chunks to commit, and the commit phase's */
            uint32_t *commit = blink_scratch_list(p, BLINK_LIST_COMMIT), *cand = blink_scratch_list(p, BLINK_LIST_CAND_BITS),
                     *win = blink_scratch_list(p, BLINK_LIST_WIN_BITS);
            for (uint32_t w = 0; p->prefix_caching && w < (p->state->n_chunks + 31) / 32; ++w) commit[w] = cand[w] = win[w] = 0;
            sh->par_commit = p->prefix_caching && p->fast_plan && !p->state->fast_plan_off;
        }
        plat.sync();
        if (sh->exit) break;
        uint64_t t_pub = tid == 0 ? plat.now_ns(p) : 0;
        blink_phase_publish(plat, p, sh, tid, nt);
        plat.sync();
        if (tid == 0) p->stats->pub_keys_ns += sh->keys_ns;
        if (blink_commit_parallel(sh)) {   /* the same value in every thread: written before the barrier above */
            const uint64_t t_commit = tid == 0 ? plat.now_ns(p) : 0;
            if (tid == 0) p->stats->publish_ns += t_commit - t_pub;
            blink_phase_commit(plat, p, sh, tid, nt);
            plat.sync();
            if (tid == 0) {
                t_pub = plat.now_ns(p);   /* publish_ns goes on from here (the survey's start, or the end) */
                p->stats->commit_ns += t_pub - t_commit;
            }
        }
        if (sh->survey) {   /* the same value in every thread: written before the barrier above */
            if (tid == 0) {
                sh->t_survey = plat.now_ns(p);
                p->stats->publish_ns += sh->t_survey - t_pub;
            }
            blink_phase_survey(plat, p, sh, tid, nt);
            plat.sync();
        } else if (tid == 0) {
            p->stats->publish_ns += plat.now_ns(p) - t_pub;
        }
        if (tid == 0) blink_phase_schedule(plat, p, sh);
        plat.sync();
        if (sh->exit) break;
        if (sh->launch) {   /* the loop's first barrier orders the launch phase before the next iteration */
            if (sh->step_parallel) {
                blink_phase_fill(plat, p, sh, tid, nt);
                plat.sync();
            }
            if (tid == 0) blink_phase_launch(plat, p, sh);
        }
    }
    if (tid == 0) {
        p->stats->exit_code = sh->exit;
        blink_beat(plat, p, plat.now_ns(p));
        plat.st32(&p->control->exit_code, sh->exit);
        plat.fence_sys();   /* every ring completion and counter before the host sees the scheduler gone */
        if (sh->exit != BLINK_EXIT_RELAUNCH) plat.st32(&p->control->running, 0);
    }
    return sh->exit;
}

#endif /* BLINK_SCHED_LOOP_H */
