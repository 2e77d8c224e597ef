/* Kernels for bench/cuda_scheduler.py: the cost of one slot scan, of a
 * device-side fire-and-forget launch, of a tail relaunch. Linked into the same
 * module as the scheduler so they share its build and its ring layout.
 *
 *   blink_bench_scan   (1 x 256, a plain kernel)  reps x full scan -> ns per scan
 *   blink_bench_launch (1 x 1, inside a device graph) n x { launch child, wait for
 *                      its flag } -> call ns, round-trip ns, child start stamps
 *   blink_bench_child  (the launched graph's kernel) stamps %globaltimer, raises the flag
 *   blink_bench_tail   (inside a device graph) relaunches itself n times, stamping each start
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
