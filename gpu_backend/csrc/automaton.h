/* Structured outputs on the device: the token automaton a constrained request
 * carries in the ring (shared_layout/automaton.py writes it, docs/structured_outputs.md
 * draws it), read where it lies and stepped by the scheduler, as the CPU daemon's
 * logits_processors.automaton_mask / advance do:
 *
 *   prompt arena [extra_offset + 2 * n_logit_bias + n_allowed_ids + bad_words_words ..]
 *     = header [4] | states [n_states, 6] | runs [R] | trans [T]   (int32 words)
 *   intake     blink_automaton_header_ok + blink_automaton_state_ok on every state
 *              (the checks of automaton.decode on what the device reads) -> else INVALID_REQUEST
 *   staging    blink_automaton_allow_runs / _allow_stops: the row's allowed set at its
 *              current state -> a [vocab] byte mask the in-graph sampler applies (-inf elsewhere)
 *   publish    blink_automaton_next: state after the token (-1: not allowed; the state stays)
 *
 * Every function reads words through `ld(i)` (word i of the automaton): volatile
 * ring loads on the device, plain loads in the host twin and the ctypes shim, so
 * nvcc and g++ compile this one header and the diff test runs the device's code.
 * Nothing here writes the ring.
 */
#ifndef BLINK_AUTOMATON_H
#define BLINK_AUTOMATON_H

#include "sched_types.h"

#define BLINK_AUTOMATON_HEADER 4u
#define BLINK_AUTOMATON_STATE_WORDS 6u
#define BLINK_AUTOMATON_ACCEPTING 1u
#define BLINK_MAX_AUTOMATON_WORDS (1u << 21)   /* shared_layout.automaton.MAX_AUTOMATON_WORDS */

/* Where the tables start, from the header (checked by blink_automaton_header_ok). */
typedef struct blink_automaton_view {
    uint32_t n_states, initial, runs_at, trans_at, n_runs, n_trans;
} blink_automaton_view_t;

template <class L>
BLINK_DEV blink_automaton_view_t blink_automaton_view(L ld) {
    blink_automaton_view_t a;
    a.n_states = ld(0);
    a.initial = ld(1);
    a.runs_at = BLINK_AUTOMATON_HEADER + a.n_states * BLINK_AUTOMATON_STATE_WORDS;
    a.n_runs = ld(2) / 2;
    a.trans_at = a.runs_at + 2 * a.n_runs;
    a.n_trans = ld(3) / 2;
    return a;
}

/* automaton.decode's header checks: counts that add up to n_words, an initial state in range. */
template <class L>
BLINK_DEV int blink_automaton_header_ok(L ld, uint32_t n_words) {
    if (n_words > BLINK_MAX_AUTOMATON_WORDS || n_words < BLINK_AUTOMATON_HEADER) return 0;
    const int32_t n_states = (int32_t)ld(0), initial = (int32_t)ld(1), nr = (int32_t)ld(2), nt = (int32_t)ld(3);
    if (n_states <= 0 || nr < 0 || nt < 0 || (nr & 1) || (nt & 1)) return 0;
    if ((uint64_t)BLINK_AUTOMATON_HEADER + (uint64_t)n_states * BLINK_AUTOMATON_STATE_WORDS + (uint64_t)nr +
            (uint64_t)nt != n_words)
        return 0;
    return initial >= 0 && initial < n_states;
}

/* automaton.decode's checks on one state and the runs and transitions it points at: default in
 * range (and present when it has runs), its runs inside the vocabulary, non-empty, sorted and
 * disjoint, its transitions sorted with tokens in the vocabulary and next states in range.
 * (decode checks every word of the tables; the device checks every word a state can reach.) */
template <class L>
BLINK_DEV int blink_automaton_state_ok(L ld, const blink_automaton_view_t *a, uint32_t state, uint32_t vocab) {
    const uint32_t at = BLINK_AUTOMATON_HEADER + state * BLINK_AUTOMATON_STATE_WORDS;
    const int32_t dflt = (int32_t)ld(at + 1), r0 = (int32_t)ld(at + 2), rn = (int32_t)ld(at + 3);
    const int32_t t0 = (int32_t)ld(at + 4), tn = (int32_t)ld(at + 5);
    if (dflt < -1 || dflt >= (int32_t)a->n_states || (rn > 0 && dflt < 0)) return 0;
    if (r0 < 0 || rn < 0 || (int64_t)r0 + rn > (int64_t)a->n_runs) return 0;
    if (t0 < 0 || tn < 0 || (int64_t)t0 + tn > (int64_t)a->n_trans) return 0;
    int64_t prev_end = 0;
    for (int32_t i = 0; i < rn; ++i) {
        const int32_t first = (int32_t)ld(a->runs_at + 2 * (uint32_t)(r0 + i));
        const int32_t end = (int32_t)ld(a->runs_at + 2 * (uint32_t)(r0 + i) + 1);
        if (first < 0 || (int64_t)end > (int64_t)vocab || first >= end || (i > 0 && first < prev_end)) return 0;
        prev_end = end;
    }
    int64_t prev_tok = -1;
    for (int32_t i = 0; i < tn; ++i) {
        const int32_t tok = (int32_t)ld(a->trans_at + 2 * (uint32_t)(t0 + i));
        const int32_t nxt = (int32_t)ld(a->trans_at + 2 * (uint32_t)(t0 + i) + 1);
        if (tok < 0 || (uint32_t)tok >= vocab || nxt < 0 || nxt >= (int32_t)a->n_states || tok <= prev_tok) return 0;
        prev_tok = tok;
    }
    return 1;
}

/* The state a request steps from (-1: not stepped yet -> the initial state). */
static inline BLINK_HD uint32_t blink_automaton_current(const blink_automaton_view_t *a, int32_t state) {
    return state < 0 ? a->initial : (uint32_t)state;
}

/* allowed[t] = 1 for the tokens of the state's runs; threads tid of nt split the runs
 * (disjoint ranges: no two threads write one byte). The caller zeroed `allowed` first. */
template <class L>
BLINK_DEV void blink_automaton_allow_runs(L ld, const blink_automaton_view_t *a, uint32_t state, uint32_t vocab,
                                          uint8_t *allowed, unsigned tid, unsigned nt) {
    const uint32_t at = BLINK_AUTOMATON_HEADER + state * BLINK_AUTOMATON_STATE_WORDS;
    const uint32_t r0 = ld(at + 2), rn = ld(at + 3);
    for (uint32_t i = tid; i < rn; i += nt) {
        const uint32_t first = ld(a->runs_at + 2 * (r0 + i)), run_end = ld(a->runs_at + 2 * (r0 + i) + 1);
        const uint32_t end = run_end < vocab ? run_end : vocab;   /* a row narrower than the checked vocabulary */
        for (uint32_t t = first; t < end; ++t) allowed[t] = 1;
    }
}

/* At an accepting state, or one with no runs (dead), the stop ids are allowed too (EOS among
 * them for a constrained request), so a finished structure can only end
 * (logits_processors.automaton_mask). One thread. */
template <class L>
BLINK_DEV void blink_automaton_allow_stops(L ld, uint32_t state, const int32_t *stops, uint32_t n_stops,
                                           uint32_t vocab, uint8_t *allowed) {
    const uint32_t at = BLINK_AUTOMATON_HEADER + state * BLINK_AUTOMATON_STATE_WORDS;
    if (!(ld(at) & BLINK_AUTOMATON_ACCEPTING) && ld(at + 3) != 0) return;
    for (uint32_t k = 0; k < n_stops; ++k)
        if (stops[k] >= 0 && (uint32_t)stops[k] < vocab) allowed[stops[k]] = 1;
}

/* The whole [vocab] mask on one thread (the host twin's; the staging kernel splits it). */
template <class L>
BLINK_DEV void blink_automaton_mask(L ld, const blink_automaton_view_t *a, uint32_t state, const int32_t *stops,
                                    uint32_t n_stops, uint32_t vocab, uint8_t *allowed) {
    for (uint32_t t = 0; t < vocab; ++t) allowed[t] = 0;
    blink_automaton_allow_runs(ld, a, state, vocab, allowed, 0, 1);
    blink_automaton_allow_stops(ld, state, stops, n_stops, vocab, allowed);
}

/* automaton.next_state: the transition's next state (binary search of the state's sorted
 * transitions), else the default when a run holds the token, else -1 (not allowed). */
template <class L>
BLINK_DEV int32_t blink_automaton_next(L ld, const blink_automaton_view_t *a, uint32_t state, int32_t token) {
    if (token < 0) return -1;
    const uint32_t at = BLINK_AUTOMATON_HEADER + state * BLINK_AUTOMATON_STATE_WORDS;
    const uint32_t t0 = ld(at + 4), tn = ld(at + 5);
    uint32_t lo = 0, hi = tn;                  /* first transition whose token >= token */
    while (lo < hi) {
        const uint32_t mid = (lo + hi) / 2;
        if ((int32_t)ld(a->trans_at + 2 * (t0 + mid)) < token) lo = mid + 1;
        else hi = mid;
    }
    if (lo < tn && (int32_t)ld(a->trans_at + 2 * (t0 + lo)) == token) return (int32_t)ld(a->trans_at + 2 * (t0 + lo) + 1);
    const uint32_t r0 = ld(at + 2), rn = ld(at + 3);
    lo = 0;
    hi = rn;                                   /* first run whose first token > token */
    while (lo < hi) {
        const uint32_t mid = (lo + hi) / 2;
        if ((int32_t)ld(a->runs_at + 2 * (r0 + mid)) <= token) lo = mid + 1;
        else hi = mid;
    }
    if (lo > 0 && token < (int32_t)ld(a->runs_at + 2 * (r0 + lo - 1) + 1)) return (int32_t)ld(at + 1);
    return -1;
}

/* logits_processors.advance: a token with no transition (a stop id) leaves the state as it is. */
template <class L>
BLINK_DEV int32_t blink_automaton_advance(L ld, const blink_automaton_view_t *a, int32_t state, int32_t token) {
    const uint32_t s = blink_automaton_current(a, state);
    const int32_t nxt = blink_automaton_next(ld, a, s, token);
    return nxt < 0 ? (int32_t)s : nxt;
}

#endif /* BLINK_AUTOMATON_H */
