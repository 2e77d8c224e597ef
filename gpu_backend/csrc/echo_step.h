/* The stand-in step graph's computation: the daemon's null model on the device.
 * Output token i of a request is prompt[i % prompt_len], so the frontend's
 * tests apply unchanged. The model graphs (next issue) replace this kernel;
 * the contract stays: read the step descriptor, write one token per sampled
 * chunk into step_tokens, then store step_no into *done as the last write.
 *
 *   chunk_slot/chunk_sample + reqs (device memory) + prompt arena (ring)
 *     -> step_tokens[chunk] -> *done = step_no
 */
#ifndef BLINK_ECHO_STEP_H
#define BLINK_ECHO_STEP_H

#include "sched_types.h"

/* One thread's share of the chunks. The prompt arena is read with volatile
 * loads: on the host-mapped ring a cached line could hold an older prompt
 * written into the same arena range. */
template <class P>
BLINK_DEV void blink_echo_chunks(P &plat, const blink_sched_params_t *p, unsigned tid, unsigned nt) {
    const uint32_t n = p->state->n_chunks;
    const int32_t *arena = blink_prompt_arena(p);
    for (uint32_t c = tid; c < n; c += nt) {
        if (!p->chunk_sample[c]) continue;
        const blink_req_t *r = &p->reqs[p->chunk_slot[c]];
        p->step_tokens[c] = (int32_t)plat.ld32(&arena[r->prompt_offset + r->generated % r->prompt_len]);
    }
}

#endif /* BLINK_ECHO_STEP_H */
