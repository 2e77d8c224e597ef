"""Work-request planning for the verbs transport: coalescing, chains, reads, staging (no device)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared_layout.rdma.plan import (ChainLimits, StagingRing, chain_payload, coalesce, plan_read_batch,
                                              plan_reads, plan_write_chains, publish_words)
from shared_layout import HEADER, SLOT, RingGeometry, SlotRequest, SlotState, submit_writes

GEOM = RingGeometry(slot_count=8, prompt_arena_tokens=4096, output_arena_tokens=4096)
IS_PUB = publish_words(GEOM)
BIG = ChainLimits(max_wrs=256, staging_bytes=1 << 20, max_msg_bytes=1 << 30, inline_bytes=64)


def _submission(slot: int, prompt_offset: int, n: int, seq: int) -> list[tuple[int, bytes]]:
    req = SlotRequest(seq=seq, prompt_offset=prompt_offset, prompt_len=n, output_offset=slot * 64, max_tokens=64)
    return submit_writes(GEOM, slot, req, np.arange(n, dtype=np.int32) + seq)


def _apply_chains(pieces, chains) -> bytearray:
    """What the remote ring holds after the chains' WRITEs execute in post order."""
    ring = bytearray(GEOM.total_size)
    for chain in chains:
        staged = dict(chain_payload(pieces, chain))
        for op in chain.ops:
            ring[op.remote_offset:op.remote_offset + op.length] = staged[op.staging_offset]
    return ring


def _apply(writes) -> bytearray:
    ring = bytearray(GEOM.total_size)
    for off, data in writes:
        ring[off:off + len(data)] = data
    return ring


def test_publish_words_are_state_words_and_acted_on_header_words():
    for slot in range(GEOM.slot_count):
        assert IS_PUB(GEOM.slot_field_offset(slot, "state"), 4)
        assert not IS_PUB(GEOM.slot_field_offset(slot, "cancel"), 4)
        assert not IS_PUB(GEOM.slot_offset(slot) + 4, SLOT.size - 4)        # the body after the state word
        assert IS_PUB(GEOM.slot_offset(slot), SLOT.size)                     # a whole record includes it
    assert IS_PUB(GEOM.slots_offset + 4, SLOT.size)                          # body of 0 + state of 1
    assert IS_PUB(HEADER.offset("frontend_epoch"), 8)
    assert IS_PUB(HEADER.offset("frontend_doorbell"), 8)   # the device scheduler scans when it moves
    assert IS_PUB(HEADER.offset("shutdown"), 4)
    assert not IS_PUB(HEADER.offset("backend_heartbeat"), 8)
    assert not IS_PUB(GEOM.prompt_token_offset(0), 4096)
    assert not IS_PUB(GEOM.output_token_offset(5), 8)
    assert IS_PUB(0, GEOM.total_size)


def test_a_submission_keeps_its_state_word_last_and_alone():
    writes = _submission(3, 0, 10, seq=1)
    pieces = coalesce(writes, IS_PUB)
    assert pieces[-1] == writes[-1]                 # the state word, unmerged, last
    assert all(not IS_PUB(off, len(d)) for off, d in pieces[:-1])


def test_contiguous_payload_merges_and_state_words_never_do():
    prompt = GEOM.prompt_token_offset(0)
    writes = [(prompt, b"a" * 8), (prompt + 8, b"b" * 8), (prompt + 16, b"c" * 4),
              (GEOM.slot_field_offset(0, "state"), b"\x01\0\0\0"),
              (GEOM.slot_field_offset(0, "state") + 4, b"x" * 4)]   # cancel word right after a state word
    pieces = coalesce(writes, IS_PUB)
    assert pieces == [(prompt, b"a" * 8 + b"b" * 8 + b"c" * 4), writes[3], writes[4]]


def test_resets_of_many_slots_stay_one_wr_each():
    empty = np.array([SlotState.EMPTY], "<u4").tobytes()
    writes = [(GEOM.slot_field_offset(s, "state"), empty) for s in range(GEOM.slot_count)]
    assert coalesce(writes, IS_PUB) == writes


def test_burst_of_submissions_is_one_chain_with_the_last_wr_signaled_by_construction():
    writes = []
    for i in range(6):
        writes += _submission(i, i * 32, 32, seq=i + 1)
    pieces = coalesce(writes, IS_PUB)
    chains = plan_write_chains(pieces, BIG)
    assert len(chains) == 1
    assert _apply_chains(pieces, chains) == _apply(writes)
    # small state words travel inline, prompts (128 bytes) do not
    ops = chains[0].ops
    assert [op.inline for op in ops if IS_PUB(op.remote_offset, op.length)] == [True] * 6
    assert not any(op.inline for op in ops if op.length > 64)


def test_chains_respect_queue_depth_staging_and_message_size():
    writes = []
    for i in range(8):
        writes += _submission(i, i * 300, 300, seq=i + 1)   # 1200-byte prompts
    pieces = coalesce(writes, IS_PUB)
    limits = ChainLimits(max_wrs=5, staging_bytes=2048, max_msg_bytes=512, inline_bytes=0)
    chains = plan_write_chains(pieces, limits)
    assert len(chains) > 1
    for c in chains:
        assert 1 <= len(c.ops) <= 5
        assert c.staging_bytes <= 2048
        assert all(op.length <= 512 for op in c.ops)
        spans = sorted((op.staging_offset, op.staging_offset + op.length) for op in c.ops)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))   # no two ops share staging bytes
        assert all(op.staging_offset % 8 == 0 for op in c.ops)
    assert _apply_chains(pieces, chains) == _apply(writes)


def test_payload_larger_than_staging_is_split():
    prompt = GEOM.prompt_token_offset(0)
    data = bytes(range(256)) * 40   # 10240 bytes
    pieces = coalesce([(prompt, data)], IS_PUB)
    chains = plan_write_chains(pieces, ChainLimits(max_wrs=64, staging_bytes=4096, max_msg_bytes=1 << 20))
    assert len(chains) == 3 and all(c.staging_bytes <= 4096 for c in chains)
    assert _apply_chains(pieces, chains) == _apply([(prompt, data)])


def _writes_strategy():
    targets = st.one_of(
        st.tuples(st.integers(0, GEOM.slot_count - 1), st.sampled_from(["state", "cancel", "body"])),
        st.tuples(st.integers(0, 4000), st.just("prompt")),
    )

    def to_write(t, n, fill):
        where, kind = t
        if kind == "state":
            return GEOM.slot_field_offset(where, "state"), bytes([fill]) * 4
        if kind == "cancel":
            return GEOM.slot_field_offset(where, "cancel"), bytes([fill]) * 4
        if kind == "body":
            return GEOM.slot_offset(where) + 4, bytes([fill]) * (SLOT.size - 4)
        return GEOM.prompt_token_offset(where), bytes([fill]) * (4 * n)

    return st.lists(st.builds(to_write, targets, st.integers(1, 24), st.integers(1, 255)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(writes=_writes_strategy(), max_wrs=st.integers(1, 12), staging=st.sampled_from([256, 512, 4096]),
       max_msg=st.sampled_from([64, 100, 1 << 20]))
def test_chains_apply_like_the_writes_and_publish_words_follow_their_payload(writes, max_wrs, staging, max_msg):
    pieces = coalesce(writes, IS_PUB)
    chains = plan_write_chains(pieces, ChainLimits(max_wrs=max_wrs, staging_bytes=staging, max_msg_bytes=max_msg))
    assert _apply_chains(pieces, chains) == _apply(writes)
    # Order: when the op carrying a publish word lands, the ring holds exactly the
    # writes up to and including that word: everything before it, nothing after.
    staged = {}
    for c in chains:
        for soff, data in chain_payload(pieces, c):
            staged[(id(c), soff)] = data
    ring = bytearray(GEOM.total_size)
    i = 0
    for c in chains:
        for op in c.ops:
            ring[op.remote_offset:op.remote_offset + op.length] = staged[(id(c), op.staging_offset)]
            if IS_PUB(op.remote_offset, op.length):
                while not (writes[i][0] == op.remote_offset and len(writes[i][1]) == op.length
                           and IS_PUB(*_span(writes[i]))):
                    i += 1
                assert ring == _apply(writes[:i + 1])
                i += 1


def _span(w):
    return w[0], len(w[1])


def test_reads_split_by_buffer_message_and_queue():
    rounds = plan_reads(100, 10_000, buffer_bytes=4096, max_msg_bytes=1000, max_wrs=3)
    flat = [op for r in rounds for op in r]
    assert sum(op.length for op in flat) == 10_000
    assert [op.remote_offset for op in flat] == sorted(op.remote_offset for op in flat)
    assert flat[0].remote_offset == 100 and flat[-1].remote_offset + flat[-1].length == 10_100
    for r in rounds:
        assert len(r) <= 3 and sum(op.length for op in r) <= 4096
        assert [op.local_offset for op in r] == [sum(o.length for o in r[:i]) for i in range(len(r))]
    assert plan_reads(0, 0, 4096, 1000, 3) == []
    assert len(plan_reads(0, 512 * 1024, 1 << 20, 1 << 30, 256)) == 1   # a whole-ring snapshot: one READ


@settings(max_examples=150, deadline=None)
@given(reads=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 3000)), max_size=20),
       buffer_bytes=st.sampled_from([512, 4096, 1 << 20]), max_msg=st.sampled_from([100, 1 << 30]),
       max_wrs=st.integers(1, 8))
def test_read_batch_rounds_reassemble_every_range(reads, buffer_bytes, max_msg, max_wrs):
    ring = bytes(range(256)) * 60   # 15360 bytes of "remote" memory
    outs = [bytearray(n) for _, n in reads]
    for rnd in plan_read_batch(reads, buffer_bytes, max_msg, max_wrs):
        assert 1 <= len(rnd) <= max_wrs
        buf = bytearray(buffer_bytes)
        for op, _, _ in rnd:   # the NIC fills the read buffer
            assert op.length <= max_msg and op.local_offset + op.length <= buffer_bytes
            buf[op.local_offset:op.local_offset + op.length] = ring[op.remote_offset:op.remote_offset + op.length]
        for op, i, pos in rnd:
            outs[i][pos:pos + op.length] = buf[op.local_offset:op.local_offset + op.length]
    assert [bytes(o) for o in outs] == [ring[off:off + n] for off, n in reads]


def test_new_tokens_of_many_requests_are_one_round():
    reads = [(GEOM.output_token_offset(64 * s), 4 * 3) for s in range(8)]
    assert len(plan_read_batch(reads, 1 << 20, 1 << 30, 256)) == 1


def test_staging_ring_wraps_and_releases_in_order():
    r = StagingRing(1000)
    a, b, c = r.reserve(400), r.reserve(400), r.reserve(300)
    assert (a, b, c) == (0, 400, None)           # 200 left at the tail, not contiguous enough
    r.release_oldest()                           # a gone: [0, 400) free, tail [800, 1000) free
    assert r.reserve(300) == 0                   # skips the 200-byte tail, wraps to 0
    assert r.reserve(150) is None                # [300, 400) too small, tail skipped already
    r.release_oldest()
    r.release_oldest()
    assert len(r) == 0 and r.reserve(1000) == 0
    with pytest.raises(ValueError):
        r.reserve(1001)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.one_of(st.integers(1, 700), st.just(0)), max_size=60))
def test_staging_ring_never_hands_out_overlapping_live_spans(ops):
    r = StagingRing(1000)
    live: list[tuple[int, int]] = []
    for n in ops:
        if n == 0:
            if live:
                r.release_oldest()
                live.pop(0)
            continue
        start = r.reserve(n)
        if start is None:
            assert live   # an empty ring always has room for a span that fits
            continue
        assert 0 <= start and start + n <= 1000
        assert all(start + n <= s or e <= start for s, e in live)
        live.append((start, start + n))
