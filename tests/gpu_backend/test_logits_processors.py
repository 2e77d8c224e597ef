"""logits_processors and the batched sampler against plain per-row loops written here."""
import math

import torch

from gpu_backend import logits_processors
from gpu_backend.logprobs import records
from gpu_backend.sampling import filter_batch, filter_logits, sample
from gpu_backend.scheduler.sequence import SamplingParams, Sequence
from shared_layout.layout import decode_logprob_records

V = 50


def seq(prompt=(1, 2), output=(), stop=(), **params):
    return Sequence(slot=0, seq=1, epoch=0, prompt=list(prompt), max_tokens=8, params=SamplingParams(**params),
                    stop_ids=frozenset(stop), max_len=100, output=list(output))


def naive(row: list[float], s: Sequence) -> list[float]:
    """One row by the rules as vLLM states them, one token at a time."""
    p = s.params
    x = list(row)
    if p.allowed_token_ids:
        x = [v if t in p.allowed_token_ids else -math.inf for t, v in enumerate(x)]
    for w in p.bad_words:
        if len(w) == 1 or (len(s.output) >= len(w) - 1 and s.output[len(s.output) - len(w) + 1:] == list(w[:-1])):
            x[w[-1]] = -math.inf
    if len(s.output) < p.min_tokens:
        for t in s.stop_ids:
            x[t] = -math.inf
    for t, b in p.logit_bias:
        x[t] += b
    for t in range(len(x)):
        if t in s.prompt or t in s.output:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        n = s.output.count(t)
        x[t] -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
    return x


def test_processors_match_the_naive_rules_row_by_row():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, V, generator=g) * 3
    seqs = [
        seq(),                                                       # untouched
        seq(allowed_token_ids=(3, 4, 5), logit_bias=((4, 2.0),)),
        seq(output=(7, 8), bad_words=((9,), (8, 10), (7, 8, 11), (1, 12))),
        seq(output=(7,), stop=(0, 13), min_tokens=2),
        seq(prompt=(1, 2, 3), output=(5, 5, 6), repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25),
        seq(output=(20,), stop=(20,), min_tokens=1, logit_bias=((21, -5.0), (21, -1.0)), repetition_penalty=0.8),
    ]
    got = logits_processors.apply(logits, seqs)
    for i, s in enumerate(seqs):
        want = torch.tensor(naive(logits[i].tolist(), s))
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-5, msg=f"row {i}")
    assert logits_processors.apply(logits, [seq(), seq()]) is logits        # nothing to do: no copy


def test_penalty_counts_follow_the_output_incrementally():
    s = seq(prompt=(1,), frequency_penalty=1.0)
    logits = torch.zeros(1, V)
    for out in ([], [4], [4, 4], [4, 4, 9]):
        s.output = list(out)
        x = logits_processors.apply(logits, [s])[0]
        assert x[4].item() == -out.count(4) and x[9].item() == -out.count(9)


def test_filter_batch_equals_rows_and_min_p_cuts_below_a_fraction_of_the_top():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=g) * 2
    temps, ks, ps = [0.7, 1.0, 1.3, 0.5], [0, 5, 0, 3], [1.0, 0.9, 0.5, 1.0]
    batch = filter_batch(logits, torch.tensor(temps), torch.tensor(ks), torch.tensor(ps), torch.zeros(4))
    for i in range(4):
        torch.testing.assert_close(batch[i], filter_logits(logits[i], temps[i], ks[i], ps[i]))
    probs = torch.softmax(logits[0] / 0.7, -1)
    cut = filter_logits(logits[0], 0.7, 0, 1.0, min_p=0.3)
    assert ((cut > 0) == (probs >= 0.3 * probs.max())).all()


def test_greedy_takes_the_processed_argmax_and_logprobs_stay_raw():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0] + [-3.0] * (V - 4)])
    s = seq(logit_bias=((2, 10.0),), logprobs=2)
    out = sample(logits, [s])
    assert out == [2]                                            # the bias decides the pick
    lp, rank, ids, top = decode_logprob_records(s.step_logprobs.reshape(-1), 2)
    raw = torch.log_softmax(logits[0], -1)
    assert math.isclose(lp[0], raw[2].item(), rel_tol=1e-6)      # ... not the logprob
    assert rank[0] == 3 and ids[0].tolist() == [1, 3]
    assert [round(v, 5) for v in top[0].tolist()] == [round(raw[1].item(), 5), round(raw[3].item(), 5)]


def test_rows_asking_different_top_counts_get_their_own_record_width():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    a, b, c = seq(logprobs=0), seq(), seq(logprobs=4)
    sample(logits, [a, b, c])
    assert a.step_logprobs.shape == (1, 2) and b.step_logprobs is None and c.step_logprobs.shape == (1, 10)
    full = records(logits[2:], torch.tensor([int(logits[2].argmax())]), 4)
    assert (c.step_logprobs == full).all()
    assert decode_logprob_records(a.step_logprobs.reshape(-1), 0)[1][0] == 1   # argmax: rank 1


def test_automaton_masks_steps_and_ends_with_eos():
    """A constrained row only ever samples what its automaton allows, whatever the logits favour;
    its state steps with each token; a finished structure allows only the stop ids."""
    import numpy as np
    from shared_layout.automaton import decode, from_transitions
    eos = 49
    # "7" then one or two of {3, 4}, then done
    a = decode(from_transitions({0: {7: 1}, 1: {3: 2, 4: 2}, 2: {3: 3, 4: 3}, 3: {}}, 0, {2, 3}), V)
    free = seq(stop=(eos,), temperature=1.0, seed=5)
    s = seq(stop=(eos,), automaton=a, temperature=1.0, seed=5)
    logits = torch.zeros(2, V)
    logits[:, 20] = 30.0                      # a token no automaton state allows
    out = []
    for _ in range(4):
        t = sample(logits.clone(), [free, s])
        assert t[0] == 20
        out.append(t[1])
        s.output.append(t[1])
        if t[1] == eos:
            break
    assert out[0] == 7 and all(t in (3, 4) for t in out[1:-1]) and out[-1] == eos and len(out) in (3, 4)
    allowed = np.flatnonzero(logits_processors.automaton_mask(s, V).numpy()).tolist()
    assert allowed == ([eos] if len(out) == 4 else [3, 4, eos])    # state 3 (no transitions) or state 2
