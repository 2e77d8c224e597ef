"""Property tests of the slot state machine through the real accessors."""
import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from shared_layout import (BackendPort, ErrorCode, FinishReason, FrontendPort, IllegalTransition, Ring,
                           RingGeometry, Side, SlotRequest, SlotState, check_transition)
from shared_layout.states import OWNER, TRANSITIONS

STATES = list(SlotState)


def test_every_transition_is_made_by_the_owner_of_its_source():
    for (a, b), side in TRANSITIONS.items():
        assert OWNER[a] == side
        check_transition(a, b, side)
        with pytest.raises(IllegalTransition, match="may not move"):
            check_transition(a, b, Side(1 - side))


def test_lifecycle_is_complete():
    # the main path of the paper exists, and every state can reach EMPTY again
    path = [SlotState.EMPTY, SlotState.PREFILL_PENDING, SlotState.PREFILL_PROCESSING,
            SlotState.DECODE_PROCESSING, SlotState.DECODE_COMPLETED, SlotState.EMPTY]
    for a, b in zip(path, path[1:]):
        assert (a, b) in TRANSITIONS
    for s in SlotState:
        seen, todo = {s}, [s]
        while todo:
            x = todo.pop()
            for (a, b) in TRANSITIONS:
                if a == x and b not in seen:
                    seen.add(b)
                    todo.append(b)
        assert SlotState.EMPTY in seen


class SlotMachine(RuleBasedStateMachine):
    """Both sides fire arbitrary events at a few slots; the ring never holds an illegal state."""

    N = 4

    @initialize()
    def setup(self):
        self.geom = RingGeometry(self.N, 64, 64)
        self.ring = Ring.create(bytearray(self.geom.total_size), self.geom)
        self.fe, self.be = FrontendPort(self.ring), BackendPort(self.ring)
        self.model = [SlotState.EMPTY] * self.N
        self.seq = 0

    def _try(self, slot, side, to, act):
        frm = self.model[slot]
        legal = TRANSITIONS.get((frm, to)) == side
        try:
            act()
        except IllegalTransition:
            assert not legal, f"{side.name} {frm.name}->{to.name} was refused"
            return
        assert legal, f"{side.name} {frm.name}->{to.name} was allowed"
        self.model[slot] = to

    @rule(slot=st.integers(0, N - 1), plen=st.integers(1, 8), mt=st.integers(1, 8))
    def submit(self, slot, plen, mt):
        self.seq += 1
        req = SlotRequest(seq=self.seq, prompt_offset=slot * 8, prompt_len=plen, output_offset=slot * 8, max_tokens=mt)
        self._try(slot, Side.FRONTEND, SlotState.PREFILL_PENDING,
                  lambda: self.fe.submit(slot, req, np.arange(plen, dtype=np.int32)))

    @rule(slot=st.integers(0, N - 1), to=st.sampled_from(STATES))
    def backend_moves(self, slot, to):
        if to == SlotState.DECODE_COMPLETED:
            self._try(slot, Side.BACKEND, to, lambda: self.be.complete(slot, FinishReason.STOP))
        else:
            self._try(slot, Side.BACKEND, to, lambda: self.be.move(slot, to))

    @rule(slot=st.integers(0, N - 1))
    def frontend_resets(self, slot):
        self._try(slot, Side.FRONTEND, SlotState.EMPTY, lambda: self.fe.reset(slot))

    @rule(slot=st.integers(0, N - 1))
    def frontend_cancels(self, slot):
        self.fe.cancel(slot)  # legal in every state, changes no state

    @rule(slot=st.integers(0, N - 1))
    def backend_publishes(self, slot):
        state = self.model[slot]
        r = self.ring.slots[slot]
        room = int(r["generated"]) < int(r["max_tokens"])
        try:
            self.be.publish(slot, [7])
        except IllegalTransition:
            assert OWNER[state] != Side.BACKEND or not room
            return
        assert OWNER[state] == Side.BACKEND and room

    @invariant()
    def ring_matches_model(self):
        if hasattr(self, "ring"):
            assert [SlotState(int(s)) for s in self.ring.state] == self.model
            assert (self.ring.slots["generated"] <= self.ring.slots["max_tokens"]).all()


SlotMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)
TestSlotMachine = SlotMachine.TestCase


def test_full_cycle_via_ports():
    geom = RingGeometry(2, 32, 32)
    ring = Ring.create(bytearray(geom.total_size), geom)
    fe, be = FrontendPort(ring), BackendPort(ring)
    req = SlotRequest(seq=5, prompt_offset=3, prompt_len=4, output_offset=10, max_tokens=3, temperature=0.5,
                      top_p=0.75, top_k=40, seed=123, ignore_eos=True, stop_ids=(2, 9))
    fe.submit(1, req, np.array([1, 2, 3, 4]))
    assert list(be.pending()) == [1]
    assert ring.slot_request(1) == req
    assert list(ring.prompt_arena[3:7]) == [1, 2, 3, 4]
    be.claim(1)
    be.publish(1, [11])
    be.move(1, SlotState.DECODE_PROCESSING)
    be.publish(1, [12, 13])
    with pytest.raises(IllegalTransition):
        be.publish(1, [14])  # beyond max_tokens
    be.complete(1, FinishReason.LENGTH)
    state, seq, gen = fe.poll(1)
    assert (state, seq, gen) == (SlotState.DECODE_COMPLETED, 5, 3)
    assert list(ring.tokens(1, 0, gen)) == [11, 12, 13]
    assert int(ring.slots[1]["finish_reason"]) == FinishReason.LENGTH
    assert int(ring.slots[1]["error_code"]) == ErrorCode.NONE
    r = ring.slots[1]
    assert 0 < r["t_picked_ns"] <= r["t_first_ns"] <= r["t_last_ns"]
    fe.reset(1)
    assert ring.state[1] == SlotState.EMPTY
