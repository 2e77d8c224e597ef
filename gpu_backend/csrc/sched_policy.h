/* The scheduler's decisions as plain host+device C (the persistent loop plans through
 * blink_plan_step_policy under the daemon's policy): the twin of
 * gpu_backend/scheduler/policy.py (plan_step) and of the engine's request checks
 * (scheduler/intake.py) and finish rule (engine._emit). No memory ordering, no ring
 * access, no CUDA: the kernel (sched_loop.h) is the mechanism around these
 * functions, and tests/gpu_backend/cuda diff-tests them against the Python
 * through host_twin.cc (g++ -> ctypes).
 *
 *   requests (blink_req_t by slot id) + waiting deque + running list + free blocks
 *     -> blink_plan_step -> blink_plan_t (kind, prefill chunks, decodes,
 *        preemptions newest first, admissions, new blocks per scheduled id)
 *   the same + blink_sched_rules_t (policy, LVF weights, clock) + blink_req_time_t
 *     per request -> blink_plan_step_policy: rule 0 (blink_order_requests: the
 *     FCFS, PRIORITY or LVF order and the victims) then the same rules
 *
 * Every rule below names the numbered rule of policy.py it mirrors; keep the
 * two in step (the diff test fails otherwise).
 */
#ifndef BLINK_SCHED_POLICY_H
#define BLINK_SCHED_POLICY_H

#include <string.h>

#include "sched_types.h"

typedef struct blink_plan {
    uint32_t kind;                /* BLINK_STEP_* */
    uint32_t n_prefill, n_decode, n_preempted, n_admitted, n_new_blocks;
    uint32_t *prefill_id, *prefill_len;   /* (id, tokens this step): running first, then admissions */
    uint32_t *decode_id;                  /* admission order */
    uint32_t *preempted_id;               /* newest first */
    uint32_t *admitted_id;                /* leaving the waiting queue, in order */
    uint32_t *new_blocks_id, *new_blocks_n;  /* for every scheduled id, in schedule order */
} blink_plan_t;

static inline BLINK_HD int64_t blink_blocks_needed(int64_t tokens, int64_t block_size) {
    return (tokens + block_size - 1) / block_size;
}

static inline BLINK_HD int64_t blink_min3(int64_t a, int64_t b, int64_t c) {
    int64_t m = a < b ? a : b;
    return m < c ? m : c;
}

static inline BLINK_HD uint32_t blink_req_tokens(const blink_req_t *r) {
    return r->prompt_len + r->generated;
}

static inline BLINK_HD int64_t blink_floor_div(int64_t a, int64_t b) {
    int64_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;   /* C truncates; Python floors */
}

/* policy.vlt_waiting / vlt_running */
static inline BLINK_HD int64_t blink_vlt_waiting(const blink_sched_rules_t *ru, const blink_req_time_t *t) {
    if (t->last_us >= 0) {
        int64_t lag = ru->now_us - t->last_us - blink_floor_div((int64_t)ru->lvf_beta_b_milli * t->tbt_slo_us, 1000);
        return (int64_t)ru->lvf_alpha_milli * (lag > 0 ? lag : 0) / 1000;
    }
    int64_t lag = ru->now_us - t->arrival_us - blink_floor_div((int64_t)ru->lvf_beta_f_milli * t->ttft_slo_us, 1000);
    return lag > 0 ? lag : 0;
}

static inline BLINK_HD int64_t blink_vlt_running(const blink_sched_rules_t *ru, const blink_req_time_t *t) {
    return -(ru->now_us - t->run_us);
}

/* policy.first_blocks: a waiting request's first chunk, from its prefix-cache hit on, plus the
 * hit's blocks no request holds (they leave the free count when taken) */
static inline BLINK_HD int64_t blink_first_blocks(const blink_policy_config_t *cfg, const blink_req_t *r) {
    int64_t n = (int64_t)blink_req_tokens(r) - r->num_cached;
    if (n > (int64_t)cfg->max_prefill_tokens) n = cfg->max_prefill_tokens;
    return (n + cfg->block_size - 1) / cfg->block_size + r->cached_idle;
}

/* 1 if a's key (k0, arrival, id) sorts before b's. */
static inline BLINK_HD int blink_key_less(int64_t a0, const blink_req_time_t *a, int64_t b0, const blink_req_time_t *b) {
    if (a0 != b0) return a0 < b0;
    if (a->arrival_us != b->arrival_us) return a->arrival_us < b->arrival_us;
    return a->id < b->id;
}

/* Insertion sort of ids by (key[i], arrival, id); key is indexed like ids. Keys are unique (the id). */
static inline BLINK_HD void blink_sort_ids(uint32_t *ids, int64_t *key, uint32_t n, const blink_req_time_t *times) {
    for (uint32_t i = 1; i < n; ++i) {
        uint32_t id = ids[i];
        int64_t k = key[i];
        uint32_t j = i;
        while (j > 0 && blink_key_less(k, &times[id], key[j - 1], &times[ids[j - 1]])) {
            ids[j] = ids[j - 1];
            key[j] = key[j - 1];
            --j;
        }
        ids[j] = id;
        key[j] = k;
    }
}

static inline BLINK_HD int64_t blink_reserve(const blink_policy_config_t *cfg, const blink_req_t *reqs,
                                             const uint32_t *running, uint32_t n_running) {
    int64_t reserve = 0;
    for (uint32_t i = 0; i < n_running; ++i) {
        const blink_req_t *r = &reqs[running[i]];
        if ((int64_t)blink_req_tokens(r) - r->num_computed == 1 &&
            blink_blocks_needed((int64_t)r->num_computed + 1, cfg->block_size) > (int64_t)r->num_blocks)
            ++reserve;
    }
    return reserve;
}

/* LVF's preemption candidate: running, VLT < 0 (key = -VLT > 0), decoding. */
static inline BLINK_HD int blink_lvf_candidate(const blink_req_t *r, int64_t key) {
    return r->status == BLINK_REQ_RUNNING && key > 0 && (int64_t)blink_req_tokens(r) - r->num_computed == 1;
}

/* Rule 0 of policy.py (order_requests) under PRIORITY or LVF (FCFS keeps both orders, so
 * blink_plan_step_policy plans on the deque itself): w_out[w_count] and r_out[n_running] get the policy's
 * waiting and running orders, victims[] the ids preempted for waiting ones (worst first);
 * returns their count. Scratch: lkey and lid hold w_count + n_running entries. */
static inline BLINK_HD uint32_t blink_order_requests(const blink_sched_rules_t *ru, const blink_policy_config_t *cfg,
                                                     const blink_req_t *reqs, const blink_req_time_t *times,
                                                     const uint32_t *waiting, uint32_t w_head, uint32_t w_count,
                                                     uint32_t w_cap, const uint32_t *running, uint32_t n_running,
                                                     int64_t free_blocks, uint32_t *w_out, uint32_t *r_out,
                                                     uint32_t *victims, int64_t *lkey, uint32_t *lid) {
    for (uint32_t k = 0; k < w_count; ++k) w_out[k] = waiting[(w_head + k) % w_cap];
    for (uint32_t i = 0; i < n_running; ++i) r_out[i] = running[i];
    const int64_t free0 = free_blocks - blink_reserve(cfg, reqs, running, n_running);
    const int64_t seats0 = (int64_t)cfg->max_batch_size - n_running;
    uint32_t n_victims = 0;
    if (ru->policy == BLINK_POLICY_PRIORITY) {
        for (uint32_t k = 0; k < w_count; ++k) lkey[k] = times[w_out[k]].priority;
        blink_sort_ids(w_out, lkey, w_count, times);
        for (uint32_t i = 0; i < n_running; ++i) lkey[i] = times[r_out[i]].priority;
        blink_sort_ids(r_out, lkey, n_running, times);
        int64_t free = free0, seats = seats0;
        uint32_t alive = n_running;
        for (uint32_t k = 0; k < w_count; ++k) {
            const blink_req_time_t *wt = &times[w_out[k]];
            int64_t need = blink_first_blocks(cfg, &reqs[w_out[k]]);
            int64_t f = free, s = seats;
            uint32_t j = alive;
            while ((need > f || s <= 0) && j > 0 &&
                   blink_key_less(wt->priority, wt, times[r_out[j - 1]].priority, &times[r_out[j - 1]])) {
                --j;
                f += reqs[r_out[j]].num_blocks;
                ++s;
            }
            if (need > f || s <= 0) break;
            for (uint32_t v = alive; v > j; --v) victims[n_victims++] = r_out[v - 1];
            alive = j;
            free = f - need;
            seats = s - 1;
        }
        return n_victims;
    }
    /* LVF: step 1, contention check */
    int64_t total = 0;
    for (uint32_t k = 0; k < w_count; ++k) total += blink_first_blocks(cfg, &reqs[w_out[k]]);
    if (total <= free0 && (int64_t)w_count <= seats0) return 0;
    /* step 2: L sorted by -VLT (then arrival, id); waiting and running ids never collide */
    const uint32_t n = w_count + n_running;
    for (uint32_t k = 0; k < w_count; ++k) { lid[k] = w_out[k]; lkey[k] = -blink_vlt_waiting(ru, &times[w_out[k]]); }
    for (uint32_t i = 0; i < n_running; ++i) {
        lid[w_count + i] = r_out[i];
        lkey[w_count + i] = -blink_vlt_running(ru, &times[r_out[i]]);
    }
    blink_sort_ids(lid, lkey, n, times);
    /* step 3 */
    int64_t b_left = free0 + ru->lvf_xfer_blocks, s_free = seats0, s_cand = 0, s_swap = 0;
    for (uint32_t i = 0; i < n; ++i)
        if (blink_lvf_candidate(&reqs[lid[i]], lkey[i])) ++s_cand;
    uint32_t n_chosen = 0;
    for (uint32_t i = 0; i < n; ++i) {
        if (reqs[lid[i]].status == BLINK_REQ_RUNNING || lkey[i] > 0) continue;
        int64_t need = blink_first_blocks(cfg, &reqs[lid[i]]);
        if (need > b_left) continue;
        if (s_free > 0) {
            --s_free;
        } else if (times[lid[i]].last_us < 0 && lkey[i] < 0 && s_cand > 0) {   /* fresh and lagging */
            --s_cand;
            ++s_swap;
        } else {
            continue;
        }
        w_out[n_chosen++] = lid[i];
        b_left -= need;
    }
    /* step 4 */
    int64_t b_swap = (int64_t)ru->lvf_xfer_blocks - b_left;
    for (uint32_t i = n; i > 0; --i) {
        uint32_t id = lid[i - 1];
        if (blink_lvf_candidate(&reqs[id], lkey[i - 1]) && (b_swap > 0 || s_swap > 0)) {
            victims[n_victims++] = id;
            b_swap -= reqs[id].num_blocks;
            --s_swap;
        }
    }
    /* orders: the chosen, then the other waiting in L order; running in L order */
    uint32_t nw = n_chosen, nr = 0;
    for (uint32_t i = 0; i < n; ++i) {
        uint32_t id = lid[i];
        if (reqs[id].status == BLINK_REQ_RUNNING) {
            r_out[nr++] = id;
            continue;
        }
        int chosen = 0;
        for (uint32_t c = 0; c < n_chosen; ++c) chosen |= w_out[c] == id;
        if (!chosen) w_out[nw++] = id;
    }
    return n_victims;
}

static inline BLINK_HD int blink_in(const uint32_t *ids, uint32_t n, uint32_t id) {
    for (uint32_t i = 0; i < n; ++i)
        if (ids[i] == id) return 1;
    return 0;
}

/* policy.hit_taken: free blocks admitting waiting request `id` may take for its prefix-cache hit:
 * cached_idle, plus those of its other hit blocks that can be idle when it takes them: held only
 * by this step's victims (at most `freed`), or idle but counted for a request ahead of it in the
 * engine's queue (`queue`, the order cached_idle was claimed in) that is not admitted so far. */
static inline BLINK_HD int64_t blink_hit_taken(const blink_policy_config_t *cfg, const blink_req_t *reqs, uint32_t id,
                                               const uint32_t *queue, uint32_t q_head, uint32_t q_count,
                                               uint32_t q_cap, const blink_plan_t *plan, int64_t freed) {
    const blink_req_t *w = &reqs[id];
    int64_t held = (int64_t)(w->num_cached / cfg->block_size) - (int64_t)w->cached_idle;
    if (held <= 0) return w->cached_idle;
    int64_t avail = freed;
    for (uint32_t k = 0; k < q_count; ++k) {
        uint32_t q = queue[(q_head + k) % q_cap];
        if (q == id) break;
        if (!blink_in(plan->admitted_id, plan->n_admitted, q)) avail += reqs[q].cached_idle;
    }
    return (int64_t)w->cached_idle + (held < avail ? held : avail);
}

/* Rule 2b: waiting requests in queue order, each its prompt from its cached prefix on, while the
 * prefill budget, a seat and the free blocks last (less `reserve`, one for each decoder whose next
 * token needs one, and less the idle cached blocks a hit takes). blink_plan_core's, and the
 * persistent scheduler's admission planned from its survey (sched_loop.h blink_fast_admit). */
static inline BLINK_HD void blink_plan_admit(const blink_policy_config_t *cfg, const blink_req_t *reqs,
                                             const uint32_t *waiting, uint32_t w_head, uint32_t w_count,
                                             uint32_t w_cap, int64_t budget, int64_t free, int64_t reserve,
                                             int64_t seats, int64_t freed, blink_plan_t *plan, const uint32_t *queue,
                                             uint32_t q_head, uint32_t q_cap) {
    const int64_t bs = cfg->block_size;
    for (uint32_t k = 0; k < w_count; ++k) {
        if (budget == 0 || seats == 0) break;
        uint32_t id = waiting[(w_head + k) % w_cap];
        const blink_req_t *w = &reqs[id];   /* a prefix-cache hit computes from num_cached on */
        int64_t taken = blink_hit_taken(cfg, reqs, id, queue, q_head, w_count, q_cap, plan, freed);
        int64_t chunk = blink_min3((int64_t)blink_req_tokens(w) - w->num_cached, budget, (free - reserve - taken) * bs);
        if (chunk <= 0) break;
        int64_t need = blink_blocks_needed(chunk, bs);   /* num_cached is block-aligned */
        free -= need + taken;
        budget -= chunk;
        --seats;
        plan->prefill_id[plan->n_prefill] = id;
        plan->prefill_len[plan->n_prefill++] = (uint32_t)chunk;
        plan->new_blocks_id[plan->n_new_blocks] = id;
        plan->new_blocks_n[plan->n_new_blocks++] = (uint32_t)need;
        plan->admitted_id[plan->n_admitted++] = id;
    }
}

/* Rules 1-4 of policy.py after rule 0: `waiting` is a deque of capacity w_cap starting at
 * w_head, `running` in the policy's order; `victims` leave for a PREFILL step. Ids index
 * `reqs`. Fills `plan` (its arrays hold max_batch_size entries, or n_running where that
 * is larger). */
static inline BLINK_HD void blink_plan_core(const blink_policy_config_t *cfg, const blink_req_t *reqs,
                                            const uint32_t *waiting, uint32_t w_head, uint32_t w_count,
                                            uint32_t w_cap, const uint32_t *running, uint32_t n_running,
                                            const uint32_t *victims, uint32_t n_victims,
                                            int64_t free_blocks, uint32_t prev_kind, blink_plan_t *plan,
                                            const uint32_t *queue, uint32_t q_head, uint32_t q_cap) {
    const int64_t bs = cfg->block_size;
    plan->kind = BLINK_STEP_IDLE;
    plan->n_prefill = plan->n_decode = plan->n_preempted = plan->n_admitted = plan->n_new_blocks = 0;

    uint32_t n_decoders = 0, n_prefilling = 0, n_prefilling_all = 0;
    int64_t freed = 0;
    for (uint32_t i = 0; i < n_running; ++i) {
        const blink_req_t *r = &reqs[running[i]];
        int64_t remaining = (int64_t)blink_req_tokens(r) - r->num_computed;
        int victim = blink_in(victims, n_victims, running[i]);
        if (victim) freed += r->num_blocks;
        if (remaining == 1) ++n_decoders;
        else if (remaining > 1) {
            ++n_prefilling_all;
            if (!victim) ++n_prefilling;
        }
    }
    int64_t seats = (int64_t)cfg->max_batch_size - (n_running - n_victims);
    int prefill_work = n_prefilling > 0 || (w_count > 0 && seats > 0);

    /* rule 1: decode pauses for one PREFILL step to admit arrivals, then resumes */
    if (prefill_work && (n_decoders == 0 || prev_kind != BLINK_STEP_PREFILL)) {
        int64_t budget = cfg->max_prefill_tokens, free = free_blocks + freed;
        int blocked = 0;
        for (uint32_t i = 0; i < n_running; ++i) {                /* rule 2a */
            if (blink_in(victims, n_victims, running[i])) continue;
            const blink_req_t *r = &reqs[running[i]];
            int64_t remaining = (int64_t)blink_req_tokens(r) - r->num_computed;
            if (remaining <= 1) continue;
            if (budget == 0) break;
            int64_t chunk = blink_min3(remaining, budget,
                                       ((int64_t)r->num_blocks + free) * bs - (int64_t)r->num_computed);
            if (chunk <= 0) { blocked = 1; break; }            /* FCFS: nobody overtakes it */
            int64_t need = blink_blocks_needed((int64_t)r->num_computed + chunk, bs) - r->num_blocks;
            if (need < 0) need = 0;
            free -= need;
            budget -= chunk;
            plan->prefill_id[plan->n_prefill] = running[i];
            plan->prefill_len[plan->n_prefill++] = (uint32_t)chunk;
            plan->new_blocks_id[plan->n_new_blocks] = running[i];
            plan->new_blocks_n[plan->n_new_blocks++] = (uint32_t)need;
        }
        if (!blocked) {
            int64_t reserve = 0;
            for (uint32_t i = 0; i < n_running; ++i) {
                if (blink_in(victims, n_victims, running[i])) continue;
                const blink_req_t *r = &reqs[running[i]];
                if ((int64_t)blink_req_tokens(r) - r->num_computed == 1 &&
                    blink_blocks_needed((int64_t)r->num_computed + 1, bs) > (int64_t)r->num_blocks)
                    ++reserve;
            }
            blink_plan_admit(cfg, reqs, waiting, w_head, w_count, w_cap, budget, free, reserve, seats, freed, plan,
                             queue, q_head, q_cap);                /* rule 2b */
        }
        if (plan->n_prefill > 0) {
            plan->kind = BLINK_STEP_PREFILL;
            for (uint32_t v = 0; v < n_victims; ++v) plan->preempted_id[plan->n_preempted++] = victims[v];
            return;
        }
        plan->n_new_blocks = plan->n_admitted = 0;   /* nothing scheduled: fall through */
    }

    if (n_decoders > 0) {                                           /* rule 3 */
        int64_t free = free_blocks;
        uint32_t alive = n_running;   /* running[0..alive) still alive; victims come off the end */
        for (uint32_t i = 0; i < n_running; ++i) {
            if (i >= alive) break;    /* preempted as a victim: everyone after it is gone too */
            const blink_req_t *r = &reqs[running[i]];
            if ((int64_t)blink_req_tokens(r) - r->num_computed != 1) continue;
            int64_t need = blink_blocks_needed((int64_t)r->num_computed + 1, bs) - r->num_blocks;
            if (need < 0) need = 0;
            int self_preempted = 0;
            while (need > free) {
                uint32_t victim = running[--alive];
                plan->preempted_id[plan->n_preempted++] = victim;
                free += reqs[victim].num_blocks;
                if (victim == running[i]) { self_preempted = 1; break; }
            }
            if (self_preempted) break;
            free -= need;
            plan->decode_id[plan->n_decode++] = running[i];
            plan->new_blocks_id[plan->n_new_blocks] = running[i];
            plan->new_blocks_n[plan->n_new_blocks++] = (uint32_t)need;
        }
        plan->kind = BLINK_STEP_DECODE;
        return;
    }
    if (n_prefilling_all > 0 && n_running > 1)                      /* rule 4: deadlock breaker */
        plan->preempted_id[plan->n_preempted++] = running[n_running - 1];
}

/* policy.plan_step with FCFS (what the persistent scheduler runs). */
static inline BLINK_HD void blink_plan_step(const blink_policy_config_t *cfg, const blink_req_t *reqs,
                                            const uint32_t *waiting, uint32_t w_head, uint32_t w_count,
                                            uint32_t w_cap, const uint32_t *running, uint32_t n_running,
                                            int64_t free_blocks, uint32_t prev_kind, blink_plan_t *plan) {
    blink_plan_core(cfg, reqs, waiting, w_head, w_count, w_cap, running, n_running, 0, 0, free_blocks, prev_kind,
                    plan, waiting, w_head, w_cap);
}

/* policy.plan_step under any policy: rule 0, then rules 1-4. Scratch: w_out [w_count],
 * r_out and victims [n_running], lkey and lid [w_count + n_running]. A request's status
 * (BLINK_REQ_RUNNING or not) tells rule 0 which list it is on. */
static inline BLINK_HD void blink_plan_step_policy(const blink_policy_config_t *cfg, const blink_sched_rules_t *ru,
                                                   const blink_req_t *reqs, const blink_req_time_t *times,
                                                   const uint32_t *waiting, uint32_t w_head, uint32_t w_count,
                                                   uint32_t w_cap, const uint32_t *running, uint32_t n_running,
                                                   int64_t free_blocks, uint32_t prev_kind, blink_plan_t *plan,
                                                   uint32_t *w_out, uint32_t *r_out, uint32_t *victims,
                                                   int64_t *lkey, uint32_t *lid) {
    if (ru->policy == BLINK_POLICY_FCFS) {   /* rule 0 keeps both orders: plan on the deque itself, no copies */
        blink_plan_core(cfg, reqs, waiting, w_head, w_count, w_cap, running, n_running, victims, 0, free_blocks,
                        prev_kind, plan, waiting, w_head, w_cap);
        return;
    }
    uint32_t n_victims = blink_order_requests(ru, cfg, reqs, times, waiting, w_head, w_count, w_cap, running,
                                              n_running, free_blocks, w_out, r_out, victims, lkey, lid);
    blink_plan_core(cfg, reqs, w_out, 0, w_count, w_count ? w_count : 1, r_out, n_running, victims, n_victims,
                    free_blocks, prev_kind, plan, waiting, w_head, w_cap);
}

/* Finish rule of engine._emit, after `token` was appended (r->generated counts it):
 * a stop id (or EOS unless ignore_eos; always for a structured output, whose finished
 * structure ends with EOS: intake.py adds it to the stop ids) -> STOP; max_tokens or a
 * full context -> LENGTH (mid-structure too). */
static inline BLINK_HD uint32_t blink_finish_reason(const blink_policy_config_t *cfg, const blink_req_t *r,
                                                    int32_t token) {
    for (uint32_t i = 0; i < r->n_stop && i < BLINK_MAX_STOP_IDS; ++i)
        if (r->stop_ids[i] == token) return BLINK_FINISH_STOP;
    if (!(r->flags & BLINK_FLAG_IGNORE_EOS) || r->automaton_words)
        for (uint32_t i = 0; i < cfg->n_eos && i < BLINK_MAX_EOS_IDS; ++i)
            if (cfg->eos_ids[i] == token) return BLINK_FINISH_STOP;
    if (r->generated >= r->max_tokens || blink_req_tokens(r) >= cfg->max_model_len) return BLINK_FINISH_LENGTH;
    return BLINK_FINISH_NONE;
}

static inline BLINK_HD int blink_is_finite(float x) {
    return x == x && x - x == 0.0f;   /* NaN != NaN; inf - inf is NaN */
}

/* The checks of intake._read that need no prompt tokens, in its order:
 * stale epoch, cancel flag, shared_layout.request_error, prompt too long.
 * Returns FinishReason << 16 | ErrorCode; 0 when the request is acceptable
 * so far (its token ids are checked separately: sched_loop.h blink_tokens_ok). */
static inline BLINK_HD uint32_t blink_intake_check(const blink_policy_config_t *cfg, uint64_t prompt_arena_tokens,
                                                   uint64_t output_arena_tokens, uint64_t logprob_arena_words,
                                                   uint64_t frontend_epoch, const blink_slot_t *s) {
    if (s->epoch != frontend_epoch) return BLINK_FINISH_ABORT << 16 | BLINK_ERR_STALE_EPOCH;
    if (s->cancel) return BLINK_FINISH_ABORT << 16 | BLINK_ERR_NONE;
    const uint32_t invalid = BLINK_FINISH_ERROR << 16 | BLINK_ERR_INVALID_REQUEST;
    if (s->prompt_len == 0 || (uint64_t)s->prompt_offset + s->prompt_len > prompt_arena_tokens) return invalid;
    if (s->max_tokens == 0 || (uint64_t)s->output_offset + s->max_tokens > output_arena_tokens) return invalid;
    if (!blink_is_finite(s->temperature) || s->temperature < 0.0f) return invalid;
    if (!(s->top_p > 0.0f && s->top_p <= 1.0f) || s->top_k < 0) return invalid;
    if (s->n_stop_ids > BLINK_MAX_STOP_IDS) return invalid;
    const float pres = s->presence_penalty, freq = s->frequency_penalty, rep = s->repetition_penalty;
    if (!blink_is_finite(pres) || !blink_is_finite(freq) || !blink_is_finite(rep) || !blink_is_finite(s->min_p))
        return invalid;
    if (!(pres >= -2.0f && pres <= 2.0f && freq >= -2.0f && freq <= 2.0f && rep >= 0.0f && rep <= 2.0f &&
          s->min_p >= 0.0f && s->min_p <= 1.0f))
        return invalid;
    if (s->min_tokens > s->max_tokens) return invalid;
    const uint64_t extra = 2ull * s->n_logit_bias + s->n_allowed_ids + s->bad_words_words + s->automaton_words;
    if ((uint64_t)s->extra_offset + extra > prompt_arena_tokens) return invalid;
    if (s->group_size > 1 && (s->group_index >= s->group_size || (s->group_index == 0 && s->group_seq != s->seq)))
        return invalid;
    if (s->flags & BLINK_FLAG_LOGPROBS &&
        (s->logprobs > BLINK_MAX_LOGPROBS ||
         (uint64_t)s->logprobs_offset + (uint64_t)s->max_tokens * BLINK_LOGPROB_RECORD_WORDS(s->logprobs) >
             logprob_arena_words))
        return invalid;
    if (s->flags & BLINK_FLAG_PROMPT_LOGPROBS &&
        (s->prompt_logprobs > BLINK_MAX_LOGPROBS ||
         (uint64_t)s->prompt_logprobs_offset +
                 (uint64_t)(s->prompt_len - 1) * BLINK_LOGPROB_RECORD_WORDS(s->prompt_logprobs) >
             logprob_arena_words))
        return invalid;
    if (s->prompt_len >= cfg->max_model_len) return BLINK_FINISH_ERROR << 16 | BLINK_ERR_PROMPT_TOO_LONG;
    return 0;
}

/* Whether a request's sampling keeps state in a sampler seat (graphs/hostloop.needs_seat). */
static inline BLINK_HD int blink_needs_seat(float presence, float frequency, float repetition, uint32_t n_logit_bias,
                                            uint32_t n_allowed_ids, uint32_t bad_words_words) {
    return presence != 0.0f || frequency != 0.0f || (repetition != 0.0f && repetition != 1.0f) || n_logit_bias ||
           n_allowed_ids || bad_words_words;
}

/* What the persistent scheduler's graphs cannot serve, refused rather than ignored (docs/cuda.md,
 * "Sampling in the graph"): prompt logprobs (the graphs compute each row's last logits only),
 * and a request that needs a sampler seat when the step graphs hold none (the echo stand-in).
 * Structured outputs are served (automaton.h: the staging masks, the publish steps the state).
 * Returns FinishReason << 16 | ErrorCode, 0 when the device serves it. */
static inline BLINK_HD uint32_t blink_device_unsupported(const blink_slot_t *s, uint32_t n_seats) {
    const int seat = blink_needs_seat(s->presence_penalty, s->frequency_penalty, s->repetition_penalty,
                                      s->n_logit_bias, s->n_allowed_ids, s->bad_words_words);
    if ((seat && n_seats == 0) || (s->flags & BLINK_FLAG_PROMPT_LOGPROBS))
        return BLINK_FINISH_ERROR << 16 | BLINK_ERR_INVALID_REQUEST;
    return 0;
}

/* shared_layout.extra.decode_extra's checks on a slot's sampling data (words at w: logit_bias
 * ids, their float32 values, allowed ids, (length, ids...) bad words), plus the seat's cap on
 * multi-token bad words. 1: acceptable. `ld(i)` loads word i. */
template <class L>
BLINK_DEV int blink_extra_ok(L ld, uint32_t vocab, uint32_t n_logit_bias, uint32_t n_allowed_ids,
                            uint32_t bad_words_words) {
    if (n_logit_bias > BLINK_MAX_LOGIT_BIAS || n_allowed_ids > BLINK_MAX_ALLOWED_IDS ||
        bad_words_words > BLINK_MAX_BAD_WORDS_WORDS)
        return 0;
    for (uint32_t i = 0; i < n_logit_bias; ++i) {
        const uint32_t id = ld(i), bits = ld(n_logit_bias + i);
        float b;
        memcpy(&b, &bits, 4);
        if (id >= vocab || !(b >= -100.0f && b <= 100.0f)) return 0;   /* NaN fails the comparison */
    }
    const uint32_t a0 = 2 * n_logit_bias;
    for (uint32_t i = 0; i < n_allowed_ids; ++i)
        if (ld(a0 + i) >= vocab) return 0;
    const uint32_t w0 = a0 + n_allowed_ids;
    uint32_t multi = 0;
    for (uint32_t i = 0; i < bad_words_words;) {
        const uint32_t n = ld(w0 + i);
        if (n < 1 || n > BLINK_BAD_WORD_LEN || i + 1 + n > bad_words_words) return 0;
        for (uint32_t j = 0; j < n; ++j)
            if (ld(w0 + i + 1 + j) >= vocab) return 0;
        multi += n > 1;
        i += 1 + n;
    }
    return multi <= BLINK_BAD_WORDS;
}

/* splitmix64: the seed of a request that brought none, from what identifies it
 * and the clock, so two unseeded requests never share a stream of draws. */
static inline BLINK_HD uint64_t blink_mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static inline BLINK_HD uint64_t blink_derive_seed(uint64_t seq, uint64_t epoch, uint32_t slot, uint64_t now_ns) {
    return blink_mix64(blink_mix64(seq ^ (epoch << 40) ^ ((uint64_t)slot << 20)) ^ now_ns);
}

#endif /* BLINK_SCHED_POLICY_H */
