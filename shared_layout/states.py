"""Slot lifecycle: states, the side that owns each one, and the legal transitions.

The ring is shared by two writers that never lock: the frontend (DPU or host)
and the backend (GPU scheduler or CPU executor). Safety comes from ownership:
in every state exactly one side may write the slot record, and only that side
may move the state word on. The single exception is the cancel flag, which the
frontend may raise in any state (the backend only reads it).

    EMPTY --frontend--> PREFILL_PENDING --backend claims (CAS)--> PREFILL_PROCESSING
      ^                       |                                       |
      |                       +--(cancelled/invalid)--+               v
      |                                               |      DECODE_PROCESSING <-> DECODE_PAUSED
      |                                               v               |
      +---------frontend resets------------- DECODE_COMPLETED <-------+

Everything here is pure data plus `check_transition`, used by the Python
accessors (ring.py), by the property tests, and emitted into the C header.
"""
from __future__ import annotations

import enum


class SlotState(enum.IntEnum):
    EMPTY = 0
    PREFILL_PENDING = 1
    PREFILL_PROCESSING = 2
    DECODE_PROCESSING = 3
    DECODE_PAUSED = 4
    DECODE_COMPLETED = 5


class Side(enum.IntEnum):
    FRONTEND = 0
    BACKEND = 1


class FinishReason(enum.IntEnum):
    """Why a request ended; mirrors OpenAI's finish_reason (plus ERROR)."""
    NONE = 0
    STOP = 1      # EOS or a stop token id
    LENGTH = 2    # max_tokens or the context limit
    ABORT = 3     # cancel flag, backend shutdown, stale frontend epoch
    ERROR = 4     # see error_code


class ErrorCode(enum.IntEnum):
    NONE = 0
    INVALID_REQUEST = 1     # slot fields out of range (offsets, lengths, params)
    INVALID_TOKEN = 2       # a prompt token id outside the vocabulary
    PROMPT_TOO_LONG = 3     # prompt does not fit the model context / KV pool
    OUT_OF_MEMORY = 4       # KV pool can never hold this request
    BACKEND_SHUTDOWN = 5    # daemon stopped while the request ran
    STALE_EPOCH = 6         # submitted by a frontend that has since restarted
    INTERNAL = 7            # executor failure; the daemon keeps serving


class BackendStatus(enum.IntEnum):
    """Header word the daemon keeps current; the frontend's /health reads it."""
    DOWN = 0
    STARTING = 1
    READY = 2
    STOPPING = 3


OWNER: dict[SlotState, Side] = {
    SlotState.EMPTY: Side.FRONTEND,
    SlotState.PREFILL_PENDING: Side.BACKEND,
    SlotState.PREFILL_PROCESSING: Side.BACKEND,
    SlotState.DECODE_PROCESSING: Side.BACKEND,
    SlotState.DECODE_PAUSED: Side.BACKEND,
    SlotState.DECODE_COMPLETED: Side.FRONTEND,
}

_S = SlotState
# (from, to): the side allowed to make the move. The mover is always the owner
# of `from`: ownership passes with the state word.
TRANSITIONS: dict[tuple[SlotState, SlotState], Side] = {
    (_S.EMPTY, _S.PREFILL_PENDING): Side.FRONTEND,                 # submit
    (_S.PREFILL_PENDING, _S.PREFILL_PROCESSING): Side.BACKEND,     # claim (CAS)
    (_S.PREFILL_PENDING, _S.DECODE_COMPLETED): Side.BACKEND,       # rejected / cancelled before prefill
    (_S.PREFILL_PROCESSING, _S.DECODE_PROCESSING): Side.BACKEND,   # first token out
    (_S.PREFILL_PROCESSING, _S.DECODE_COMPLETED): Side.BACKEND,    # done at the first token, error, cancel
    (_S.PREFILL_PROCESSING, _S.DECODE_PAUSED): Side.BACKEND,       # admitted but no KV room yet
    (_S.DECODE_PROCESSING, _S.DECODE_PAUSED): Side.BACKEND,        # preempted
    (_S.DECODE_PROCESSING, _S.DECODE_COMPLETED): Side.BACKEND,     # EOS, stop id, length, cancel
    (_S.DECODE_PAUSED, _S.DECODE_PROCESSING): Side.BACKEND,        # resumed
    (_S.DECODE_PAUSED, _S.DECODE_COMPLETED): Side.BACKEND,         # cancelled or aborted while paused
    (_S.DECODE_COMPLETED, _S.EMPTY): Side.FRONTEND,                # frontend read the result
}
assert all(OWNER[a] == side for (a, _), side in TRANSITIONS.items())

# States in which the backend holds resources (KV blocks, batch seats) for a slot.
ACTIVE_BACKEND_STATES = frozenset({_S.PREFILL_PROCESSING, _S.DECODE_PROCESSING, _S.DECODE_PAUSED})


class IllegalTransition(ValueError):
    """A state change the protocol forbids, or one attempted by the non-owner."""


def check_transition(frm: int, to: int, side: Side) -> None:
    """Raise IllegalTransition unless `side` may move a slot from `frm` to `to`."""
    try:
        a, b = SlotState(frm), SlotState(to)
    except ValueError:
        raise IllegalTransition(f"unknown slot state in {frm} -> {to}") from None
    mover = TRANSITIONS.get((a, b))
    if mover is None:
        raise IllegalTransition(f"{a.name} -> {b.name} is not a legal transition")
    if mover != side:
        raise IllegalTransition(
            f"{side.name.lower()} may not move a slot {a.name} -> {b.name}: "
            f"{OWNER[a].name.lower()} owns {a.name}")


def check_write(state: int, side: Side) -> None:
    """Raise IllegalTransition if `side` may not write a slot record in `state`."""
    s = SlotState(state)
    if OWNER[s] != side:
        raise IllegalTransition(
            f"{side.name.lower()} may not write a slot in {s.name}: {OWNER[s].name.lower()} owns it")
