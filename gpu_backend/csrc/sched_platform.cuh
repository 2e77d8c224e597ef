/* The device side of the scheduler's platform: how sched_loop.h touches the
 * ring, orders memory, synchronises the block, reads the clock and launches
 * graphs when it runs as the persistent kernel. host_twin.cc provides the same
 * members for the CPU twin (threads + a barrier, __atomic loads and stores).
 *
 * Ring words are read and written through volatile pointers: on host-mapped
 * memory they must reach the PCIe bus each time (a volatile access is a
 * relaxed system-scope access in the PTX memory model). No read-modify-write
 * ever touches the ring or the host-mapped control block: on an x86 host
 * with a PCIe GPU (cudaDevAttrHostNativeAtomicSupported == 0) device atomics
 * on host memory are not atomic with respect to the CPU, and a NIC's RDMA
 * WRITE never takes part in one. Every ring word has one writer per state
 * (shared_layout's owner table), ordered by fences; the only atomics here are
 * add_shared and max_shared, on the block's shared memory among the scheduler's threads, and
 * or_bit and cas32, on the scheduler's own device memory among them (ballot_bit is a warp vote
 * and a plain store there).
 */
#ifndef BLINK_SCHED_PLATFORM_CUH
#define BLINK_SCHED_PLATFORM_CUH

#include <cuda_runtime.h>

#include "sched_types.h"

struct blink_device_platform {
    __device__ uint32_t ld32(const void *p) const { return *(const volatile uint32_t *)p; }
    __device__ uint64_t ld64(const void *p) const { return *(const volatile uint64_t *)p; }
    __device__ void st32(void *p, uint32_t v) const { *(volatile uint32_t *)p = v; }
    __device__ void st64(void *p, uint64_t v) const { *(volatile uint64_t *)p = v; }
    /* A word of the scheduler's own device memory that other threads of the block may store at the
     * same time (the prefix cache's table while evictions mark it): relaxed, block scope, so the
     * access is no data race and may still hit the SM's L1 (a volatile one goes to L2). */
    __device__ uint32_t ld_blk32(const uint32_t *p) const {
        uint32_t v;
        asm volatile("ld.relaxed.cta.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
        return v;
    }
    __device__ void st_blk32(uint32_t *p, uint32_t v) const {
        asm volatile("st.relaxed.cta.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
    }
    /* An acquire load of a device-memory word another kernel releases (the step graph's done flag):
     * the loads after it see what was written before the flag, with no fence of its own. SASS: a
     * strong load and an L1 invalidation; on the H200 146 ns, what a volatile load costs, where
     * the __threadfence it replaces cost 0.2-0.3 us (bench.cuda_scheduler's ops table). */
    __device__ uint32_t ld_acq32(const uint32_t *p) const {
        uint32_t v;
        asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
        return v;
    }
    /* Orders this thread's ring accesses as seen by the frontend (host or NIC). */
    __device__ void fence_sys() const { __threadfence_system(); }
    /* Orders device-memory accesses between this kernel and the step graph. */
    __device__ void fence_dev() const { __threadfence(); }
    /* Shared memory only (the block's counters): never the ring, never host memory. */
    __device__ uint32_t add_shared(uint32_t *p, uint32_t v) const { return atomicAdd_block(p, v); }
    __device__ uint32_t max_shared(uint32_t *p, uint32_t v) const { return atomicMax_block(p, v); }
    /* Bit i % 32 of words[i / 32] = pred, for the 32 consecutive i of a warp (all its lanes call it
     * together, i aligned to the warp): one ballot and one store a warp, no atomic. A warp whose
     * positions all lie at or past n stores nothing: the bitmap holds the words of n bits only
     * (a round of 256 lanes over one running request would write 8 words of a 1-entry list). */
    __device__ void ballot_bit(uint32_t *words, uint32_t i, int pred, uint32_t n) const {
        const uint32_t bits = __ballot_sync(0xffffffffu, pred);
        if ((threadIdx.x & 31u) == 0 && i < n) words[i >> 5] = bits;
    }
    /* Bit i of words: an atomic OR on the scheduler's own device memory, among its own threads. */
    __device__ void or_bit(uint32_t *words, uint32_t i) const { atomicOr_block(&words[i >> 5], 1u << (i & 31u)); }
    /* Compare-and-swap of a word of the scheduler's own device memory (the prefix cache's table),
     * among its own threads: the old value. */
    __device__ uint32_t cas32(uint32_t *w, uint32_t expect, uint32_t v) const { return atomicCAS_block(w, expect, v); }
    __device__ void sync() const { __syncthreads(); }
    __device__ int sync_or(int v) const { return __syncthreads_or(v); }
    __device__ uint64_t now_ns(const blink_sched_params_t *p) const {
        uint64_t t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        return (uint64_t)((int64_t)t + p->clock_offset_ns);
    }
    __device__ void sleep_ns(uint32_t ns) const {
        if (ns) __nanosleep(ns);
    }
    /* Fire-and-forget: the step graph runs beside this kernel as its child.
     * `which` = graph id * BLINK_STEP_GRAPHS + instance (graph_table.h). */
    __device__ int launch_step(const blink_sched_params_t *p, uint32_t which) const {
        return (int)cudaGraphLaunch((cudaGraphExec_t)p->graphs.execs[which], cudaStreamGraphFireAndForget);
    }
    /* A fresh instance of this graph starts once this one and its children are done. */
    __device__ int tail_relaunch() const {
        return (int)cudaGraphLaunch(cudaGetCurrentGraphExec(), cudaStreamGraphTailLaunch);
    }
};

#endif /* BLINK_SCHED_PLATFORM_CUH */
