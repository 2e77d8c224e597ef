"""A buggy or hostile frontend writes garbage into slots: the daemon's engine must end those
requests with an error, never touch memory outside the ring, never raise out of a step,
keep serving the honest requests beside them, and give every KV block back.

The real Engine and intake with the null executor's EchoRunner (no model), over a real
Ring placed in the middle of a larger buffer whose guard bytes must stay untouched.
Hypothesis draws the corrupted fields (offsets, lengths, counts, floats, token ids,
epochs, state words), both before the daemon claims a slot and while it owns one.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_backend.engine import Engine, EngineConfig
from gpu_backend.executors.null import EchoRunner
from gpu_backend.scheduler.intake import IntakeConfig
from gpu_backend.scheduler.policy import PolicyConfig
from shared_layout import ErrorCode, FinishReason, FrontendPort, Ring, RingGeometry, SlotRequest, SlotState
from shared_layout.layout import MAX_STOP_IDS

GEOM = RingGeometry(16, 2048, 2048)
GUARD = 4096
VOCAB = 1000
MAX_LEN = 128
BLOCK = 4
NUM_BLOCKS = 2 * MAX_LEN // BLOCK * 4
U32 = 2**32 - 1
HONEST_SLOTS = (0, 1, 2)          # honest requests live here, with their own arena ranges
HONEST_ARENA = 600                # tokens [0, 600) of both arenas belong to the honest requests


class GuardedRing:
    """A ring in the middle of a buffer; bytes before and after it are a known pattern."""

    def __init__(self):
        self.buf = bytearray(b"\xa5" * (GUARD + GEOM.total_size + GUARD))
        self.view = memoryview(self.buf)[GUARD:GUARD + GEOM.total_size]
        self.ring = Ring.create(self.view, GEOM)

    def guards_intact(self) -> bool:
        return (self.buf[:GUARD] == b"\xa5" * GUARD
                and self.buf[GUARD + GEOM.total_size:] == b"\xa5" * GUARD)


def make_engine(ring: Ring) -> Engine:
    policy = PolicyConfig(max_batch_size=8, max_prefill_tokens=4096, block_size=BLOCK)
    return Engine(ring, EchoRunner(), EngineConfig(policy, NUM_BLOCKS), IntakeConfig(VOCAB, MAX_LEN, eos_ids=(2,)))


def submit_honest(ring: Ring, slot: int, prompt: list[int], max_tokens: int) -> None:
    poff = slot * 200
    req = SlotRequest(seq=slot + 1, prompt_offset=poff, prompt_len=len(prompt), output_offset=poff,
                      max_tokens=max_tokens, ignore_eos=True, epoch=ring.get("frontend_epoch"))
    FrontendPort(ring).submit(slot, req, np.asarray(prompt, np.int32))


def honest_tokens(ring: Ring, slot: int) -> tuple[FinishReason, ErrorCode, list[int]]:
    r = ring.slots[slot]
    return (FinishReason(int(r["finish_reason"])), ErrorCode(int(r["error_code"])),
            ring.tokens(slot, 0, int(r["generated"])).tolist())


# -- what a hostile frontend writes ---------------------------------------------------

def _u32_near(limit: int):
    return st.one_of(st.integers(0, limit), st.sampled_from([limit - 1, limit, limit + 1, U32, U32 - 1, 2**31]))


_FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                    st.sampled_from([0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e-45]))

FIELD_VALUES = {
    "prompt_offset": _u32_near(GEOM.prompt_arena_tokens),
    "prompt_len": _u32_near(GEOM.prompt_arena_tokens),
    "output_offset": _u32_near(GEOM.output_arena_tokens),
    "max_tokens": _u32_near(GEOM.output_arena_tokens),
    "temperature": _FLOATS,
    "top_p": _FLOATS,
    "top_k": st.integers(-2**31, 2**31 - 1),
    "flags": st.integers(0, U32),
    "seed": st.integers(0, 2**64 - 1),
    "n_stop_ids": _u32_near(MAX_STOP_IDS),
    "epoch": st.sampled_from([0, 1, 2, 2**64 - 1]),
    "seq": st.integers(0, 2**64 - 1),
    "cancel": st.sampled_from([0, 1, U32]),
}
PROMPT_TOKENS = st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(-2**31, 2**31 - 1)), min_size=1,
                         max_size=16)
# Fields a hostile frontend may scribble on while the daemon owns the slot.
OWNED_FIELDS = {
    "state": st.one_of(st.integers(0, 7), st.just(U32)),
    "generated": _u32_near(GEOM.output_arena_tokens),
    "output_offset": st.sampled_from([GEOM.output_arena_tokens - 1, GEOM.output_arena_tokens, U32]),
    "max_tokens": st.sampled_from([0, 1, GEOM.output_arena_tokens + 5, U32]),
    "prompt_offset": _u32_near(GEOM.prompt_arena_tokens),
    "prompt_len": _u32_near(GEOM.prompt_arena_tokens),
    "n_stop_ids": _u32_near(MAX_STOP_IDS),
}

pending_slot = st.fixed_dictionaries({}, optional=FIELD_VALUES)
owned_write = st.tuples(st.sampled_from(sorted(OWNED_FIELDS)), st.data())


def write_hostile(ring: Ring, slot: int, fields: dict, tokens: list[int]) -> None:
    """A request whose fields start sane (in the hostile half of the arenas) and then get `fields`."""
    poff = HONEST_ARENA + 100 * (slot - len(HONEST_SLOTS))
    rec = SlotRequest(seq=100 + slot, prompt_offset=poff, prompt_len=len(tokens), output_offset=poff,
                      max_tokens=8, epoch=ring.get("frontend_epoch")).record()[0]
    ring.prompt_arena[poff:poff + len(tokens)] = np.asarray(tokens, np.int64).astype(np.int32)
    raw = ring.slots[slot]
    for name in rec.dtype.names:
        if name != "state":
            raw[name] = rec[name]
    for name, value in fields.items():
        raw[name] = value
    ring.state[slot] = SlotState.PREFILL_PENDING


def step_until_idle(engine: Engine, limit: int = 3000) -> None:
    for _ in range(limit):
        if not engine.step() and not engine.has_work():
            return
    raise AssertionError("the engine never went idle")


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(hostile=st.lists(st.tuples(pending_slot, PROMPT_TOKENS), min_size=1, max_size=12),
       owned=st.lists(st.tuples(st.integers(0, 11), st.sampled_from(sorted(OWNED_FIELDS)), st.data()), max_size=6),
       steps_before=st.integers(0, 5))
def test_corrupted_slots_end_in_error_and_never_escape_the_ring(hostile, owned, steps_before):
    g = GuardedRing()
    ring = g.ring
    engine = make_engine(ring)
    prompts = {0: [5, 6, 7], 1: [11] * 20, 2: [300, 301]}
    for slot, prompt in prompts.items():
        submit_honest(ring, slot, prompt, 40)
    engine.step()   # the honest requests are live before any garbage arrives (whose ranges may overlap theirs)
    hostile_slots = []
    for i, (fields, tokens) in enumerate(hostile):
        slot = len(HONEST_SLOTS) + i
        write_hostile(ring, slot, fields, tokens)
        hostile_slots.append(slot)
    for _ in range(steps_before):
        engine.step()                               # never raises
    for index, name, data in owned:                 # scribbles on slots the daemon may own now
        slot = hostile_slots[index % len(hostile_slots)]
        if int(ring.state[slot]) not in (SlotState.EMPTY, SlotState.DECODE_COMPLETED):
            ring.slots[slot][name] = data.draw(OWNED_FIELDS[name], label=f"slot {slot}.{name}")
    step_until_idle(engine)

    assert g.guards_intact(), "the engine wrote outside the ring"
    assert engine.scheduler.allocator.free_count == NUM_BLOCKS, "KV blocks leaked"
    assert not engine.owned and not engine.scheduler.running and not engine.scheduler.waiting
    for slot, prompt in prompts.items():            # honest neighbours are unharmed
        finish, error, tokens = honest_tokens(ring, slot)
        assert (finish, error) == (FinishReason.LENGTH, ErrorCode.NONE), slot
        assert tokens == [prompt[i % len(prompt)] for i in range(40)], slot
    touched = {hostile_slots[i % len(hostile_slots)] for i, _, _ in owned}
    for slot in hostile_slots:
        state = int(ring.state[slot])
        if slot in touched:
            continue                                # its state word may be garbage now: nobody owns it
        assert state == SlotState.DECODE_COMPLETED, slot
        r = ring.slots[slot]
        finish = int(r["finish_reason"])
        assert finish in (FinishReason.ERROR, FinishReason.ABORT, FinishReason.LENGTH, FinishReason.STOP)
        if finish == FinishReason.ERROR:
            assert int(r["error_code"]) in (ErrorCode.INVALID_REQUEST, ErrorCode.INVALID_TOKEN,
                                            ErrorCode.PROMPT_TOO_LONG, ErrorCode.OUT_OF_MEMORY)
            assert int(r["generated"]) == 0


def test_a_request_whose_output_range_overlaps_a_live_one_is_refused():
    """A frontend that hands out one output range twice: the second request ends INVALID_REQUEST
    and the first one's tokens are never overwritten."""
    g = GuardedRing()
    ring = g.ring
    engine = make_engine(ring)
    submit_honest(ring, 0, [5, 6, 7], 40)            # output tokens [0, 40)
    engine.step()
    write_hostile(ring, 5, {"output_offset": 30, "max_tokens": 20}, [9, 8])
    write_hostile(ring, 6, {"output_offset": 40, "max_tokens": 20}, [9, 8])   # adjacent: fine
    step_until_idle(engine)
    assert honest_tokens(ring, 0) == (FinishReason.LENGTH, ErrorCode.NONE, [[5, 6, 7][i % 3] for i in range(40)])
    assert honest_tokens(ring, 5) == (FinishReason.ERROR, ErrorCode.INVALID_REQUEST, [])
    assert honest_tokens(ring, 6)[:2] == (FinishReason.LENGTH, ErrorCode.NONE)
    assert engine.scheduler.allocator.free_count == NUM_BLOCKS


@pytest.mark.parametrize("field,value", [
    ("output_offset", GEOM.output_arena_tokens), ("output_offset", U32), ("max_tokens", U32),
    ("state", 99), ("state", SlotState.EMPTY), ("generated", U32), ("generated", 3),
])
def test_scribbling_on_an_owned_slot_ends_only_that_request(field, value):
    g = GuardedRing()
    ring = g.ring
    engine = make_engine(ring)
    submit_honest(ring, 0, [5, 6, 7], 40)
    write_hostile(ring, 5, {"max_tokens": 60, "flags": 1}, [9, 8])
    for _ in range(10):
        engine.step()
    assert int(ring.state[5]) == SlotState.DECODE_PROCESSING
    ring.slots[5][field] = value
    step_until_idle(engine)
    assert g.guards_intact()
    assert engine.scheduler.allocator.free_count == NUM_BLOCKS
    assert honest_tokens(ring, 0) == (FinishReason.LENGTH, ErrorCode.NONE, [[5, 6, 7][i % 3] for i in range(40)])
