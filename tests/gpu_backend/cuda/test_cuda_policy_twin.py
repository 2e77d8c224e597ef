"""The device's decision core (csrc/sched_policy.h, compiled with g++) against
the Python policy and intake: random inputs, and scenarios recorded as JSON
from the real engine (gpu_backend.engine) serving traffic with a KV pool small
enough to preempt."""
from __future__ import annotations

import json
import pathlib
import random
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_backend.scheduler import policy as P
from gpu_backend.engine import Engine, EngineConfig
from gpu_backend.executors.null import EchoRunner
from gpu_backend.scheduler.intake import Intake, IntakeConfig
from shared_layout import BackendPort, ErrorCode, FinishReason, Ring, RingGeometry, SlotRequest, SlotState
from shared_layout.layout import FLAG_LOGPROBS, FLAG_PROMPT_LOGPROBS, SLOT_DTYPE

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from frontend_player import FrontendPlayer  # noqa: E402


def _random_input(rng: random.Random, cfg: P.PolicyConfig, max_running: int) -> P.PolicyInput:
    ids = rng.sample(range(1000), 40)
    waiting = [P.WaitingReq(ids.pop(), rng.randint(1, 120)) for _ in range(rng.randint(0, 6))]
    running = []
    for _ in range(rng.randint(0, max_running)):
        n = rng.randint(1, 120)
        done = rng.choice([n - 1, n - 1, rng.randint(0, n - 1)])
        held = rng.choice([P.blocks_needed(done, cfg.block_size), P.blocks_needed(done + 1, cfg.block_size)])
        running.append(P.RunningReq(ids.pop(), n, done, held))
    free = rng.choice([0, 0, 1, rng.randint(0, 40)])
    return P.PolicyInput(tuple(waiting), tuple(running), free, P.StepKind(rng.randint(0, 2)))


def test_random_inputs_plan_alike(twin_lib):
    from gpu_backend.cuda import twin
    rng = random.Random(20261122)
    kinds = set()
    for _ in range(4000):
        cfg = P.PolicyConfig(rng.randint(1, 8), rng.choice([1, 3, 16, 64, 2048]), rng.choice([1, 2, 4, 16]))
        inp = _random_input(rng, cfg, min(6, cfg.max_batch_size))
        want = P.plan_step(inp, cfg)
        assert twin.plan_step(inp, cfg) == want, (inp, cfg)
        kinds.add((want.kind, bool(want.preempted), bool(want.admitted)))
    # the sample reached every kind of decision, preemptions and admissions included
    assert {(P.StepKind.DECODE, True, False), (P.StepKind.IDLE, True, False),
            (P.StepKind.PREFILL, False, True), (P.StepKind.IDLE, False, False)} <= kinds


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 12), budget=st.integers(1, 300),
       block=st.sampled_from([1, 2, 4, 8, 16]))
def test_hypothesis_inputs_plan_alike(twin_lib, seed, batch, budget, block):
    from gpu_backend.cuda import twin
    cfg = P.PolicyConfig(batch, budget, block)
    inp = _random_input(random.Random(seed), cfg, batch + 1)   # one past the seat limit too
    assert twin.plan_step(inp, cfg) == P.plan_step(inp, cfg)


def _with_prefix_hits(rng: random.Random, inp: P.PolicyInput, cfg: P.PolicyConfig) -> P.PolicyInput:
    """The input with prefix-cache hits on some waiting requests (block-aligned, < num_tokens; some
    of their blocks idle) and a free count that may go negative (extra holders of shared blocks)."""
    bs = cfg.block_size
    waiting = []
    for w in inp.waiting:
        full = (w.num_tokens - 1) // bs
        hit = rng.randint(0, full) if full and rng.random() < 0.6 else 0
        idle = rng.randint(0, hit) if hit else 0
        waiting.append(P.WaitingReq(w.id, w.num_tokens, hit * bs, idle, *w.ext()))
    free = inp.free_blocks - (rng.randint(0, 6) if rng.random() < 0.2 else 0)
    return P.PolicyInput(tuple(waiting), inp.running, free, inp.prev_kind, inp.now_us)


@pytest.mark.parametrize("policy", list(P.SchedPolicy))
def test_random_inputs_with_prefix_hits_plan_alike(twin_lib, policy):
    """num_cached / cached_idle (rule 0's need, rule 2b's chunk and free count, hit_taken's hit blocks
    a victim frees or a request ahead claimed) and a negative free count in C++ as in Python, under
    each policy."""
    from gpu_backend.cuda import twin
    rng = random.Random(20261125 + 7 * int(policy))
    hits = revived = 0
    for _ in range(3000):
        cfg = P.PolicyConfig(rng.randint(1, 8), rng.choice([1, 3, 16, 64, 2048]), rng.choice([1, 2, 4, 16]),
                             policy=policy, lvf_xfer_blocks=rng.choice([0, 3, 2400]))
        inp = _with_prefix_hits(rng, _random_policy_input(rng, cfg, min(6, cfg.max_batch_size + 1)), cfg)
        want = P.plan_step(inp, cfg)
        assert twin.plan_step(inp, cfg) == want, (inp, cfg)
        hits += any(w.num_cached and w.id in want.admitted for w in inp.waiting)
        queue, done = inp.waiting, []       # hit_taken beyond cached_idle (victims' blocks, claims ahead)
        freed = sum(r.num_blocks for r in inp.running if r.id in want.preempted) if want.prefill else 0
        for i in want.admitted:
            w = next(w for w in queue if w.id == i)
            revived += P.hit_taken(w, queue, done, freed, cfg.block_size) > w.cached_idle
            done.append(i)
    assert hits > 50
    assert revived == 0 if policy == P.SchedPolicy.FCFS else revived > 20   # FCFS: taken is cached_idle


def _record_engine_scenario(seed: int, prefix_caching: bool = False) -> P.Scenario:
    """Serve random traffic through the real engine (echo runner) and record every decision; with
    prefix caching, most prompts start with one of a few shared prefixes."""
    rng = np.random.default_rng(seed)
    geom = RingGeometry(24, 1 << 14, 1 << 14)
    ring = Ring.create(bytearray(geom.total_size), geom)
    policy = P.PolicyConfig(max_batch_size=int(rng.integers(2, 7)), max_prefill_tokens=int(rng.integers(8, 64)),
                            block_size=int(rng.choice([2, 4, 8])))
    max_len = 96
    num_blocks = P.blocks_needed(max_len, policy.block_size) + int(rng.integers(0, 12))   # tight: preemptions
    scenario = P.Scenario(policy, name=f"engine-seed{seed}{'-prefix' if prefix_caching else ''}")
    engine = Engine(ring, EchoRunner(), EngineConfig(policy, num_blocks, prefix_caching=prefix_caching),
                    IntakeConfig(49152, max_len), scenario=scenario)
    fp = FrontendPlayer(ring)
    prefixes = [rng.integers(0, 1000, int(rng.integers(8, 40))).tolist() for _ in range(3)]
    submitted = 0
    for _ in range(400):
        while submitted < 40 and len(fp.inflight) < geom.slot_count and rng.random() < 0.5:
            prompt = rng.integers(0, 1000, int(rng.integers(1, 60))).tolist()
            if prefix_caching and rng.random() < 0.7:
                prompt = (prefixes[int(rng.integers(0, 3))] + prompt)[:60]
            fp.submit(prompt, int(rng.integers(1, 40)))
            submitted += 1
        if fp.inflight and rng.random() < 0.03:
            fp.cancel(int(rng.choice(list(fp.inflight))))
        engine.step()
        for slot in [s for s in fp.inflight if fp.done(s)]:
            fp.collect(slot)
    return scenario


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_recorded_engine_scenarios_replay_alike(twin_lib, seed, prefix_caching, tmp_path):
    from gpu_backend.cuda import twin
    recorded = _record_engine_scenario(seed, prefix_caching)
    if prefix_caching:
        assert any(w.num_cached for inp, _ in recorded.steps for w in inp.waiting), "shared prefixes should hit"
    path = tmp_path / "scenario.json"
    recorded.dump(path)
    scenario = P.Scenario.from_json(json.loads(path.read_text()))
    assert len(scenario.steps) > 100
    assert any(plan.preempted for _, plan in scenario.steps), "the tight pool should force preemptions"
    for i, (inp, plan) in enumerate(scenario.steps):
        assert twin.plan_step(inp, scenario.config) == plan, f"step {i} of {scenario.name}"


def test_intake_checks_match_python(twin_lib):
    """Corrupted and valid slot records get the same (finish, error) from both intakes."""
    from gpu_backend.cuda import twin
    from gpu_backend.cuda.config import SchedulerConfig
    geom = RingGeometry(4, 4096, 4096)
    ring = Ring.create(bytearray(geom.total_size), geom)
    ring.set("frontend_epoch", 7)
    max_len = 512
    intake = Intake(ring, BackendPort(ring), IntakeConfig(49152, max_len))
    cfg = SchedulerConfig(max_model_len=max_len, max_batch_size=4)
    rng = random.Random(5)
    seen = set()
    for _ in range(3000):
        rec = SlotRequest(seq=1, prompt_offset=rng.randint(0, 100), prompt_len=rng.randint(1, 50),
                          output_offset=rng.randint(0, 100), max_tokens=rng.randint(1, 50), epoch=7).record()
        r = rec[0]
        field = rng.choice(["none", "prompt_len", "prompt_offset", "max_tokens", "output_offset", "temperature",
                            "top_p", "top_k", "n_stop_ids", "epoch", "cancel", "presence_penalty",
                            "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "extra_offset",
                            "logprobs", "prompt_logprobs", "group_index"])
        nan, inf = float("nan"), float("inf")
        bad = {"prompt_len": [0, 600, 5000], "prompt_offset": [4090, 2**32 - 1], "max_tokens": [0, 5000],
               "output_offset": [4095, 2**31], "temperature": [-1.0, nan, inf, 0.7],
               "top_p": [0.0, 1.5, nan, 0.3], "top_k": [-1, 5], "n_stop_ids": [9, 8],
               "epoch": [6, 8], "cancel": [1], "presence_penalty": [2.5, -2.01, nan, inf, 1.5],
               "frequency_penalty": [-3.0, nan, -2.0], "repetition_penalty": [2.5, -0.5, nan, 1.3, 0.0],
               "min_p": [1.5, -0.1, nan, 0.2], "min_tokens": [5000, 1], "extra_offset": [4000, 2**32 - 1, 10],
               "logprobs": [0, 20, 21, 2**31], "prompt_logprobs": [0, 5, 21],
               "group_index": [0, 1, 7]}.get(field)
        if bad:
            r[field] = rng.choice(bad)
        if field == "extra_offset":        # some sampling data, so the offset's range matters
            r["n_logit_bias"], r["bad_words_words"] = rng.choice([(0, 0), (40, 0), (3, 100)])
        if field in ("logprobs", "prompt_logprobs"):
            r["flags"] |= FLAG_LOGPROBS if field == "logprobs" else FLAG_PROMPT_LOGPROBS
            r[field + "_offset"] = rng.choice([0, 1000, 4000])
        if field == "group_index":
            r["group_size"], r["group_seq"] = 3, rng.choice([1, 2])
        ring.slots[0] = r
        ring.prompt_arena[:] = 1
        _, want_finish, want_error = intake._read(0, 7)
        got = twin.intake_check(cfg, geom, 7, ring.slots[0:1])
        assert got == (int(want_finish), int(want_error)), (field, r)
        seen.add(got)
    assert len(seen) >= 5
    assert ring.slots.dtype == SLOT_DTYPE and SlotState.EMPTY == 0


def test_device_refuses_only_what_its_graphs_cannot_serve(twin_lib):
    """blink_device_unsupported: prompt logprobs always, and without
    sampler seats (the echo stand-in) what needs one (penalties, logit_bias, allowed ids, bad words), with
    ERROR/INVALID_REQUEST; the rest passes."""
    from gpu_backend.cuda import twin
    from shared_layout.extra import SamplingExtra
    invalid = (int(FinishReason.ERROR), int(ErrorCode.INVALID_REQUEST))
    plain = [dict(), dict(min_p=0.3, min_tokens=2, logprobs=5, top_k=4, top_p=0.5, temperature=0.7),
             dict(repetition_penalty=1.0), dict(repetition_penalty=0.0)]
    seat = [dict(presence_penalty=0.1), dict(frequency_penalty=-0.5), dict(repetition_penalty=1.1),
            dict(extra=SamplingExtra(logit_bias=((3, 1.0),))), dict(extra=SamplingExtra(allowed_token_ids=(4,))),
            dict(extra=SamplingExtra(bad_words=((5, 6),)))]
    cases = ([(k, n, (0, 0)) for k in plain for n in (0, 4)] + [(k, 0, invalid) for k in seat]
             + [(k, 4, (0, 0)) for k in seat] + [(dict(prompt_logprobs=0), n, invalid) for n in (0, 4)])
    for kw, n_seats, want in cases:
        rec = SlotRequest(seq=1, prompt_offset=0, prompt_len=4, output_offset=0, max_tokens=8, **kw).record()
        assert twin.device_unsupported(rec, n_seats) == want, (kw, n_seats)
    rec = SlotRequest(seq=1, prompt_offset=0, prompt_len=4, output_offset=0, max_tokens=8).record()
    rec["automaton_words"] = 12                     # structured outputs: served (csrc/automaton.h)
    assert twin.device_unsupported(rec, 0) == (0, 0) and twin.device_unsupported(rec, 4) == (0, 0)


def test_device_checks_sampling_data_as_decode_extra(twin_lib):
    """blink_extra_ok against shared_layout.extra.decode_extra on valid and corrupted words; the
    device also refuses more multi-token bad words than a seat holds."""
    from gpu_backend.cuda import structs, twin
    from gpu_backend.graphs import sampler
    from shared_layout.extra import SamplingExtra, decode_extra, encode_extra
    assert (structs.BAD_WORDS, structs.BAD_WORD_LEN) == (sampler.BAD_WORDS, sampler.BAD_WORD_LEN)
    vocab, rng = 100, random.Random(18)
    for trial in range(600):
        extra = SamplingExtra(
            logit_bias=tuple((rng.randrange(vocab), rng.uniform(-100, 100)) for _ in range(rng.randrange(4))),
            allowed_token_ids=tuple(rng.randrange(vocab) for _ in range(rng.randrange(4))),
            bad_words=tuple(tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 4)))
                            for _ in range(rng.randrange(4))))
        words, counts = encode_extra(extra), list(extra.counts)
        if words.size and trial % 2:
            i = rng.randrange(words.size)
            words[i] = rng.choice([-1, vocab, 0, 2**31 - 1, 65, int(np.float32(150.0).view("<i4")),
                                   int(np.float32("nan").view("<i4"))])
        try:
            decode_extra(words, *counts, vocab_size=vocab)
            want = True
        except ValueError:
            want = False
        assert twin.extra_ok(words, vocab, *counts) == want, (extra, words)
    many = SamplingExtra(bad_words=tuple((i, i + 1) for i in range(structs.BAD_WORDS + 1)))
    assert not twin.extra_ok(encode_extra(many), vocab, *many.counts)
    assert twin.extra_ok(encode_extra(SamplingExtra(bad_words=many.bad_words[1:])), vocab,
                         *SamplingExtra(bad_words=many.bad_words[1:]).counts)


def _random_policy_input(rng: random.Random, cfg: P.PolicyConfig, max_running: int) -> P.PolicyInput:
    """_random_input with priorities, arrivals, rotary requests, SLOs and a clock (microseconds)."""
    base = _random_input(rng, cfg, max_running)
    now = rng.randint(0, 10**7)
    t = lambda: rng.randint(0, now)   # noqa: E731
    waiting = tuple(P.WaitingReq(w.id, w.num_tokens, 0, 0, rng.randint(-2, 2), t(),
                                 rng.choice([-1, -1, t()]), rng.choice([0, 10**4, 10**6]),
                                 rng.choice([0, 3, 10**5])) for w in base.waiting)
    running = tuple(P.RunningReq(r.id, r.num_tokens, r.num_computed, r.num_blocks, rng.randint(-2, 2), t(), t())
                    for r in base.running)
    return P.PolicyInput(waiting, running, base.free_blocks, base.prev_kind, now)


@pytest.mark.parametrize("policy", [P.SchedPolicy.PRIORITY, P.SchedPolicy.LVF])
def test_random_inputs_plan_alike_under_each_policy(twin_lib, policy):
    """Rule 0 (orders, victims, the VLT formula with negative tolerances) in C++ as in Python."""
    from gpu_backend.cuda import twin
    rng = random.Random(20261125 + int(policy))
    preempting_prefills = 0
    for _ in range(3000):
        cfg = P.PolicyConfig(rng.randint(1, 8), rng.choice([1, 3, 16, 64, 2048]), rng.choice([1, 2, 4, 16]),
                             policy=policy, lvf_alpha_milli=rng.choice([0, 1000, 3000]),
                             lvf_beta_b_milli=rng.choice([-700, 0, 1500]), lvf_beta_f_milli=rng.choice([0, 500]),
                             lvf_xfer_blocks=rng.choice([0, 3, 2400]))
        inp = _random_policy_input(rng, cfg, min(6, cfg.max_batch_size + 1))
        want = P.plan_step(inp, cfg)
        assert twin.plan_step(inp, cfg) == want, (inp, cfg)
        preempting_prefills += want.kind == P.StepKind.PREFILL and bool(want.preempted)
    assert preempting_prefills > 50      # rule 0 preempted for waiting requests, not just rule 3


@pytest.mark.parametrize("policy", [P.SchedPolicy.PRIORITY, P.SchedPolicy.LVF])
def test_simulated_policy_scenarios_replay_alike(twin_lib, policy, tmp_path):
    """policy_sim's recorded traces with priorities and SLO classes, replayed by the C++ planner."""
    from gpu_backend.cuda import twin
    from gpu_backend.scheduler.policy_sim import random_scenario
    rng = random.Random(4242)
    steps = 0
    for i in range(12):
        path = tmp_path / f"{i}.json"
        random_scenario(rng, name=f"{policy.name}-{i}", policy=policy).dump(path)
        scenario = P.Scenario.from_json(json.loads(path.read_text()))
        for k, (inp, plan) in enumerate(scenario.steps):
            assert twin.plan_step(inp, scenario.config) == plan, f"step {k} of {scenario.name}"
        steps += len(scenario.steps)
    assert steps > 500
