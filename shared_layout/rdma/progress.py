"""Work requests in flight on one RC send queue, and what their completions mean.

    post chain -> tracker.posted(n_wrs, kind) -> chain id -> wr ids (chain id << 16 | index)
    poll CQ    -> tracker.on_completion(wr_id, status, vendor_err) -> chains now finished

Only the last WR of a chain is signaled. An RC queue pair completes its WRs in
post order, so the completion of chain c's last WR finishes every chain up to
c, and frees their send-queue entries and staging spans. Any failed completion
(the erroring WR reports even when unsignaled; every later one is flushed)
means the queue pair is dead: the tracker keeps the first error, in words a
person can act on, and the transport must be rebuilt.
"""
from __future__ import annotations

import dataclasses
from collections import deque

WC_SUCCESS = 0
WC_WR_FLUSH_ERR = 5
_INDEX_BITS = 16
MAX_CHAIN_WRS = (1 << _INDEX_BITS) - 1

# enum ibv_wc_status (verbs.h), stable since the first rdma-core release
WC_STATUS_NAMES = {
    0: "SUCCESS", 1: "LOC_LEN_ERR", 2: "LOC_QP_OP_ERR", 3: "LOC_EEC_OP_ERR", 4: "LOC_PROT_ERR",
    5: "WR_FLUSH_ERR", 6: "MW_BIND_ERR", 7: "BAD_RESP_ERR", 8: "LOC_ACCESS_ERR", 9: "REM_INV_REQ_ERR",
    10: "REM_ACCESS_ERR", 11: "REM_OP_ERR", 12: "RETRY_EXC_ERR", 13: "RNR_RETRY_EXC_ERR",
    14: "LOC_RDD_VIOL_ERR", 15: "REM_INV_RD_REQ_ERR", 16: "REM_ABORT_ERR", 17: "INV_EECN_ERR",
    18: "INV_EEC_STATE_ERR", 19: "FATAL_ERR", 20: "RESP_TIMEOUT_ERR", 21: "GENERAL_ERR",
    22: "TM_ERR", 23: "TM_RNDV_INCOMPLETE",
}
_HINTS = {
    12: "the daemon's queue pair stopped answering: daemon stopped, host down or link lost",
    13: "the daemon's queue pair is not ready to receive",
    10: "the daemon refused the access: its ring was deregistered (daemon restarted?)",
    9: "the daemon rejected the request (outside its registered ring?)",
    15: "the daemon rejected the RDMA READ (outside its registered ring?)",
    11: "the daemon's NIC could not complete the operation",
    20: "the daemon's NIC did not respond in time",
    5: "the queue pair had already failed",
    19: "fatal error on the local RDMA device",
}


def describe_wc(status: int, vendor_err: int = 0, kind: str = "RDMA operation") -> str:
    name = WC_STATUS_NAMES.get(status, f"status {status}")
    hint = _HINTS.get(status, "the RDMA connection failed")
    return f"{kind} failed with {name} (vendor error {vendor_err:#x}): {hint}"


def wr_id(chain_id: int, index: int) -> int:
    if not 0 <= index <= MAX_CHAIN_WRS:
        raise ValueError(f"WR index {index} outside a chain of at most {MAX_CHAIN_WRS}")
    return (chain_id << _INDEX_BITS) | index


def chain_of(wrid: int) -> int:
    return wrid >> _INDEX_BITS


@dataclasses.dataclass(frozen=True)
class Posted:
    chain_id: int
    n_wrs: int
    kind: str              # "RDMA WRITE" or "RDMA READ"
    holds_staging: bool    # a staging span is released when this chain finishes


class CompletionTracker:
    """Chains in flight on one send queue of `sq_depth` entries, oldest first."""

    def __init__(self, sq_depth: int):
        if sq_depth < 1:
            raise ValueError("send queue depth must be at least 1")
        self.sq_depth = sq_depth
        self.in_flight: deque[Posted] = deque()
        self.in_flight_wrs = 0
        self.next_chain = 1
        self.finished_upto = 0         # every chain id <= this one has completed
        self.error: str | None = None

    def room(self, n_wrs: int) -> bool:
        """May a chain of `n_wrs` be posted without overrunning the send queue?"""
        return self.in_flight_wrs + n_wrs <= self.sq_depth

    def posted(self, n_wrs: int, kind: str, holds_staging: bool = False) -> int:
        if not 1 <= n_wrs <= min(self.sq_depth, MAX_CHAIN_WRS):
            raise ValueError(f"chain of {n_wrs} WRs does not fit a {self.sq_depth}-entry send queue")
        if not self.room(n_wrs):
            raise RuntimeError("send queue full: reap completions before posting")
        p = Posted(self.next_chain, n_wrs, kind, holds_staging)
        self.next_chain += 1
        self.in_flight.append(p)
        self.in_flight_wrs += n_wrs
        return p.chain_id

    def on_completion(self, wrid: int, status: int, vendor_err: int = 0) -> list[Posted]:
        """Chains finished by this completion (oldest first); records the first failure."""
        chain = chain_of(wrid)
        if status != WC_SUCCESS:
            if self.error is None or (status != WC_WR_FLUSH_ERR and self.error.startswith("flushed:")):
                kind = next((p.kind for p in self.in_flight if p.chain_id == chain), "RDMA operation")
                msg = describe_wc(status, vendor_err, kind)
                self.error = ("flushed: " + msg) if status == WC_WR_FLUSH_ERR else msg
            return []
        done = []
        while self.in_flight and self.in_flight[0].chain_id <= chain:
            p = self.in_flight.popleft()
            self.in_flight_wrs -= p.n_wrs
            done.append(p)
        self.finished_upto = max(self.finished_upto, chain)
        return done

    def finished(self, chain_id: int) -> bool:
        return chain_id <= self.finished_upto

    @property
    def failed(self) -> bool:
        return self.error is not None

    def failure(self) -> str:
        """The error a person should see (the root cause, not the flush that followed it)."""
        err = self.error or "no failure"
        return err.removeprefix("flushed: ")
