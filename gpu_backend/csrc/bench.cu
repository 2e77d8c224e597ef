/* Kernels for bench/cuda_scheduler.py: the cost of one slot scan, of a
 * device-side fire-and-forget launch, of a tail relaunch. Linked into the same
 * module as the scheduler so they share its build and its ring layout.
 *
 *   blink_bench_scan   (1 x 256, a plain kernel)  reps x full scan -> ns per scan
 *   blink_bench_launch (1 x 1, inside a device graph) n x { launch child, wait for
 *                      its flag } -> call ns, round-trip ns, child start stamps
 *   blink_bench_child  (the launched graph's kernel) stamps %globaltimer, raises the flag
 *   blink_bench_tail   (inside a device graph) relaunches itself n times, stamping each start
 *   blink_bench_ops    (1 x 256, a plain kernel) what one step of the loop is made of, one kind at a
 *                      time, `reps` in a row by thread 0 (the barrier by all): ns each
 */
#include <cuda_runtime.h>

#include "sched_types.h"

static __device__ __forceinline__ unsigned long long blink_gt() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* One scan = what the scheduler's scan phase reads: every slot's (state, cancel) word. */
extern "C" __global__ void __launch_bounds__(256, 1)
blink_bench_scan(const blink_sched_params_t *p, unsigned long long *out_ns, unsigned reps) {
    __shared__ unsigned pending;
    for (unsigned r = 0; r < reps; ++r) {
        if (threadIdx.x == 0) pending = 0;
        __syncthreads();
        const unsigned long long t0 = blink_gt();
        unsigned mine = 0;   /* the scheduler's access pattern: 8 loads in flight per thread, then use */
        for (unsigned long long base = threadIdx.x; base < p->slot_count; base += 8ull * blockDim.x) {
            unsigned long long w[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const unsigned long long i = base + (unsigned long long)k * blockDim.x;
                w[k] = i < p->slot_count ? *(const volatile unsigned long long *)blink_slot_ptr(p, i) : 0;
            }
#pragma unroll
            for (int k = 0; k < 8; ++k) mine += (unsigned)w[k] == BLINK_PREFILL_PENDING;
        }
        atomicAdd(&pending, mine);
        __syncthreads();
        if (threadIdx.x == 0) out_ns[r] = blink_gt() - t0 + 0ull * pending;
    }
}

extern "C" __global__ void blink_bench_child(unsigned *flag, unsigned long long *start_ns) {
    const unsigned long long t = blink_gt();
    const unsigned k = *(volatile unsigned *)flag;
    start_ns[k] = t;
    __threadfence();   /* the start stamp before the flag the parent polls */
    *(volatile unsigned *)flag = k + 1;
}

/* out: [n][4] = launch call ns, launch -> flag seen ns, launch issue stamp, error code */
extern "C" __global__ void blink_bench_launch(const unsigned long long *children, unsigned n_children,
                                              unsigned *flag, unsigned long long *out, unsigned n) {
    if (threadIdx.x != 0) return;
    for (unsigned i = 0; i < n; ++i) {
        const unsigned long long t0 = blink_gt();
        cudaError_t err;
        unsigned tries = 0;
        do {
            err = cudaGraphLaunch((cudaGraphExec_t)children[i % n_children], cudaStreamGraphFireAndForget);
        } while (err != cudaSuccess && ++tries < 100000);
        const unsigned long long t1 = blink_gt();
        if (err == cudaSuccess)
            while (*(volatile unsigned *)flag != i + 1) {}
        const unsigned long long t2 = blink_gt();
        out[4 * i + 0] = t1 - t0;
        out[4 * i + 1] = t2 - t0;
        out[4 * i + 2] = t0;
        out[4 * i + 3] = (unsigned long long)err | (unsigned long long)tries << 32;
        if (err != cudaSuccess) return;
    }
}

/* counter[0] = instances so far; stamps[k] = start of instance k. */
extern "C" __global__ void blink_bench_tail(unsigned long long *counter, unsigned long long *stamps, unsigned n) {
    if (threadIdx.x != 0) return;
    const unsigned long long t = blink_gt();
    const unsigned long long k = counter[0];
    stamps[k] = t;
    counter[0] = k + 1;
    if (k + 1 < n) cudaGraphLaunch(cudaGetCurrentGraphExec(), cudaStreamGraphTailLaunch);
}

/* The operations thread 0 strings together between two steps, each `reps` times in a row (a chain:
 * every load's address depends on the load before it, as a walk of the loop's structures does),
 * timed with %globaltimer around the whole run. out[k] = ns for the reps of kind k (BLINK_OPS_*,
 * bench/cuda_scheduler.py OPS names them); dev and host: 64 zeroed words each, in device memory and
 * host-mapped. */
enum {
    BLINK_OPS_CLOCK,            /* a 64-bit %globaltimer read (the loop reads it around each phase) */
    BLINK_OPS_LD_DEV,           /* a plain load of device memory (L1 once warm) */
    BLINK_OPS_LD_DEV_VOLATILE,  /* a volatile load of device memory (to L2) */
    BLINK_OPS_LD_DEV_CTA,       /* a relaxed block-scope load (ld_blk32) */
    BLINK_OPS_ST_LD_DEV,        /* a plain store, then a plain load of the word (a counter's `+= 1`: L1 or L2?) */
    BLINK_OPS_LD_SHARED,        /* a load of shared memory (a chain, as above) */
    BLINK_OPS_LD_SHARED_GENERIC, /* the same through a generic pointer (shared_state's state, stats, pkv) */
    BLINK_OPS_LD_HOST,          /* a volatile load of host-mapped memory (a ring word over PCIe) */
    BLINK_OPS_ST_HOST_FENCE_SYS,    /* a volatile host-mapped store + __threadfence_system (publish, per token) */
    BLINK_OPS_ST_DEV_FENCE_SYS, /* the same with the word in device memory (the DPU's ring) */
    BLINK_OPS_FENCE_SYS,        /* __threadfence_system with no store pending */
    BLINK_OPS_FENCE_DEV,        /* __threadfence after a device-memory store */
    BLINK_OPS_SYNC,             /* __syncthreads of the 256 threads (the loop has ~8 an iteration) */
    BLINK_OPS_ATOMIC_SHARED,    /* atomicAdd_block on shared memory, thread 0 alone (a chain: each address from
                                   the value the one before returned) */
    BLINK_OPS_ST_HOST_FENCE_ACQREL_SYS, /* a volatile host-mapped store + fence.acq_rel.sys (MEMBAR.ALL.SYS, not .SC) */
    BLINK_OPS_FENCE_ACQREL_SYS, /* fence.acq_rel.sys with no store pending */
    BLINK_OPS_FENCE_ACQREL_DEV, /* a device-memory store + fence.acq_rel.gpu (MEMBAR.ALL.GPU) */
    BLINK_OPS_ST_RELEASE_HOST,  /* st.release.sys to host-mapped memory (a release store, no separate fence) */
    BLINK_OPS_LD_ACQUIRE_DEV,   /* ld.acquire.gpu of device memory, a chain (an acquire load, no separate fence) */
    BLINK_OPS_N
};

extern "C" __global__ void __launch_bounds__(256, 1)
blink_bench_ops(unsigned *dev, unsigned *host, unsigned long long *out, unsigned reps) {
    __shared__ unsigned counter, words[64];
    const bool t0 = threadIdx.x == 0;
    if (t0) counter = 0;
    if (threadIdx.x < 64) words[threadIdx.x] = 0;
    __syncthreads();
    unsigned idx = 0, acc = 0;
    unsigned long long a, b, clk = 0;
#define BLINK_OPS_TIME(kind, body)                      \
    if (t0) {                                           \
        a = blink_gt();                                 \
        for (unsigned r = 0; r < reps; ++r) { body; }   \
        b = blink_gt();                                 \
        out[kind] = b - a;                              \
    }                                                   \
    __syncthreads();
    BLINK_OPS_TIME(BLINK_OPS_CLOCK, clk += blink_gt())
    BLINK_OPS_TIME(BLINK_OPS_LD_DEV, idx = dev[idx & 63u])
    BLINK_OPS_TIME(BLINK_OPS_LD_DEV_VOLATILE, idx = *(volatile unsigned *)&dev[idx & 63u])
    BLINK_OPS_TIME(BLINK_OPS_LD_DEV_CTA, asm volatile("ld.relaxed.cta.u32 %0, [%1];" : "=r"(idx) : "l"(&dev[idx & 63u])))
    BLINK_OPS_TIME(BLINK_OPS_ST_LD_DEV, unsigned *w = &dev[16 + (idx & 15u)]; *w = r;
                   asm volatile("" : "+l"(w));   /* the same word, but the compiler cannot forward the store */
                   idx = *w)
    BLINK_OPS_TIME(BLINK_OPS_LD_SHARED, idx = *(volatile unsigned *)&words[idx & 63u])
    BLINK_OPS_TIME(BLINK_OPS_LD_SHARED_GENERIC, const unsigned *g = &words[idx & 63u];
                   asm volatile("" : "+l"(g));   /* the compiler no longer knows it points into shared memory */
                   idx = *g)
    BLINK_OPS_TIME(BLINK_OPS_LD_HOST, idx = *(volatile unsigned *)&host[idx & 63u])
    BLINK_OPS_TIME(BLINK_OPS_ST_HOST_FENCE_SYS, *(volatile unsigned *)&host[32 + (r & 31u)] = r; __threadfence_system())
    BLINK_OPS_TIME(BLINK_OPS_ST_DEV_FENCE_SYS, *(volatile unsigned *)&dev[32 + (r & 31u)] = r; __threadfence_system())
    BLINK_OPS_TIME(BLINK_OPS_FENCE_SYS, __threadfence_system())
    BLINK_OPS_TIME(BLINK_OPS_FENCE_DEV, dev[32 + (r & 31u)] = r; __threadfence())
    a = blink_gt();
    for (unsigned r = 0; r < reps; ++r) __syncthreads();
    b = blink_gt();
    if (t0) out[BLINK_OPS_SYNC] = b - a;
    __syncthreads();
    BLINK_OPS_TIME(BLINK_OPS_ATOMIC_SHARED, acc = atomicAdd_block(&words[acc & 63u], 1u))
    BLINK_OPS_TIME(BLINK_OPS_ST_HOST_FENCE_ACQREL_SYS, *(volatile unsigned *)&host[32 + (r & 31u)] = r;
                   asm volatile("fence.acq_rel.sys;" ::: "memory"))
    BLINK_OPS_TIME(BLINK_OPS_FENCE_ACQREL_SYS, asm volatile("fence.acq_rel.sys;" ::: "memory"))
    BLINK_OPS_TIME(BLINK_OPS_FENCE_ACQREL_DEV, dev[32 + (r & 31u)] = r; asm volatile("fence.acq_rel.gpu;" ::: "memory"))
    BLINK_OPS_TIME(BLINK_OPS_ST_RELEASE_HOST,
                   asm volatile("st.release.sys.u32 [%0], %1;" ::"l"(&host[32 + (r & 31u)]), "r"(r) : "memory"))
    BLINK_OPS_TIME(BLINK_OPS_LD_ACQUIRE_DEV,
                   asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(idx) : "l"(&dev[idx & 63u]) : "memory"))
#undef BLINK_OPS_TIME
    if (t0) out[BLINK_OPS_N] = idx + acc + clk + counter;   /* keeps the chains; the host ignores it */
}
