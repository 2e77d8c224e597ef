/* The scheduler's CPU twin and the ctypes shim around the decision core,
 * built with g++ into a shared library (gpu_backend/cuda/build.py) so that CI
 * machines without a GPU run the very code the kernel runs:
 *
 *   blink_plan / blink_finish / blink_intake_check   sched_policy.h, one call each (blink_plan:
 *       FCFS through blink_plan_step, or any policy through blink_plan_step_policy)
 *       -> tests diff them against gpu_backend/scheduler/policy.py and scheduler/intake.py
 *   blink_twin_run   sched_loop.h on `nt` host threads with a barrier standing in
 *       for __syncthreads; the step graph is the echo run inline (or a callback
 *       that launches it on a GPU: the host-driven baseline of the benchmark);
 *       a full launch window returns to the driver loop, which starts a fresh
 *       instance as the device's tail launch does. Its platform has no
 *       read-modify-write on ring words at all (as on the device), and counts
 *       any shared-counter atomic that lands inside the ring or the host
 *       control block (blink_twin_ring_rmw: must stay 0).
 *   blink_automaton_*_c   automaton.h (structured outputs: intake checks, a state's mask, a
 *       step), for the diff test against shared_layout.automaton and logits_processors
 *   blink_kv_*_c      kv_alloc.h, for the diff test against kv_cache.BlockAllocator
 *   blink_pkv_*_c, blink_block_hash_c   kv_alloc.h's prefix-caching allocator and key
 *       chain, for the diff test against kv_cache.BlockAllocator and block_hash
 *   blink_graph_*_c   graph_table.h (step key, O(1) lookup, rows), for the diff
 *       test against gpu_backend/graphs/buckets.py
 *   blink_twin_stage / blink_twin_finish   model_step.h on the CPU: the model step
 *       graph's first and last kernels, around the PyTorch forward run eagerly
 *       (the CPU twin of the captured graph, gpu_backend/graphs/cpu_graphs.py)
 *   blink_struct_size / blink_struct_offset   layout of sched_types.h for the
 *       ctypes mirror's test
 */
#include <pthread.h>
#include <string.h>
#include <time.h>

#include <thread>
#include <vector>

#include "model_step.h"
#include "sched_loop.h"

typedef int (*blink_launch_cb)(void *ctx, uint32_t which);

static uint64_t g_ring_rmw;           /* atomics that hit ring or control memory (a protocol bug) */

struct blink_twin_block {              /* what the host threads of one instance share */
    pthread_barrier_t barrier;
    uintptr_t ring_lo, ring_hi;        /* the ring's bytes: loads and stores only, never an RMW */
    uintptr_t ctl_lo, ctl_hi;          /* the host-mapped control block: likewise */
    int or_flags[3];
    blink_sched_shared_t sh;
    blink_sched_local_t loc;           /* shared_state: the instance's copies (blink_local_params) */
    blink_launch_cb cb;
    void *cb_ctx;
};

struct blink_host_platform {
    blink_twin_block *blk;
    unsigned tid;
    unsigned or_calls;

    uint32_t ld32(const void *p) const { return __atomic_load_n((const uint32_t *)p, __ATOMIC_ACQUIRE); }
    uint64_t ld64(const void *p) const { return __atomic_load_n((const uint64_t *)p, __ATOMIC_ACQUIRE); }
    void st32(void *p, uint32_t v) const { __atomic_store_n((uint32_t *)p, v, __ATOMIC_RELEASE); }
    void st64(void *p, uint64_t v) const { __atomic_store_n((uint64_t *)p, v, __ATOMIC_RELEASE); }
#ifndef BLINK_PLANT_PLAIN_BLK
    uint32_t ld_blk32(const uint32_t *p) const { return __atomic_load_n(p, __ATOMIC_RELAXED); }
    void st_blk32(uint32_t *p, uint32_t v) const { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
#else   /* a test variant only: plain accesses, the data race tests/.../test_twin_sanitizers.py must find */
    uint32_t ld_blk32(const uint32_t *p) const { return *p; }   /* (GCC's TSan skips volatile accesses) */
    void st_blk32(uint32_t *p, uint32_t v) const { *p = v; }
#endif
    uint32_t ld_acq32(const uint32_t *p) const { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
    void fence_sys() const { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
    void fence_dev() const { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
    /* The one atomic of the loop: the block's shared counters. One that lands in the ring or the
     * control block would be a cross-boundary atomic, which the device cannot do: counted. */
    uint32_t add_shared(uint32_t *p, uint32_t v) const {
        const uintptr_t a = (uintptr_t)p;
        if (blk && ((a >= blk->ring_lo && a < blk->ring_hi) || (a >= blk->ctl_lo && a < blk->ctl_hi)))
            __atomic_fetch_add(&g_ring_rmw, 1, __ATOMIC_RELAXED);
        return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
    }
    uint32_t max_shared(uint32_t *p, uint32_t v) const {
        const uintptr_t a = (uintptr_t)p;
        if (blk && ((a >= blk->ring_lo && a < blk->ring_hi) || (a >= blk->ctl_lo && a < blk->ctl_hi)))
            __atomic_fetch_add(&g_ring_rmw, 1, __ATOMIC_RELAXED);
        uint32_t old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
        while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
        }
        return old;
    }
    /* The scheduler's own bitmaps: never the ring or the control block (counted, as above). */
    void or_bit(uint32_t *words, uint32_t i) const {
        const uintptr_t a = (uintptr_t)&words[i >> 5];
        if (blk && ((a >= blk->ring_lo && a < blk->ring_hi) || (a >= blk->ctl_lo && a < blk->ctl_hi)))
            __atomic_fetch_add(&g_ring_rmw, 1, __ATOMIC_RELAXED);
        __atomic_fetch_or(&words[i >> 5], 1u << (i & 31u), __ATOMIC_SEQ_CST);
    }
    /* The warp vote's effect on words the caller zeroed (host threads are no warp, so the
     * device's whole-word stores, and their bound n, have no twin here). */
    /* Compare-and-swap of a word of the scheduler's own device memory (the prefix cache's table),
     * among its threads: the old value (counted, as above, if it were the ring's). */
    uint32_t cas32(uint32_t *w, uint32_t expect, uint32_t v) const {
        const uintptr_t a = (uintptr_t)w;
        if (blk && ((a >= blk->ring_lo && a < blk->ring_hi) || (a >= blk->ctl_lo && a < blk->ctl_hi)))
            __atomic_fetch_add(&g_ring_rmw, 1, __ATOMIC_RELAXED);
        __atomic_compare_exchange_n(w, &expect, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
        return expect;
    }
    void ballot_bit(uint32_t *words, uint32_t i, int pred, uint32_t n) const {
        if (pred && i < n) __atomic_fetch_or(&words[i >> 5], 1u << (i & 31u), __ATOMIC_SEQ_CST);
    }
    void sync() const { pthread_barrier_wait(&blk->barrier); }
    /* __syncthreads_or: three flags in rotation, so the one reset here was last read two calls ago. */
    int sync_or(int v) {
        const unsigned k = or_calls++ % 3;
        if (v) __atomic_fetch_or(&blk->or_flags[k], 1, __ATOMIC_SEQ_CST);
        sync();
        const int r = __atomic_load_n(&blk->or_flags[k], __ATOMIC_SEQ_CST);
        if (tid == 0) __atomic_store_n(&blk->or_flags[(k + 2) % 3], 0, __ATOMIC_SEQ_CST);
        return r;
    }
    uint64_t now_ns(const blink_sched_params_t *) const {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    }
    void sleep_ns(uint32_t ns) const {
        if (!ns) return;
        struct timespec ts = {0, (long)ns};
        nanosleep(&ts, nullptr);
    }
    int launch_step(const blink_sched_params_t *p, uint32_t which) {
        if (blk->cb) return blk->cb(blk->cb_ctx, which);
        /* the stand-in graph, inline on this thread, reading the params in device memory as the graph
         * does (shared_state: the loop's own copy is not what a step sees; blink_home_state) */
        const blink_sched_params_t *g = p->home ? p->home : p;
        blink_echo_chunks(*this, g, 0, 1);
        fence_dev();
        st32(g->done, g->state->step_no);
        return 0;
    }
    int tail_relaunch() const { return 0; }   /* the driver loop starts the next instance */
};

extern "C" {

uint32_t blink_twin_run(const blink_sched_params_t *p, unsigned nt, blink_launch_cb cb, void *cb_ctx) {
    if (nt == 0) nt = 1;
    for (;;) {
        blink_twin_block blk;
        memset(&blk, 0, sizeof blk);
        blk.cb = cb;
        blk.cb_ctx = cb_ctx;
        blk.ring_lo = (uintptr_t)p->ring;
        blk.ring_hi = blk.ring_lo + p->output_arena_offset + 4 * p->output_arena_tokens;
        blk.ctl_lo = (uintptr_t)p->control;
        blk.ctl_hi = blk.ctl_lo + sizeof(blink_sched_control_t);
        pthread_barrier_init(&blk.barrier, nullptr, nt);
        std::vector<std::thread> threads;
        for (unsigned t = 1; t < nt; ++t)
            threads.emplace_back([&blk, p, t, nt] {
                blink_host_platform plat{&blk, t, 0};
                blink_sched_run(plat, blink_local_params(plat, p, &blk.loc, t, nt), &blk.sh, t, nt);
            });
        blink_host_platform plat{&blk, 0, 0};
        const uint32_t code = blink_sched_run(plat, blink_local_params(plat, p, &blk.loc, 0, nt), &blk.sh, 0, nt);
        for (auto &th : threads) th.join();
        pthread_barrier_destroy(&blk.barrier);
        if (code != BLINK_EXIT_RELAUNCH) return code;
    }
}

/* The window limits of sched_types.h, for the test of config.py's mirror. */
uint32_t blink_device_launch_cap(void) { return BLINK_DEVICE_LAUNCH_CAP; }
uint32_t blink_max_window(void) { return BLINK_MAX_WINDOW; }
/* plan_scratch's list count (sched_loop.h), for structs.SCRATCH_LISTS, which sizes the buffer. */
uint32_t blink_scratch_lists(void) { return BLINK_SCRATCH_LISTS; }

/* Atomics that hit ring or control memory since the library was loaded (0: none). */
uint64_t blink_twin_ring_rmw(void) { return __atomic_load_n(&g_ring_rmw, __ATOMIC_RELAXED); }

/* One plan_step over explicit lists; ids are indices into `reqs` (the caller's table), and
 * into `times` under a policy other than FCFS (rules == NULL: FCFS through blink_plan_step). */
void blink_plan(const blink_policy_config_t *cfg, const blink_req_t *reqs, const uint32_t *waiting,
                uint32_t n_waiting, const uint32_t *running, uint32_t n_running, int64_t free_blocks,
                uint32_t prev_kind, uint32_t *counts /* [6]: kind, n_prefill, n_decode, n_preempted,
                                                        n_admitted, n_new_blocks */,
                uint32_t *lists /* [7 * cap] */, uint32_t cap, const blink_sched_rules_t *rules,
                const blink_req_time_t *times) {
    blink_plan_t plan;
    plan.prefill_id = lists;
    plan.prefill_len = lists + cap;
    plan.decode_id = lists + 2 * cap;
    plan.preempted_id = lists + 3 * cap;
    plan.admitted_id = lists + 4 * cap;
    plan.new_blocks_id = lists + 5 * cap;
    plan.new_blocks_n = lists + 6 * cap;
    if (rules == NULL) {
        blink_plan_step(cfg, reqs, waiting, 0, n_waiting, n_waiting ? n_waiting : 1, running, n_running,
                        free_blocks, prev_kind, &plan);
    } else {
        std::vector<uint32_t> w_out(n_waiting + 1), r_out(n_running + 1), victims(n_running + 1),
            lid(n_waiting + n_running + 1);
        std::vector<int64_t> lkey(n_waiting + n_running + 1);
        blink_plan_step_policy(cfg, rules, reqs, times, waiting, 0, n_waiting, n_waiting ? n_waiting : 1, running,
                               n_running, free_blocks, prev_kind, &plan, w_out.data(), r_out.data(), victims.data(),
                               lkey.data(), lid.data());
    }
    counts[0] = plan.kind;
    counts[1] = plan.n_prefill;
    counts[2] = plan.n_decode;
    counts[3] = plan.n_preempted;
    counts[4] = plan.n_admitted;
    counts[5] = plan.n_new_blocks;
}

uint32_t blink_finish(const blink_policy_config_t *cfg, const blink_req_t *r, int32_t token) {
    return blink_finish_reason(cfg, r, token);
}

uint32_t blink_intake(const blink_policy_config_t *cfg, uint64_t prompt_arena_tokens, uint64_t output_arena_tokens,
                      uint64_t logprob_arena_words, uint64_t frontend_epoch, const blink_slot_t *s) {
    return blink_intake_check(cfg, prompt_arena_tokens, output_arena_tokens, logprob_arena_words, frontend_epoch, s);
}

uint32_t blink_unsupported(const blink_slot_t *s, uint32_t n_seats) { return blink_device_unsupported(s, n_seats); }

/* blink_extra_ok over words in host memory (the diff test against shared_layout.extra.decode_extra). */
int blink_extra_check(const int32_t *w, uint32_t vocab, uint32_t n_logit_bias, uint32_t n_allowed_ids,
                      uint32_t bad_words_words) {
    return blink_extra_ok([w](uint32_t i) { return (uint32_t)w[i]; }, vocab, n_logit_bias, n_allowed_ids,
                          bad_words_words);
}

/* automaton.h over words in host memory (the diff test against shared_layout.automaton and
 * logits_processors): the intake's checks (1: acceptable), one state's mask, one step. */
int blink_automaton_check_c(const int32_t *w, uint32_t n_words, uint32_t vocab) {
    auto ld = [w](uint32_t i) { return (uint32_t)w[i]; };
    if (!blink_automaton_header_ok(ld, n_words)) return 0;
    const blink_automaton_view_t a = blink_automaton_view(ld);
    for (uint32_t s = 0; s < a.n_states; ++s)
        if (!blink_automaton_state_ok(ld, &a, s, vocab)) return 0;
    return 1;
}
void blink_automaton_mask_c(const int32_t *w, int32_t state, const int32_t *stops, uint32_t n_stops, uint32_t vocab,
                            uint8_t *allowed) {
    auto ld = [w](uint32_t i) { return (uint32_t)w[i]; };
    const blink_automaton_view_t a = blink_automaton_view(ld);
    blink_automaton_mask(ld, &a, blink_automaton_current(&a, state), stops, n_stops, vocab, allowed);
}
int32_t blink_automaton_advance_c(const int32_t *w, int32_t state, int32_t token) {
    auto ld = [w](uint32_t i) { return (uint32_t)w[i]; };
    const blink_automaton_view_t a = blink_automaton_view(ld);
    return blink_automaton_advance(ld, &a, state, token);
}

/* kv_alloc.h's prefix-caching allocator, one call each (the diff test against kv_cache.BlockAllocator). */
void blink_pkv_init_c(blink_pkv_t *p) { blink_pkv_init(p); }
int blink_pkv_alloc_c(blink_pkv_t *p, uint32_t n, uint32_t *out) { return blink_pkv_alloc(p, n, out); }
int blink_pkv_share_c(blink_pkv_t *p, const uint32_t *b, uint32_t n) { return blink_pkv_share(p, b, n); }
int blink_pkv_free_c(blink_pkv_t *p, const uint32_t *b, uint32_t n) { return blink_pkv_free(p, b, n); }
uint32_t blink_pkv_lookup_c(const blink_pkv_t *p, const uint64_t *k, uint32_t n, uint32_t *out) {
    return blink_pkv_lookup(p, k, n, out);
}
int blink_pkv_take_c(blink_pkv_t *p, const uint32_t *b, uint32_t n) { return blink_pkv_take(p, b, n); }
int blink_pkv_commit_c(blink_pkv_t *p, uint32_t b, uint64_t k) { return blink_pkv_commit(p, b, k); }
void blink_pkv_lru_pop_c(blink_pkv_t *p, uint32_t n, uint32_t *out) { blink_pkv_lru_pop(p, n, out); }
void blink_pkv_table_del_c(blink_pkv_t *p, uint64_t k) { blink_pkv_table_del(p, k); }
int blink_pkv_table_check_c(const blink_pkv_t *p) { return blink_pkv_table_check(p); }
void blink_pkv_table_rebuild_c(blink_pkv_t *p) { blink_pkv_table_rebuild(p); }
uint64_t blink_block_hash_c(uint64_t parent, const int32_t *t, uint32_t n) { return blink_block_hash(parent, t, n); }

int blink_kv_init_c(const blink_kv_t *kv, uint32_t *free_count) {
    blink_kv_init(kv, free_count);
    return 0;
}
int blink_kv_alloc_c(const blink_kv_t *kv, uint32_t *free_count, uint32_t row, uint32_t held, uint32_t n) {
    return blink_kv_alloc(kv, free_count, row, held, n);
}
int blink_kv_free_c(const blink_kv_t *kv, uint32_t *free_count, uint32_t row, uint32_t held) {
    return blink_kv_free(kv, free_count, row, held);
}
int blink_kv_check_c(const blink_kv_t *kv, uint32_t free_count) {
    std::vector<uint32_t> scratch(kv->num_blocks + 1);
    return blink_kv_check(kv, free_count, scratch.data());
}

uint32_t blink_graph_lookup_c(const blink_graph_table_t *g, uint32_t kind, uint32_t rows, uint32_t len, uint32_t ctx) {
    return blink_graph_lookup(g, kind, rows, len, ctx);
}
int blink_graph_fits_c(const blink_graph_table_t *g, uint32_t id, uint32_t kind, uint32_t rows, uint32_t len,
                       uint32_t ctx) {
    return blink_graph_fits(g, id, kind, rows, len, ctx);
}
void blink_step_key_c(const blink_graph_table_t *g, uint32_t kind, const uint32_t *start, const uint32_t *len,
                      uint32_t n, uint32_t *out /* [3] rows, len, ctx */) {
    blink_step_key(g, kind, start, len, n, &out[0], &out[1], &out[2]);
}
uint32_t blink_fill_rows_c(uint32_t piece, const uint32_t *slot, const uint32_t *start, const uint32_t *len,
                           const uint32_t *sample, uint32_t n, uint32_t *row_slot, uint32_t *row_start,
                           uint32_t *row_len, uint32_t *row_flags) {
    return blink_fill_rows(piece, slot, start, len, sample, n, row_slot, row_start, row_len, row_flags);
}

/* The model step graph's first kernel, every row of a (R, S, C) graph on this thread. */
void blink_twin_stage(const blink_sched_params_t *p, const blink_step_io_t *io, uint32_t R, uint32_t S, uint32_t C) {
    blink_host_platform plat{nullptr, 0, 0};
    for (uint32_t r = 0; r < R; ++r) blink_stage_row(plat, p, io, S, C, r, 0, 1);
}

/* Its last kernel: tokens to the chunks, then the done flag. */
void blink_twin_finish(const blink_sched_params_t *p, const blink_step_io_t *io) {
    blink_host_platform plat{nullptr, 0, 0};
    blink_finish_rows(plat, p, io, 0, 1);
    plat.fence_dev();   /* every chunk's token before the flag the scheduler polls */
    plat.st32(p->done, p->state->step_no);
}

/* Layout of sched_types.h, for the test of the ctypes mirror. */
#define BLINK_FIELDS(X)                                                                                     \
    X(blink_policy_config_t, max_batch_size) X(blink_policy_config_t, max_prefill_tokens)                   \
    X(blink_policy_config_t, block_size) X(blink_policy_config_t, num_blocks)                               \
    X(blink_policy_config_t, max_model_len) X(blink_policy_config_t, vocab_size)                            \
    X(blink_policy_config_t, n_eos) X(blink_policy_config_t, eos_ids) X(blink_policy_config_t, reserved)                                       \
    X(blink_req_t, seq) X(blink_req_t, epoch) X(blink_req_t, prompt_offset) X(blink_req_t, prompt_len)      \
    X(blink_req_t, output_offset) X(blink_req_t, max_tokens) X(blink_req_t, flags) X(blink_req_t, n_stop)   \
    X(blink_req_t, stop_ids) X(blink_req_t, generated) X(blink_req_t, num_computed)                         \
    X(blink_req_t, num_blocks) X(blink_req_t, status) X(blink_req_t, ring_state)                            \
    X(blink_req_t, abort_finish) X(blink_req_t, abort_error) X(blink_req_t, intake_error)                   \
    X(blink_req_t, temperature) X(blink_req_t, top_p) X(blink_req_t, top_k) X(blink_req_t, reserved)         \
    X(blink_req_t, seed) X(blink_req_t, min_p) X(blink_req_t, presence_penalty)                             \
    X(blink_req_t, frequency_penalty) X(blink_req_t, repetition_penalty) X(blink_req_t, min_tokens)         \
    X(blink_req_t, n_mask_stops) X(blink_req_t, mask_stops) X(blink_req_t, logprobs)                        \
    X(blink_req_t, logprobs_offset) X(blink_req_t, seat) X(blink_req_t, seat_fresh)                         \
    X(blink_req_t, extra_offset) X(blink_req_t, n_logit_bias) X(blink_req_t, n_allowed_ids)                 \
    X(blink_req_t, bad_words_words) X(blink_req_t, automaton_words) X(blink_req_t, automaton_offset)        \
    X(blink_req_t, automaton_state) X(blink_req_t, reserved2) X(blink_req_t, num_cached)                    \
    X(blink_req_t, cached_idle) X(blink_req_t, num_committed) X(blink_req_t, n_keys)                        \
    X(blink_req_t, key_pos) X(blink_req_t, reserved3) X(blink_req_t, key_run)                              \
    X(blink_sched_state_t, w_head) X(blink_sched_state_t, w_count) X(blink_sched_state_t, n_running)        \
    X(blink_sched_state_t, free_blocks) X(blink_sched_state_t, prev_kind) X(blink_sched_state_t, in_flight) \
    X(blink_sched_state_t, step_no) X(blink_sched_state_t, n_chunks) X(blink_sched_state_t, draining)       \
    X(blink_sched_state_t, started) X(blink_sched_state_t, n_rows) X(blink_sched_state_t, graph)            \
    X(blink_sched_state_t, drain_deadline_ns)                                                               \
    X(blink_sched_state_t, last_beat_ns) X(blink_sched_state_t, step_launched_ns)                           \
    X(blink_sched_state_t, plan_stamp) X(blink_sched_state_t, scan_valid)                                   \
    X(blink_sched_state_t, scan_bell) X(blink_sched_state_t, scan_epoch) X(blink_sched_state_t, scan_ns)    \
    X(blink_sched_state_t, fast_checked) X(blink_sched_state_t, fast_plan_off)                              \
    X(blink_sched_state_t, commit_checked) X(blink_sched_state_t, evict_checked)                            \
    X(blink_sched_state_t, admit_checked) X(blink_sched_state_t, reserved_state)                            \
    X(blink_sched_control_t, stop) X(blink_sched_control_t, abort) X(blink_sched_control_t, running)        \
    X(blink_sched_control_t, exit_code) X(blink_sched_control_t, heartbeat)                                 \
    X(blink_sched_control_t, iterations) X(blink_sched_control_t, windows)                                  \
    X(blink_sched_control_t, launches) X(blink_sched_control_t, launch_retries)                             \
    X(blink_sched_control_t, steps_prefill) X(blink_sched_control_t, steps_decode)                          \
    X(blink_sched_control_t, tokens) X(blink_sched_control_t, claimed) X(blink_sched_control_t, completed)  \
    X(blink_sched_control_t, preempted) X(blink_sched_control_t, scan_ns) X(blink_sched_control_t, scans)   \
    X(blink_sched_control_t, wait_ns) X(blink_sched_control_t, publish_ns)                                  \
    X(blink_sched_control_t, plan_ns) X(blink_sched_control_t, launch_ns)                                   \
    X(blink_sched_control_t, fallback_steps) X(blink_sched_control_t, prefix_hit_tokens)                    \
    X(blink_sched_control_t, prefix_miss_tokens) X(blink_sched_control_t, prefix_hit_blocks)                \
    X(blink_sched_control_t, prefix_miss_blocks) X(blink_sched_control_t, reap_ns)                          \
    X(blink_sched_control_t, policy_ns) X(blink_sched_control_t, apply_ns) X(blink_sched_control_t, rows_ns) \
    X(blink_sched_control_t, fast_plans) X(blink_sched_control_t, fast_plan_mismatches)                     \
    X(blink_sched_control_t, fill_blocks) X(blink_sched_control_t, par_commits)                            \
    X(blink_sched_control_t, commit_ns) X(blink_sched_control_t, fill_evictions)                            \
    X(blink_sched_control_t, fast_admits)                                                                     \
    X(blink_sched_control_t, pub_keys_ns)                                                                     \
    X(blink_sched_control_t, last_launch_error) X(blink_sched_control_t, max_window_launches)              \
    X(blink_sched_params_t, ring) X(blink_sched_params_t, slot_count)                                       \
    X(blink_sched_params_t, prompt_arena_tokens) X(blink_sched_params_t, output_arena_tokens)               \
    X(blink_sched_params_t, slots_offset) X(blink_sched_params_t, prompt_arena_offset)                      \
    X(blink_sched_params_t, output_arena_offset) X(blink_sched_params_t, logprob_arena_offset)              \
    X(blink_sched_params_t, logprob_arena_words) X(blink_sched_params_t, reqs)                              \
    X(blink_sched_params_t, waiting) X(blink_sched_params_t, running) X(blink_sched_params_t, arrivals)     \
    X(blink_sched_params_t, chunk_slot) X(blink_sched_params_t, chunk_start)                                \
    X(blink_sched_params_t, chunk_len) X(blink_sched_params_t, chunk_sample)                                \
    X(blink_sched_params_t, step_tokens) X(blink_sched_params_t, done) X(blink_sched_params_t, plan_scratch) \
    X(blink_sched_params_t, row_slot) X(blink_sched_params_t, row_start) X(blink_sched_params_t, row_len)   \
    X(blink_sched_params_t, row_flags) X(blink_sched_params_t, kv_free_stack)                               \
    X(blink_sched_params_t, kv_owner) X(blink_sched_params_t, kv_tables) X(blink_sched_params_t, seat_owner) \
    X(blink_sched_params_t, state) X(blink_sched_params_t, control) X(blink_sched_params_t, stats)          \
    X(blink_sched_params_t, graphs) X(blink_sched_params_t, policy)                                         \
    X(blink_sched_params_t, window_limit) X(blink_sched_params_t, n_seats)                                \
    X(blink_sched_params_t, idle_sleep_ns) X(blink_sched_params_t, launch_retry_limit)                      \
    X(blink_sched_params_t, kv_max_blocks) X(blink_sched_params_t, full_scan_us)                            \
    X(blink_sched_params_t, beat_interval_ns) X(blink_sched_params_t, grace_ns)                             \
    X(blink_sched_params_t, step_timeout_ns) X(blink_sched_params_t, clock_offset_ns)                       \
    X(blink_sched_params_t, rules) X(blink_sched_params_t, times) X(blink_sched_params_t, plan_w_out)       \
    X(blink_sched_params_t, plan_r_out) X(blink_sched_params_t, plan_victims) X(blink_sched_params_t, plan_lid) \
    X(blink_sched_params_t, plan_lkey) X(blink_sched_params_t, pkv) X(blink_sched_params_t, pkv_refs)       \
    X(blink_sched_params_t, pkv_key) X(blink_sched_params_t, pkv_has_key) X(blink_sched_params_t, pkv_lru_prev) \
    X(blink_sched_params_t, pkv_lru_next) X(blink_sched_params_t, pkv_table_key)                            \
    X(blink_sched_params_t, pkv_table_block) X(blink_sched_params_t, pkv_claimed) X(blink_sched_params_t, kv_keys) \
    X(blink_sched_params_t, pkv_table_cap) X(blink_sched_params_t, prefix_caching)                          \
    X(blink_sched_params_t, ttft_slo_us) X(blink_sched_params_t, tbt_slo_us)                                \
    X(blink_sched_params_t, fast_plan) X(blink_sched_params_t, fast_plan_checks)                            \
    X(blink_sched_params_t, shared_state) X(blink_sched_params_t, reserved_params0) X(blink_sched_params_t, home) \
    X(blink_sched_rules_t, policy) X(blink_sched_rules_t, lvf_alpha_milli) X(blink_sched_rules_t, lvf_beta_b_milli) \
    X(blink_sched_rules_t, lvf_beta_f_milli) X(blink_sched_rules_t, lvf_xfer_blocks) X(blink_sched_rules_t, reserved) \
    X(blink_sched_rules_t, now_us) X(blink_req_time_t, id) X(blink_req_time_t, priority)                    \
    X(blink_req_time_t, arrival_us) X(blink_req_time_t, last_us) X(blink_req_time_t, run_us)                \
    X(blink_req_time_t, ttft_slo_us) X(blink_req_time_t, tbt_slo_us)                                        \
    X(blink_pkv_t, free_stack) X(blink_pkv_t, refs) X(blink_pkv_t, key) X(blink_pkv_t, has_key)             \
    X(blink_pkv_t, lru_prev) X(blink_pkv_t, lru_next) X(blink_pkv_t, table_key) X(blink_pkv_t, table_block) \
    X(blink_pkv_t, num_blocks) X(blink_pkv_t, table_cap) X(blink_pkv_t, never_cached) X(blink_pkv_t, evictable) \
    X(blink_pkv_t, lru_head) X(blink_pkv_t, lru_tail) X(blink_pkv_t, extra_refs) X(blink_pkv_t, cached)     \
    X(blink_pkv_t, evictions) X(blink_pkv_t, reserved)                                                      \
    X(blink_kv_t, free_stack) X(blink_kv_t, owner) X(blink_kv_t, tables) X(blink_kv_t, num_blocks)          \
    X(blink_kv_t, max_blocks) X(blink_kv_t, rows) X(blink_kv_t, reserved)                                   \
    X(blink_graph_lut_t, ids) X(blink_graph_lut_t, max_rows) X(blink_graph_lut_t, n_len)                    \
    X(blink_graph_lut_t, n_ctx) X(blink_graph_lut_t, len_granularity) X(blink_graph_lut_t, ctx_granularity) \
    X(blink_graph_lut_t, fallback)                                                                          \
    X(blink_graph_table_t, execs) X(blink_graph_table_t, shapes) X(blink_graph_table_t, prefill)            \
    X(blink_graph_table_t, decode) X(blink_graph_table_t, n_graphs) X(blink_graph_table_t, split_len)       \
    X(blink_step_io_t, input_ids) X(blink_step_io_t, positions) X(blink_step_io_t, slot_mapping)            \
    X(blink_step_io_t, block_tables) X(blink_step_io_t, q_lens) X(blink_step_io_t, temperature)             \
    X(blink_step_io_t, top_p) X(blink_step_io_t, top_k) X(blink_step_io_t, seeds)                           \
    X(blink_step_io_t, token_index) X(blink_step_io_t, tokens) X(blink_step_io_t, min_p)                    \
    X(blink_step_io_t, presence) X(blink_step_io_t, frequency) X(blink_step_io_t, repetition)               \
    X(blink_step_io_t, min_tokens) X(blink_step_io_t, stop_ids) X(blink_step_io_t, seat)                    \
    X(blink_step_io_t, lp_token) X(blink_step_io_t, lp_rank) X(blink_step_io_t, lp_top_ids)                 \
    X(blink_step_io_t, lp_top_vals) X(blink_step_io_t, seat_bias) X(blink_step_io_t, seat_counts)           \
    X(blink_step_io_t, seat_prompt_mask) X(blink_step_io_t, seat_recent) X(blink_step_io_t, seat_bad_prefix) \
    X(blink_step_io_t, seat_bad_len) X(blink_step_io_t, seat_bad_last) X(blink_step_io_t, automaton_on)     \
    X(blink_step_io_t, automaton_allowed) X(blink_step_io_t, lp_want) X(blink_step_io_t, block_size)         \
    X(blink_step_io_t, sink_block) X(blink_step_io_t, sink_seat) X(blink_step_io_t, vocab)

long blink_struct_offset(const char *strct, const char *field) {
#define X(S, F) if (!strcmp(strct, #S) && !strcmp(field, #F)) return (long)offsetof(S, F);
    BLINK_FIELDS(X)
#undef X
    return -1;
}

long blink_struct_size(const char *strct) {
    if (!strcmp(strct, "blink_policy_config_t")) return sizeof(blink_policy_config_t);
    if (!strcmp(strct, "blink_req_t")) return sizeof(blink_req_t);
    if (!strcmp(strct, "blink_sched_state_t")) return sizeof(blink_sched_state_t);
    if (!strcmp(strct, "blink_sched_control_t")) return sizeof(blink_sched_control_t);
    if (!strcmp(strct, "blink_sched_params_t")) return sizeof(blink_sched_params_t);
    if (!strcmp(strct, "blink_kv_t")) return sizeof(blink_kv_t);
    if (!strcmp(strct, "blink_graph_lut_t")) return sizeof(blink_graph_lut_t);
    if (!strcmp(strct, "blink_graph_table_t")) return sizeof(blink_graph_table_t);
    if (!strcmp(strct, "blink_step_io_t")) return sizeof(blink_step_io_t);
    if (!strcmp(strct, "blink_sched_rules_t")) return sizeof(blink_sched_rules_t);
    if (!strcmp(strct, "blink_req_time_t")) return sizeof(blink_req_time_t);
    if (!strcmp(strct, "blink_pkv_t")) return sizeof(blink_pkv_t);
    return -1;
}

}  /* extern "C" */
