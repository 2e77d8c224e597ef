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
 *
 * blink_pkv_*: the reference-counted allocator with automatic prefix caching,
 * the twin of scheduler/kv_cache.py's BlockAllocator (same block ids, counts,
 * lookups and evictions on the same traces: tests/gpu_backend/cuda/test_kv_prefix.py).
 *
 *   free_stack[0 .. never_cached)   free blocks that hold no cache entry (LIFO)
 *   refs[block]                     holders (0: free or evictable)
 *   key[block], has_key[block]      the key a full, computed block is committed under
 *   lru_prev / lru_next [block]     evictable blocks (cached, no holder), LRU first
 *   table_key / table_block [cap]   key -> block, open addressing with linear probing,
 *                                   backward-shift deletion (no tombstones); cap is a
 *                                   power of two >= 2 * num_blocks
 *
 *   lookup(keys) -> the cached blocks of the longest run of leading keys present
 *   take(blocks)  one more holder each; an evictable block leaves the LRU list
 *   alloc(n)      never-cached blocks first, then the LRU evictable ones (key dropped)
 *   commit(b, k)  a held, full block enters the cache unless it or k is there already
 *   free(blocks)  last first; a block whose last holder leaves goes to the LRU tail
 *                 when it has a key, else back on the free stack
 *
 * blink_block_hash is the key chain of kv_cache.block_hash: splitmix64 steps over
 * the parent key and each token id. Only the scheduler's thread 0 calls these.
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

/* ---- the prefix-caching allocator ---------------------------------------------------- */

#define BLINK_KV_NIL 0xFFFFFFFFu
#define BLINK_KV_TOMB 0xFFFFFFFEu     /* a table entry marked for deletion by the parallel evictions (sched_loop.h) */
#define BLINK_KV_NOT_CACHED 5         /* take of a block with no key: nothing taken */
#define BLINK_KV_ROOT_HASH 0x424C494E4B4B5643ull   /* kv_cache.ROOT_HASH */

typedef struct BLINK_ALIGN8 blink_pkv {
    uint32_t *free_stack;         /* [num_blocks] never-cached free blocks; top = free_stack[never_cached - 1] */
    uint32_t *refs;               /* [num_blocks] */
    uint64_t *key;                /* [num_blocks] */
    uint32_t *has_key;            /* [num_blocks] */
    uint32_t *lru_prev;           /* [num_blocks] */
    uint32_t *lru_next;           /* [num_blocks] */
    uint64_t *table_key;          /* [table_cap] */
    uint32_t *table_block;        /* [table_cap] BLINK_KV_NIL = empty */
    uint32_t num_blocks;
    uint32_t table_cap;           /* power of two >= 2 * num_blocks */
    uint32_t never_cached;        /* entries on free_stack */
    uint32_t evictable;           /* entries on the LRU list */
    uint32_t lru_head, lru_tail;  /* least / most recently used evictable block */
    uint32_t extra_refs;          /* sum over blocks of (refs - 1) */
    uint32_t cached;              /* blocks with a key */
    uint32_t evictions;
    uint32_t reserved;
} blink_pkv_t;

static inline BLINK_HD uint64_t blink_kv_mix64(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* kv_cache.block_hash: the key of a full block from its parent's key and its tokens. */
static inline BLINK_HD uint64_t blink_block_hash(uint64_t parent, const int32_t *tokens, uint32_t n) {
    uint64_t h = blink_kv_mix64(parent + 0x9E3779B97F4A7C15ull);
    for (uint32_t i = 0; i < n; ++i) h = blink_kv_mix64((h ^ (uint64_t)(uint32_t)tokens[i]) + 0x9E3779B97F4A7C15ull);
    return h;
}

static inline BLINK_HD void blink_pkv_init(blink_pkv_t *p) {
    for (uint32_t i = 0; i < p->num_blocks; ++i) {
        p->free_stack[i] = p->num_blocks - 1 - i;
        p->refs[i] = 0;
        p->has_key[i] = 0;
        p->lru_prev[i] = p->lru_next[i] = BLINK_KV_NIL;
    }
    for (uint32_t i = 0; i < p->table_cap; ++i) p->table_block[i] = BLINK_KV_NIL;
    p->never_cached = p->num_blocks;
    p->evictable = p->extra_refs = p->cached = p->evictions = 0;
    p->lru_head = p->lru_tail = BLINK_KV_NIL;
}

static inline BLINK_HD uint32_t blink_pkv_free_count(const blink_pkv_t *p) { return p->never_cached + p->evictable; }

static inline BLINK_HD uint32_t blink_pkv_find(const blink_pkv_t *p, uint64_t k) {
    const uint32_t mask = p->table_cap - 1;
    for (uint32_t i = (uint32_t)k & mask;; i = (i + 1) & mask) {
        const uint32_t b = p->table_block[i];
        if (b == BLINK_KV_NIL) return BLINK_KV_NIL;
        if (p->table_key[i] == k) return b;
    }
}

static inline BLINK_HD void blink_pkv_table_put(blink_pkv_t *p, uint64_t k, uint32_t b) {
    const uint32_t mask = p->table_cap - 1;
    uint32_t i = (uint32_t)k & mask;
    while (p->table_block[i] != BLINK_KV_NIL) i = (i + 1) & mask;
    p->table_key[i] = k;
    p->table_block[i] = b;
}

/* Remove the entry at index i: backward-shift the run after it so every probe still ends at a gap.
 * Entries only move within the run (up to its first gap). */
static inline BLINK_HD void blink_pkv_table_del_at(blink_pkv_t *p, uint32_t i) {
    const uint32_t mask = p->table_cap - 1;
    for (uint32_t j = (i + 1) & mask; p->table_block[j] != BLINK_KV_NIL; j = (j + 1) & mask) {
        const uint32_t home = (uint32_t)p->table_key[j] & mask;
        /* entry j may move into the gap at i when its home is not cyclically in (i, j] */
        if (((j - home) & mask) >= ((j - i) & mask)) {
            p->table_key[i] = p->table_key[j];
            p->table_block[i] = p->table_block[j];
            i = j;
        }
    }
    p->table_block[i] = BLINK_KV_NIL;
}

/* Remove key k (present). */
static inline BLINK_HD void blink_pkv_table_del(blink_pkv_t *p, uint64_t k) {
    const uint32_t mask = p->table_cap - 1;
    uint32_t i = (uint32_t)k & mask;
    while (p->table_key[i] != k || p->table_block[i] == BLINK_KV_NIL) i = (i + 1) & mask;
    blink_pkv_table_del_at(p, i);
}

/* Thread tid of nt's share of blink_pkv_table_check (entries tid, tid + nt, ... of the table, blocks
 * likewise): 0, or the rule one broke (1: an entry not its block's key, or a mark left; 3: a keyed
 * block its key does not find); *entries counts the entries it saw. */
static inline BLINK_HD int blink_pkv_table_check_part(const blink_pkv_t *p, uint32_t tid, uint32_t nt,
                                                      uint32_t *entries) {
    *entries = 0;
    for (uint32_t i = tid; i < p->table_cap; i += nt) {
        const uint32_t b = p->table_block[i];
        if (b == BLINK_KV_NIL) continue;
        if (b >= p->num_blocks || !p->has_key[b] || p->key[b] != p->table_key[i]) return 1;
        ++*entries;
    }
    for (uint32_t b = tid; b < p->num_blocks; b += nt)
        if (p->has_key[b] && blink_pkv_find(p, p->key[b]) != b) return 3;
    return 0;
}

/* 0 when the table holds exactly the keyed blocks, each under its key and found by it (no entry
 * marked for deletion left); else which rule failed (2: the count is not `cached`). O(table_cap +
 * num_blocks): tests, and in parts by every thread, the scheduler's check of its parallel evictions. */
static inline BLINK_HD int blink_pkv_table_check(const blink_pkv_t *p) {
    uint32_t entries;
    const int bad = blink_pkv_table_check_part(p, 0, 1, &entries);
    return bad ? bad : entries == p->cached ? 0 : 2;
}

/* The table rebuilt from the blocks' own keys (distinct: a key enters only where the table lacks
 * it), after a check of the parallel evictions failed: the scheduler heals itself. */
static inline BLINK_HD void blink_pkv_table_rebuild(blink_pkv_t *p) {
    for (uint32_t i = 0; i < p->table_cap; ++i) p->table_block[i] = BLINK_KV_NIL;
    p->cached = 0;
    for (uint32_t b = 0; b < p->num_blocks; ++b)
        if (p->has_key[b]) {
            blink_pkv_table_put(p, p->key[b], b);
            ++p->cached;
        }
}

static inline BLINK_HD void blink_pkv_lru_unlink(blink_pkv_t *p, uint32_t b) {
    const uint32_t pr = p->lru_prev[b], nx = p->lru_next[b];
    if (pr != BLINK_KV_NIL) p->lru_next[pr] = nx; else p->lru_head = nx;
    if (nx != BLINK_KV_NIL) p->lru_prev[nx] = pr; else p->lru_tail = pr;
    p->lru_prev[b] = p->lru_next[b] = BLINK_KV_NIL;
    --p->evictable;
}

static inline BLINK_HD void blink_pkv_lru_append(blink_pkv_t *p, uint32_t b) {
    p->lru_prev[b] = p->lru_tail;
    p->lru_next[b] = BLINK_KV_NIL;
    if (p->lru_tail != BLINK_KV_NIL) p->lru_next[p->lru_tail] = b; else p->lru_head = b;
    p->lru_tail = b;
    ++p->evictable;
}

/* `n` blocks into out[0..n); BLINK_KV_NO_BLOCKS (nothing taken) when fewer are free. */
static inline BLINK_HD int blink_pkv_alloc(blink_pkv_t *p, uint32_t n, uint32_t *out) {
    if (n > blink_pkv_free_count(p)) return BLINK_KV_NO_BLOCKS;
    for (uint32_t k = 0; k < n; ++k) {
        uint32_t b;
        if (p->never_cached) {
            b = p->free_stack[--p->never_cached];
        } else {
            b = p->lru_head;
            blink_pkv_lru_unlink(p, b);
            blink_pkv_table_del(p, p->key[b]);
            p->has_key[b] = 0;
            --p->cached;
            ++p->evictions;
        }
        p->refs[b] = 1;
        out[k] = b;
    }
    return BLINK_KV_OK;
}

/* The LRU's first n blocks (n <= evictable) unlinked in order into out, keys dropped: the blocks n
 * evictions of blink_pkv_alloc would take, but for their keys' table entries, which the caller removes
 * (blink_pkv_table_del, or in parallel: sched_loop.h blink_evict_keys). One dependent load a block. */
static inline BLINK_HD void blink_pkv_lru_pop(blink_pkv_t *p, uint32_t n, uint32_t *out) {
    uint32_t b = p->lru_head;
    for (uint32_t i = 0; i < n; ++i) {
        out[i] = b;
        const uint32_t next = p->lru_next[b];
        p->lru_prev[b] = p->lru_next[b] = BLINK_KV_NIL;
        p->has_key[b] = 0;
        b = next;
    }
    if (n == 0) return;
    p->lru_head = b;
    if (b != BLINK_KV_NIL) p->lru_prev[b] = BLINK_KV_NIL;
    else p->lru_tail = BLINK_KV_NIL;
    p->evictable -= n;
    p->cached -= n;
    p->evictions += n;
}

/* One more holder of each held block (a fork's shared prefix). */
static inline BLINK_HD int blink_pkv_share(blink_pkv_t *p, const uint32_t *blocks, uint32_t n) {
    for (uint32_t k = 0; k < n; ++k)
        if (blocks[k] >= p->num_blocks || !p->refs[blocks[k]]) return BLINK_KV_NOT_OWNED;
    for (uint32_t k = 0; k < n; ++k) ++p->refs[blocks[k]];
    p->extra_refs += n;
    return BLINK_KV_OK;
}

/* One holder gives `blocks` back, last first. */
static inline BLINK_HD int blink_pkv_free(blink_pkv_t *p, const uint32_t *blocks, uint32_t n) {
    for (uint32_t k = 0; k < n; ++k)
        if (blocks[k] >= p->num_blocks || !p->refs[blocks[k]]) return BLINK_KV_NOT_OWNED;
    for (uint32_t k = n; k-- > 0;) {
        const uint32_t b = blocks[k];
        if (--p->refs[b]) --p->extra_refs;
        else if (p->has_key[b]) blink_pkv_lru_append(p, b);
        else p->free_stack[p->never_cached++] = b;
    }
    return BLINK_KV_OK;
}

/* The cached blocks of the longest run of leading keys present, into out; their count. */
static inline BLINK_HD uint32_t blink_pkv_lookup(const blink_pkv_t *p, const uint64_t *keys, uint32_t n,
                                                 uint32_t *out) {
    uint32_t k = 0;
    for (; k < n; ++k) {
        const uint32_t b = blink_pkv_find(p, keys[k]);
        if (b == BLINK_KV_NIL) break;
        out[k] = b;
    }
    return k;
}

/* One more holder of each cached block (from lookup); an evictable one leaves the LRU list. */
static inline BLINK_HD int blink_pkv_take(blink_pkv_t *p, const uint32_t *blocks, uint32_t n) {
    for (uint32_t k = 0; k < n; ++k)
        if (blocks[k] >= p->num_blocks || !p->has_key[blocks[k]]) return BLINK_KV_NOT_CACHED;
    for (uint32_t k = 0; k < n; ++k) {
        const uint32_t b = blocks[k];
        if (p->refs[b]) ++p->extra_refs;
        else blink_pkv_lru_unlink(p, b);
        ++p->refs[b];
    }
    return BLINK_KV_OK;
}

/* A held, full, computed block enters the cache under `k`: 1; 0 when it has a key already or
 * another block holds k; -1 when the block is not held. */
static inline BLINK_HD int blink_pkv_commit(blink_pkv_t *p, uint32_t b, uint64_t k) {
    if (b >= p->num_blocks || !p->refs[b]) return -1;
    if (p->has_key[b] || blink_pkv_find(p, k) != BLINK_KV_NIL) return 0;
    p->key[b] = k;
    p->has_key[b] = 1;
    blink_pkv_table_put(p, k, b);
    ++p->cached;
    return 1;
}

#endif /* BLINK_KV_ALLOC_H */
