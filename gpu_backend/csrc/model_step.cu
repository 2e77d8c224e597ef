/* Kernels of the model step graphs (gpu_backend/graphs/capture.py launches
 * them on the capture stream around the PyTorch forward, so each becomes a
 * kernel node of the captured graph):
 *
 *   blink_stage_inputs<<<R rows, 128>>>(params, io, S, C)   first node
 *   ... forward + sampling (PyTorch kernels) ...
 *   blink_finish_step<<<1, 256>>>(params, io)               last node: tokens, fence, *done = step_no
 */
#include <cuda_runtime.h>

#include "model_step.h"
#include "sched_platform.cuh"

extern "C" __global__ void __launch_bounds__(128) blink_stage_inputs(const blink_sched_params_t *p,
                                                                     const blink_step_io_t *io, uint32_t S,
                                                                     uint32_t C) {
    blink_device_platform plat;
    blink_stage_row(plat, p, io, S, C, blockIdx.x, threadIdx.x, blockDim.x);
}

extern "C" __global__ void __launch_bounds__(256) blink_finish_step(const blink_sched_params_t *p,
                                                                    const blink_step_io_t *io) {
    blink_device_platform plat;
    blink_finish_rows(plat, p, io, threadIdx.x, blockDim.x);
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();   /* every chunk's token before the flag; system scope because the
                                     host loop may poll the flag from the CPU */
        plat.st32(p->done, p->state->step_no);
    }
}
