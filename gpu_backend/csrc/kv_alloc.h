/* The KV block allocator, as plain host+device C: the device's twin of
 * gpu_backend/scheduler/kv_cache.py (BlockAllocator) plus the per-slot block tables the
 * engine keeps on its Sequences. It lives in global memory next to the
 * scheduler's queues, so it survives tail relaunches, and only the
 * scheduler's thread 0 changes it (the schedule phase): no atomics.
 *
 *   free_stack[0 .. *free_count)   free block ids; the next one handed out is
 *                                  free_stack[*free_count - 1] (LIFO, as the
 *                                  Python free list's pop(): 0, 1, 2, ... first)
 *   owner[block]                   row + 1 of the table holding it, 0 = free
 *   tables[row * max_blocks + j]   block j of row `row` (a ring slot); a row
 *                                  holds `held` blocks, the caller counts them
 *                                  (blink_req_t.num_blocks)
 *
 *   prefill / block boundary -> blink_kv_alloc(row, held, n)  appends n blocks
 *   finish / cancel / preempt -> blink_kv_free(row, held)     returns them, last first
 *
 * Freed blocks go back in reverse table order, so the row's first block is
 * reused first, exactly as BlockAllocator.free does (the diff test replays
 * random sequences against it: tests/gpu_backend/cuda/test_kv_alloc.py).
 * The free count is a pointer so the scheduler keeps it where the policy reads
 * it (blink_sched_state_t.free_blocks).
 */
#ifndef BLINK_KV_ALLOC_H
#define BLINK_KV_ALLOC_H

#include "blink_ring_layout.h"

#define BLINK_KV_OK 0
#define BLINK_KV_NO_BLOCKS 1      /* fewer free blocks than asked: nothing taken */
#define BLINK_KV_TABLE_FULL 2     /* the row's table cannot hold that many blocks: nothing taken */
#define BLINK_KV_NOT_OWNED 3      /* a block in the table is not held by this row (double free): nothing freed */
#define BLINK_KV_BAD_ROW 4

typedef struct BLINK_ALIGN8 blink_kv {
    uint32_t *free_stack;         /* [num_blocks] */
    uint32_t *owner;              /* [num_blocks] row + 1, 0 = free */
    uint32_t *tables;             /* [rows * max_blocks] */
    uint32_t num_blocks;          /* pool size in blocks */
    uint32_t max_blocks;          /* blocks one row can hold (one max_model_len context) */
    uint32_t rows;                /* table rows (ring slots) */
    uint32_t reserved;
} blink_kv_t;

/* Every block free, handed out in the order 0, 1, 2, ... */
static inline BLINK_HD void blink_kv_init(const blink_kv_t *kv, uint32_t *free_count) {
    for (uint32_t i = 0; i < kv->num_blocks; ++i) {
        kv->free_stack[i] = kv->num_blocks - 1 - i;
        kv->owner[i] = 0;
    }
    *free_count = kv->num_blocks;
}

/* Append `n` blocks to `row`'s table, which holds `held` now. */
static inline BLINK_HD int blink_kv_alloc(const blink_kv_t *kv, uint32_t *free_count, uint32_t row, uint32_t held,
                                          uint32_t n) {
    if (row >= kv->rows) return BLINK_KV_BAD_ROW;
    if (n > *free_count) return BLINK_KV_NO_BLOCKS;
    if ((uint64_t)held + n > kv->max_blocks) return BLINK_KV_TABLE_FULL;
    uint32_t *table = kv->tables + (uint64_t)row * kv->max_blocks;
    for (uint32_t k = 0; k < n; ++k) {
        const uint32_t b = kv->free_stack[--*free_count];
        kv->owner[b] = row + 1;
        table[held + k] = b;
    }
    return BLINK_KV_OK;
}

/* Return the `held` blocks of `row`'s table, last first (the first block ends on top). */
static inline BLINK_HD int blink_kv_free(const blink_kv_t *kv, uint32_t *free_count, uint32_t row, uint32_t held) {
    if (row >= kv->rows || held > kv->max_blocks) return BLINK_KV_BAD_ROW;
    const uint32_t *table = kv->tables + (uint64_t)row * kv->max_blocks;
    for (uint32_t j = 0; j < held; ++j) {             /* check everything before changing anything */
        const uint32_t b = table[j];
        if (b >= kv->num_blocks || kv->owner[b] != row + 1) return BLINK_KV_NOT_OWNED;
    }
    for (uint32_t j = held; j-- > 0;) {
        const uint32_t b = table[j];
        kv->owner[b] = 0;
        kv->free_stack[(*free_count)++] = b;
    }
    return BLINK_KV_OK;
}

/* Consistency of the free stack with the owner array: 0 when every block is
 * either on the stack exactly once and unowned, or owned and not on it.
 * O(num_blocks); for tests and the twin, never on the device's hot path. */
static inline BLINK_HD int blink_kv_check(const blink_kv_t *kv, uint32_t free_count, uint32_t *scratch /* [num_blocks] */) {
    if (free_count > kv->num_blocks) return 1;
    for (uint32_t i = 0; i < kv->num_blocks; ++i) scratch[i] = 0;
    for (uint32_t i = 0; i < free_count; ++i) {
        const uint32_t b = kv->free_stack[i];
        if (b >= kv->num_blocks || scratch[b] || kv->owner[b]) return 2;
        scratch[b] = 1;
    }
    uint32_t owned = 0;
    for (uint32_t i = 0; i < kv->num_blocks; ++i) owned += kv->owner[i] != 0;
    return owned + free_count == kv->num_blocks ? 0 : 3;
}

#endif /* BLINK_KV_ALLOC_H */
