"""Completion tracking for the verbs transport: in-order chains, queue room, failures in words."""
from __future__ import annotations

import pytest

from shared_layout.rdma.progress import (MAX_CHAIN_WRS, WC_SUCCESS, WC_WR_FLUSH_ERR, CompletionTracker,
                                                  chain_of, describe_wc, wr_id)

RETRY_EXC_ERR, REM_ACCESS_ERR = 12, 10


def test_wr_ids_carry_their_chain():
    assert chain_of(wr_id(7, 0)) == 7 and chain_of(wr_id(7, MAX_CHAIN_WRS)) == 7
    assert wr_id(7, 1) != wr_id(7, 2)
    with pytest.raises(ValueError):
        wr_id(1, MAX_CHAIN_WRS + 1)


def test_one_signaled_completion_finishes_every_earlier_chain():
    t = CompletionTracker(sq_depth=10)
    a = t.posted(3, "RDMA WRITE", holds_staging=True)
    b = t.posted(2, "RDMA WRITE", holds_staging=True)
    c = t.posted(1, "RDMA READ")
    assert t.in_flight_wrs == 6 and t.room(4) and not t.room(5)
    with pytest.raises(RuntimeError, match="send queue full"):
        t.posted(5, "RDMA WRITE")
    done = t.on_completion(wr_id(b, 1), WC_SUCCESS)   # a's completion was coalesced away
    assert [p.chain_id for p in done] == [a, b] and all(p.holds_staging for p in done)
    assert t.finished(a) and t.finished(b) and not t.finished(c)
    assert t.in_flight_wrs == 1
    assert [p.chain_id for p in t.on_completion(wr_id(c, 0), WC_SUCCESS)] == [c]
    assert t.in_flight_wrs == 0 and not t.failed


def test_a_chain_larger_than_the_queue_is_refused():
    t = CompletionTracker(sq_depth=4)
    with pytest.raises(ValueError, match="does not fit"):
        t.posted(5, "RDMA WRITE")


def test_failure_keeps_the_root_cause_over_the_flushes_that_follow():
    t = CompletionTracker(sq_depth=16)
    a = t.posted(4, "RDMA WRITE")
    b = t.posted(1, "RDMA READ")
    assert t.on_completion(wr_id(a, 2), RETRY_EXC_ERR, 0x81) == []
    t.on_completion(wr_id(a, 3), WC_WR_FLUSH_ERR)
    t.on_completion(wr_id(b, 0), WC_WR_FLUSH_ERR)
    assert t.failed and not t.finished(a)
    msg = t.failure()
    assert msg.startswith("RDMA WRITE failed with RETRY_EXC_ERR (vendor error 0x81)")
    assert "stopped answering" in msg


def test_a_root_cause_arriving_after_a_flush_replaces_it():
    t = CompletionTracker(sq_depth=16)
    a = t.posted(1, "RDMA READ")
    t.on_completion(wr_id(a, 0), WC_WR_FLUSH_ERR)
    assert "already failed" in t.failure()
    t.on_completion(wr_id(a, 0), REM_ACCESS_ERR)
    assert t.failure().startswith("RDMA READ failed with REM_ACCESS_ERR")
    assert "deregistered" in t.failure()


def test_unknown_status_is_still_described():
    assert "status 99" in describe_wc(99)
