/* The persistent scheduler's data: what lives in device memory across tail
 * launches, what the host watches, and the one parameter block every kernel
 * takes. Shared by nvcc (device) and g++ (the host twin and the ctypes shim);
 * gpu_backend/cuda/structs.py mirrors these structs with ctypes and a test
 * checks every offset against this header.
 *
 *   ring (host-mapped shm or device memory): header, slots, arenas  (frontend <-> scheduler)
 *   blink_req_t[slot_count]      the scheduler's copy of each claimed request (device memory)
 *   waiting[slot_count] deque, running[max_batch]   queues, slot ids (device memory)
 *   blink_sched_state_t          queue heads, KV block count, the step in flight (device memory)
 *   chunk_* / step_tokens        the step descriptor the step graph reads and its output
 *   row_*                        the step's chunks cut into the chosen graph's rows (graph_table.h)
 *   kv_*                         the KV block allocator and every slot's block table (kv_alloc.h)
 *   seat_owner                   which running request holds each sampler seat of the step graphs
 *   graphs                       the captured step graphs and their lookup tables (graph_table.h)
 *   blink_sched_control_t        host-mapped: stop/abort from the host, counters to it
 */
#ifndef BLINK_SCHED_TYPES_H
#define BLINK_SCHED_TYPES_H

#include "blink_ring_layout.h"
#include "graph_table.h"
#include "kv_alloc.h"

/* Functions of the scheduler loop: device code under nvcc, plain host code under g++. */
#if defined(__CUDACC__)
#define BLINK_DEV __device__
#define BLINK_UNROLL _Pragma("unroll")
#else
#define BLINK_DEV
#define BLINK_UNROLL _Pragma("GCC unroll 8")   /* g++ -Werror knows no plain `#pragma unroll` */
#endif

/* The index of x's lowest set bit (x != 0). */
static inline BLINK_HD uint32_t blink_ctz32(uint32_t x) {
#if defined(__CUDA_ARCH__)
    return (uint32_t)__ffs((int)x) - 1u;
#else
    return (uint32_t)__builtin_ctz(x);
#endif
}

/* The number of set bits of x. */
static inline BLINK_HD uint32_t blink_popc32(uint32_t x) {
#if defined(__CUDA_ARCH__)
    return (uint32_t)__popc(x);
#else
    return (uint32_t)__builtin_popcount(x);
#endif
}

#define BLINK_MAX_EOS_IDS 8
#define BLINK_ROW_STOPS (BLINK_MAX_STOP_IDS + BLINK_MAX_EOS_IDS)   /* ids the sampler masks before min_tokens */
#define BLINK_TOP_LOGPROBS BLINK_MAX_LOGPROBS   /* top entries the graph computes for every row */
#define BLINK_NO_SEAT 0xffffffffu    /* blink_req_t.seat: the request holds no sampler seat */
#define BLINK_BAD_WORDS 64           /* multi-token bad words a seat holds (graphs/sampler.BAD_WORDS) */
#define BLINK_BAD_WORD_LEN 64        /* tokens of one bad word at most (graphs/sampler.BAD_WORD_LEN) */
#define BLINK_MAX_LOGIT_BIAS 1024u   /* shared_layout/extra.py's caps on a slot's sampling data */
#define BLINK_MAX_ALLOWED_IDS (1u << 18)
#define BLINK_MAX_BAD_WORDS_WORDS (1u << 14)
#define BLINK_STEP_GRAPHS 2          /* instances of each step graph, launched alternately */
/* Fire-and-forget launches one graph execution may make (CUDA programming guide, device
 * graph launch). The scheduler counts every launch attempt, refused ones included (the
 * guide does not say whether they count), starts a step only while its window holds fewer
 * than window_limit attempts (<= BLINK_MAX_WINDOW) and lets that step retry up to the cap:
 * BLINK_LAUNCH_HEADROOM attempts of slack before the runtime would refuse for good. */
#define BLINK_DEVICE_LAUNCH_CAP 120u
#define BLINK_LAUNCH_HEADROOM 20u
#define BLINK_MAX_WINDOW (BLINK_DEVICE_LAUNCH_CAP - BLINK_LAUNCH_HEADROOM)

/* Step kinds: policy.StepKind */
#define BLINK_STEP_IDLE 0u
#define BLINK_STEP_PREFILL 1u
#define BLINK_STEP_DECODE 2u

/* blink_req_t.status */
#define BLINK_REQ_FREE 0u
#define BLINK_REQ_WAITING 1u
#define BLINK_REQ_RUNNING 2u
#define BLINK_REQ_FINISHED 3u        /* completed in the ring this iteration; dropped by the schedule phase */

/* blink_sched_control_t.exit_code */
#define BLINK_EXIT_NONE 0u
#define BLINK_EXIT_SHUTDOWN 1u       /* stop/abort/ring shutdown: every request ended, scheduler gone */
#define BLINK_EXIT_RELAUNCH 2u       /* window full: a fresh instance was tail-launched */
#define BLINK_EXIT_STEP_TIMEOUT 3u   /* a step graph never signalled completion */
#define BLINK_EXIT_LAUNCH_FAILED 4u  /* the tail relaunch itself failed */

typedef struct BLINK_ALIGN8 blink_policy_config {
    uint32_t max_batch_size;      /* running requests (seats) at most */
    uint32_t max_prefill_tokens;  /* tokens in one PREFILL step at most */
    uint32_t block_size;          /* tokens per KV block */
    uint32_t num_blocks;          /* KV pool size in blocks */
    uint32_t max_model_len;       /* prompt + output tokens at most */
    uint32_t vocab_size;          /* prompt token ids must be below this */
    uint32_t n_eos;               /* used entries of eos_ids (end a request unless ignore_eos) */
    int32_t eos_ids[BLINK_MAX_EOS_IDS];
    uint32_t reserved;            /* zero; pads the struct to 8 bytes */
} blink_policy_config_t;

/* policy.SchedPolicy */
#define BLINK_POLICY_FCFS 0u
#define BLINK_POLICY_PRIORITY 1u
#define BLINK_POLICY_LVF 2u

/* PolicyConfig's policy fields and PolicyInput.now_us. */
typedef struct blink_sched_rules {
    uint32_t policy;              /* BLINK_POLICY_* */
    uint32_t lvf_alpha_milli;     /* alpha x 1000 */
    int32_t lvf_beta_b_milli;     /* beta_B x 1000 (rotary tolerance, in TBT SLOs) */
    int32_t lvf_beta_f_milli;     /* beta_F x 1000 (waiting tolerance, in TTFT SLOs) */
    uint32_t lvf_xfer_blocks;     /* B_xfer */
    uint32_t reserved;
    int64_t now_us;               /* the scheduler's clock */
} blink_sched_rules_t;

/* What rule 0 reads of a request besides its blink_req_t (WaitingReq / RunningReq fields). */
typedef struct blink_req_time {
    uint32_t id;                  /* the tie key (the slot on the device) */
    int32_t priority;             /* lower first */
    int64_t arrival_us;
    int64_t last_us;              /* latest token's time, -1: none yet (waiting: not rotary) */
    int64_t run_us;               /* running: when it last entered the running list */
    int64_t ttft_slo_us, tbt_slo_us;
} blink_req_time_t;

/* One claimed request: copied out of its slot at the claim, then the
 * scheduler's progress. num_tokens = prompt_len + generated. */
typedef struct BLINK_ALIGN8 blink_req {
    uint64_t seq;                 /* the frontend's request sequence number */
    uint64_t epoch;               /* frontend epoch of the submitter */
    uint32_t prompt_offset, prompt_len, output_offset, max_tokens;
    uint32_t flags;               /* BLINK_FLAG_* */
    uint32_t n_stop;              /* used entries of stop_ids */
    int32_t stop_ids[BLINK_MAX_STOP_IDS];
    uint32_t generated;           /* tokens published (== len(output)) */
    uint32_t num_computed;        /* tokens whose K/V is cached */
    uint32_t num_blocks;          /* KV blocks held */
    uint32_t status;              /* BLINK_REQ_* */
    uint32_t ring_state;          /* the slot state this scheduler last wrote */
    uint32_t abort_finish;        /* set by the scan: cancel flag or stale epoch -> reaped next */
    uint32_t abort_error;
    uint32_t intake_error;        /* scratch of the intake phase: FinishReason << 16 | ErrorCode */
    float temperature;            /* sampling parameters, copied at intake (the step graph reads them) */
    float top_p;
    int32_t top_k;
    uint32_t reserved;
    uint64_t seed;                /* the slot's seed, or one derived at intake when it has none */
    float min_p;                  /* the rest of the sampling surface, copied at intake (staged per row) */
    float presence_penalty;
    float frequency_penalty;
    float repetition_penalty;     /* 0 or 1: off */
    uint32_t min_tokens;          /* mask_stops are masked while fewer tokens were generated */
    uint32_t n_mask_stops;        /* used entries of mask_stops */
    int32_t mask_stops[BLINK_ROW_STOPS];   /* stop ids + EOS ids unless ignore_eos (the sampler's min_tokens mask) */
    uint32_t logprobs;            /* top entries of each generated token's record (with BLINK_FLAG_LOGPROBS) */
    uint32_t logprobs_offset;     /* first word of its records in the logprob arena */
    uint32_t seat;                /* sampler seat (graphs/sampler.SeatState) or BLINK_NO_SEAT */
    uint32_t seat_fresh;          /* 1: the seat was taken at admission; the staging fills it at the next sample */
    uint32_t extra_offset;        /* the slot's sampling data in the prompt arena (checked at intake) */
    uint32_t n_logit_bias, n_allowed_ids, bad_words_words;
    uint32_t automaton_words;     /* structured output: words of its token automaton (0: free text; automaton.h) */
    uint32_t automaton_offset;    /* its first word in the prompt arena (after the other sampling data) */
    int32_t automaton_state;      /* current state; -1: not stepped yet (the initial state) */
    uint32_t reserved2;
    uint32_t num_cached;          /* waiting: leading tokens in prefix-cache blocks (block-aligned; the plan's hit) */
    uint32_t cached_idle;         /* waiting: of those blocks, the ones no request holds (policy.WaitingReq) */
    uint32_t num_committed;       /* running: leading blocks offered to the prefix cache */
    uint32_t n_keys;              /* prefix-cache keys of its full blocks computed so far (kv_keys) */
    uint32_t key_pos;             /* tokens hashed so far (sched_loop.h blink_key_feed): keys for the full blocks
                                     among them, key_run for the block they end in */
    uint32_t reserved3;
    uint64_t key_run;             /* the hash chain's state over tokens [n_keys * block_size, key_pos) */
} blink_req_t;

typedef struct BLINK_ALIGN8 blink_sched_state {
    uint32_t w_head;              /* waiting deque: first entry at waiting[w_head] */
    uint32_t w_count;             /* entries in the deque (capacity slot_count) */
    uint32_t n_running;           /* running[0..n_running), admission order */
    uint32_t free_blocks;         /* KV blocks no request holds */
    uint32_t prev_kind;           /* kind of the last launched step */
    uint32_t in_flight;           /* 1: a step was launched and its tokens are not yet published */
    uint32_t step_no;             /* steps launched so far; the step graph stores it into *done */
    uint32_t n_chunks;            /* chunks of the step in flight */
    uint32_t draining;            /* stop seen: no new claims; abort what is left at drain_deadline_ns */
    uint32_t started;             /* 1 once the first instance initialised this state */
    uint32_t n_rows;              /* rows of the step in flight (row_* buffers) */
    uint32_t graph;               /* graph id of the step in flight */
    uint64_t drain_deadline_ns;
    uint64_t last_beat_ns;
    uint64_t step_launched_ns;    /* clock when the step in flight was launched */
    uint32_t plan_stamp;          /* plans made so far: marks the cached blocks one plan counted idle */
    uint32_t scan_valid;          /* 1 once a scan recorded scan_bell / scan_epoch / scan_ns */
    uint64_t scan_bell;           /* the header's frontend_doorbell when the last slot scan began */
    uint64_t scan_epoch;          /* the header's frontend_epoch then (requests were checked against it) */
    uint64_t scan_ns;             /* the clock then */
    uint32_t fast_checked;        /* fast plans checked against the full walks so far (sched_loop.h) */
    uint32_t fast_plan_off;       /* 1: a check disagreed; the full walks plan every step from then on */
    uint32_t commit_checked;      /* parallel commits checked against thread 0's walk so far (sched_loop.h) */
    uint32_t evict_checked;       /* parallel evictions whose table was checked so far (sched_loop.h) */
    uint32_t admit_checked;       /* admissions planned from the survey checked against the full planner so far */
    uint32_t reserved_state;
} blink_sched_state_t;

/* Host-mapped pinned memory: the host writes stop/abort, the device the rest.
 * The device keeps its counters in a device-memory copy (params.stats) and
 * copies them here at every heartbeat: a read-modify-write of host memory
 * would cost a PCIe round trip per counter. */
#define BLINK_LAST_COUNTER pub_keys_ns   /* blink_sched_control_t's last u64 counter */
typedef struct BLINK_ALIGN8 blink_sched_control {
    uint32_t stop;                /* host: stop claiming, finish in-flight work within the grace period */
    uint32_t abort;               /* host: end every request ABORT/BACKEND_SHUTDOWN now and exit */
    uint32_t running;             /* device: 1 while a scheduler instance runs */
    uint32_t exit_code;           /* device: BLINK_EXIT_* of the last instance */
    uint64_t heartbeat;           /* device: bumped with the ring's backend_heartbeat */
    uint64_t iterations;          /* scheduler loop iterations */
    uint64_t windows;             /* scheduler instances (1 + tail relaunches) */
    uint64_t launches;            /* step graphs launched fire-and-forget */
    uint64_t launch_retries;      /* device launches refused (previous launch of that graph still running) */
    uint64_t steps_prefill, steps_decode;
    uint64_t tokens;              /* tokens published */
    uint64_t claimed;             /* slots claimed */
    uint64_t completed;           /* slots completed (any finish reason) */
    uint64_t preempted;
    uint64_t scan_ns;             /* cumulative time in the slot scan */
    uint64_t scans;
    uint64_t wait_ns;             /* cumulative time waiting for step graphs */
    uint64_t publish_ns;          /* cumulative time publishing tokens */
    uint64_t plan_ns;             /* cumulative time planning + launching */
    uint64_t launch_ns;           /* cumulative time inside the launch call */
    uint64_t fallback_steps;      /* steps served by a kind's max-shape graph (no tighter graph covered them) */
    uint64_t prefix_hit_tokens;   /* admitted tokens found in the prefix cache (scheduler.PrefixStats) */
    uint64_t prefix_miss_tokens;
    uint64_t prefix_hit_blocks;
    uint64_t prefix_miss_blocks;
    /* plan_ns of the launched steps in parts: commit + reap walks, the policy (prefix lookups
     * included), applying it (preempt, admit, allocate, chunks), the graph's key, lookup and rows */
    uint64_t reap_ns, policy_ns, apply_ns, rows_ns;
    uint64_t fast_plans;          /* decode steps planned from the survey's counts (sched_loop.h blink_fast_plan) */
    uint64_t fast_plan_mismatches; /* the CPU twin only: fast plans, survey reaps and fill-phase blocks the full
                                      planner, the reap's walk and blink_pkv_alloc, run beside them, disagreed with */
    uint64_t fill_blocks;         /* KV blocks the fill phase took in parallel (sched_loop.h blink_fill_block) */
    uint64_t par_commits;         /* blocks the commit phase put in the prefix cache in parallel (blink_phase_commit) */
    uint64_t commit_ns;           /* cumulative time in the commit phase (not in publish_ns; the walk's is in reap_ns) */
    uint64_t fill_evictions;      /* of fill_blocks, cached blocks the fill phase evicted (LRU order, keys removed in parallel) */
    uint64_t fast_admits;         /* prefill steps admitting waiting requests planned from the survey's counts (blink_fast_admit) */
    uint64_t pub_keys_ns;         /* of publish_ns: per step the longest any thread spent reading block keys' tokens
                                     back from the ring (blink_keys_ahead: 0 while the key chain keeps up with the
                                     tokens), summed over the steps */
    /* a new counter goes above this line and into BLINK_LAST_COUNTER: the beat copies the counters
     * heartbeat..BLINK_LAST_COUNTER to the host's control block (structs.COUNTERS) */
    int32_t last_launch_error;    /* cudaError_t of the last refused launch */
    uint32_t max_window_launches; /* most launch attempts any one instance made (<= BLINK_DEVICE_LAUNCH_CAP) */
} blink_sched_control_t;

/* The one argument of every kernel; lives in device memory. */
typedef struct BLINK_ALIGN8 blink_sched_params {
    uint8_t *ring;                /* ring base as the scheduler sees it (header at 0) */
    uint64_t slot_count, prompt_arena_tokens, output_arena_tokens;
    uint64_t slots_offset, prompt_arena_offset, output_arena_offset;
    uint64_t logprob_arena_offset, logprob_arena_words;
    blink_req_t *reqs;            /* [slot_count] */
    uint32_t *waiting;            /* [slot_count] deque of slot ids */
    uint32_t *running;            /* [max_batch_size] slot ids, admission order */
    uint32_t *arrivals;           /* [slot_count] scratch: slots claimed by one scan */
    uint32_t *chunk_slot;         /* [max_batch_size] step descriptor: slot of each chunk */
    uint32_t *chunk_start;        /* [max_batch_size] first position computed */
    uint32_t *chunk_len;          /* [max_batch_size] tokens computed */
    uint32_t *chunk_sample;       /* [max_batch_size] 1: the chunk ends its sequence, sample a token */
    int32_t *step_tokens;         /* [max_batch_size] the step graph's sampled token per chunk */
    uint32_t *done;               /* the step graph's completion flag: step_no of the last finished step */
    uint32_t *plan_scratch;       /* [14 * max_batch_size] the planner's seven output lists, publish's commit
                                     list, the survey's needy lists (sched_loop.h blink_scratch_list) */
    uint32_t *row_slot;           /* [max_rows] the step's rows: slot (or compact index) of each row */
    uint32_t *row_start;          /* [max_rows] position of the row's first token */
    uint32_t *row_len;            /* [max_rows] tokens in the row */
    uint32_t *row_flags;          /* [max_rows] chunk index | BLINK_ROW_SAMPLE (| BLINK_ROW_LOGPROBS: host loop) */
    uint32_t *kv_free_stack;      /* [num_blocks] kv_alloc.h */
    uint32_t *kv_owner;           /* [num_blocks] */
    uint32_t *kv_tables;          /* [slot_count * kv_max_blocks] block table of each slot */
    uint32_t *seat_owner;         /* [n_seats] slot + 1 of the running request holding each seat; 0: free */
    blink_sched_state_t *state;
    blink_sched_control_t *control;   /* host-mapped: the host reads it without CUDA calls */
    blink_sched_control_t *stats;     /* device memory: counters accumulate here, copied to control at each beat */
    blink_graph_table_t graphs;   /* the step graphs, instantiated for device launch, and their lookup tables */
    blink_policy_config_t policy;
    uint32_t window_limit;        /* launch attempts after which an instance rolls over (<= BLINK_MAX_WINDOW) */
    uint32_t n_seats;             /* sampler seats of the step graphs (seat_owner entries); 0: none */
    uint32_t idle_sleep_ns;       /* back-off when a scan found nothing and no step runs */
    uint32_t launch_retry_limit;  /* refused device launches retried this often before giving up */
    uint32_t kv_max_blocks;       /* blocks one slot's table holds (one max_model_len context) */
    uint32_t full_scan_us;        /* 0: scan every slot each iteration; else only when the frontend
                                     doorbell or epoch moved, and at least this often (a safety net) */
    uint64_t beat_interval_ns;    /* heartbeat period */
    uint64_t grace_ns;            /* drain period after a stop before the rest is aborted */
    uint64_t step_timeout_ns;     /* a step graph silent this long ends the scheduler */
    int64_t clock_offset_ns;      /* device %globaltimer + offset = host CLOCK_MONOTONIC */
    /* scheduling policy and prefix caching (the daemon's --scheduling-policy, prefix caching) */
    blink_sched_rules_t rules;    /* policy and LVF weights; now_us is set at every plan */
    blink_req_time_t *times;      /* [slot_count] what rule 0 reads of each request (priority, clocks, SLOs) */
    uint32_t *plan_w_out;         /* [slot_count] blink_plan_step_policy's scratch: waiting order */
    uint32_t *plan_r_out;         /* [max_batch_size] running order */
    uint32_t *plan_victims;       /* [max_batch_size] */
    uint32_t *plan_lid;           /* [slot_count + max_batch_size] */
    int64_t *plan_lkey;           /* [slot_count + max_batch_size] */
    blink_pkv_t *pkv;             /* [1] the prefix-caching allocator (kv_alloc.h), set up by the first instance */
    uint32_t *pkv_refs;           /* [num_blocks] its arrays (the free stack is kv_free_stack) */
    uint64_t *pkv_key;            /* [num_blocks] */
    uint32_t *pkv_has_key;        /* [num_blocks] */
    uint32_t *pkv_lru_prev;       /* [num_blocks] */
    uint32_t *pkv_lru_next;       /* [num_blocks] */
    uint64_t *pkv_table_key;      /* [pkv_table_cap] */
    uint32_t *pkv_table_block;    /* [pkv_table_cap] */
    uint32_t *pkv_claimed;        /* [num_blocks] plan_stamp of the plan that counted the block idle */
    uint64_t *kv_keys;            /* [slot_count * kv_max_blocks] prefix-cache keys of each slot's full blocks */
    uint32_t pkv_table_cap;       /* power of two >= 2 * num_blocks */
    uint32_t prefix_caching;      /* 1: admission looks up cached prefix blocks, full blocks are committed */
    int64_t ttft_slo_us;          /* a request's targets when its slot says 0 */
    int64_t tbt_slo_us;
    uint32_t fast_plan;           /* 1: steady decode steps are planned from the survey (sched_loop.h); 0: the A/B */
    uint32_t fast_plan_checks;    /* fast plans checked against the full walks before one is trusted (0xffffffff: all) */
    uint32_t shared_state;        /* 1: an instance keeps these params, state, stats and pkv in the block's shared
                                     memory (sched_loop.h blink_local_params); 0: here, in device memory (the A/B) */
    uint32_t reserved_params0;
    const struct blink_sched_params *home;   /* set in the shared copy only: the device-memory params it came
                                                from, whose state / stats / pkv it writes back (0 here) */
} blink_sched_params_t;

static inline BLINK_HD blink_slot_t *blink_slot_ptr(const blink_sched_params_t *p, uint64_t i) {
    return (blink_slot_t *)(p->ring + p->slots_offset + i * sizeof(blink_slot_t));
}
static inline BLINK_HD blink_ring_header_t *blink_header_ptr(const blink_sched_params_t *p) {
    return (blink_ring_header_t *)p->ring;
}
static inline BLINK_HD int32_t *blink_prompt_arena(const blink_sched_params_t *p) {
    return (int32_t *)(p->ring + p->prompt_arena_offset);
}
static inline BLINK_HD int32_t *blink_output_arena(const blink_sched_params_t *p) {
    return (int32_t *)(p->ring + p->output_arena_offset);
}
static inline BLINK_HD int32_t *blink_logprob_arena(const blink_sched_params_t *p) {
    return (int32_t *)(p->ring + p->logprob_arena_offset);
}
static inline BLINK_HD blink_kv_t blink_kv_of(const blink_sched_params_t *p) {
    blink_kv_t kv = {p->kv_free_stack, p->kv_owner, p->kv_tables, p->policy.num_blocks, p->kv_max_blocks,
                     (uint32_t)p->slot_count, 0};
    return kv;
}

#endif /* BLINK_SCHED_TYPES_H */
