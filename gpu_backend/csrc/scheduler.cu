/* Kernels of the CUDA executor: the persistent scheduler, the stand-in step
 * graph's kernel (echo), and the clock probe used to put device timestamps on
 * the host's CLOCK_MONOTONIC. Built with relocatable device code and linked
 * with the device runtime (cudadevrt) because the scheduler launches graphs
 * from the device (gpu_backend/cuda/build.py holds the flags).
 *
 *   host (cuda-python, once): graphs instantiated for device launch, uploaded,
 *     scheduler graph launched on a non-default stream
 *   blink_scheduler (1 block x 256 threads, a node of a device graph; blink_scheduler_shared with
 *     shared_state: the same loop over copies in shared memory)
 *     -> cudaGraphLaunch(step graph, fire-and-forget) -> blink_echo_step
 *        -> step_tokens, *done = step_no -> blink_scheduler publishes them
 *     -> window full: cudaGraphLaunch(itself, tail launch) and return
 */
#include <cuda_runtime.h>

#include "sched_platform.cuh"
#include "sched_loop.h"

extern "C" __global__ void __launch_bounds__(256, 1) blink_scheduler(const blink_sched_params_t *p) {
    __shared__ blink_sched_shared_t sh;
    /* The survey's warp votes take whole warps every round (sched_platform.cuh ballot_bit). */
    if (blockDim.x & 31u) __trap();
    blink_device_platform plat;
    blink_sched_run(plat, p, &sh, threadIdx.x, blockDim.x);
}

/* shared_state (SchedulerConfig, the default; the runtime instantiates this kernel then): the same loop
 * over copies of its params, state, counters and allocator scalars in the block's shared memory
 * (sched_loop.h blink_copy_local). A kernel of its own, so the device-memory one above (shared_state
 * off) keeps its params loads global (one loop over a pointer into either memory compiles them all to
 * generic loads). */
extern "C" __global__ void __launch_bounds__(256, 1) blink_scheduler_shared(const blink_sched_params_t *p) {
    __shared__ blink_sched_shared_t sh;
    __shared__ blink_sched_local_t loc;
    if (blockDim.x & 31u) __trap();
    blink_device_platform plat;
    blink_sched_run(plat, blink_copy_local(plat, p, &loc, threadIdx.x, blockDim.x), &sh, threadIdx.x, blockDim.x);
}

/* The stand-in step graph: one kernel; its last write is the completion flag. */
extern "C" __global__ void __launch_bounds__(256) blink_echo_step(const blink_sched_params_t *p) {
    blink_device_platform plat;
    blink_echo_chunks(plat, p, threadIdx.x, blockDim.x);
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();   /* every chunk's token before the flag; system scope because the
                                     host-driven baseline (bench) polls the flag from the CPU */
        plat.st32(p->done, p->state->step_no);
    }
}

/* %globaltimer into host-mapped memory; the host brackets it with its own clock. */
extern "C" __global__ void blink_clock_probe(unsigned long long *out) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    *(volatile unsigned long long *)out = t;
    __threadfence_system();   /* the stamp reaches host memory before the kernel counts as done */
}
