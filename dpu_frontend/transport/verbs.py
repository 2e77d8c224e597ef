"""Verbs transport: the ring behind a NIC, reached with one-sided RDMA on one RC queue pair.

    VerbsTransport.connect(config): pick port -> RC QP -> TCP hello with the daemon
        (shared_layout.rdma.bootstrap) -> QP to RTS -> RDMA READ the header -> geometry
    write_batch: coalesce (publish words alone) -> chains -> copy into the staging MR
        -> one post_send per chain, last WR signaled; returns without waiting
    read / read_into / read_batch: RDMA READ chain into the read MR -> progress until it
        completes -> copies (read_batch: many ranges, e.g. new tokens of many requests, one chain)
    progress: poll the CQ -> finish chains in order -> release staging / queue room;
        the first failed completion breaks the transport (TransportError from then on)

Ordering (the Transport contract in base.py): every operation goes through one
RC send queue, which executes in post order, and an RDMA READ does not pass
earlier RDMA WRITEs of the same QP; so a read sees this frontend's earlier
writes and a state word never lands before its payload. Writes are not waited
for: their completions are reaped by the next call, and a failure surfaces
there. When the daemon goes away (its QP stops answering, or the bootstrap
socket closes) `stale()` turns true and RingClient reconnects through the
factory, which runs the bootstrap again.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import socket
import threading
import time

from shared_layout import HEADER, LayoutMismatch, RingGeometry

from .base import RingNotFound, TransportError, TransportFactory
from shared_layout.rdma.bootstrap import (DEFAULT_PORT, BootstrapError, BootstrapUnreachable, ClientHello, RingRegion,
                             client_handshake, parse_endpoint, peer_closed)
from shared_layout.rdma.device import (HostBuffer, RcQueuePair, VerbsPort, import_pyverbs, pick_port, read_chain, scan_ports,
                          write_chain)
from shared_layout.rdma.plan import (ChainLimits, StagingRing, chain_payload, coalesce, plan_read_batch, plan_reads,
                        plan_write_chains, publish_words)
from shared_layout.rdma.progress import CompletionTracker


@dataclasses.dataclass(frozen=True)
class VerbsConfig:
    host: str
    port: int = DEFAULT_PORT
    device: str | None = None          # RDMA device name (mlx5_0, rxe0); None: first active
    ib_port: int | None = None         # 1-based port of that device; None: first active
    gid_index: int | None = None       # None: RoCE v2 IPv4-mapped GID, or 0 on InfiniBand
    connect_timeout_s: float = 5.0     # TCP bootstrap
    op_timeout_s: float = 5.0          # one RDMA READ, or waiting for send-queue / staging room
    sq_depth: int = 256                # send queue entries (WRs in flight)
    staging_bytes: int = 2 << 20       # registered buffer write payloads are copied into
    read_buffer_bytes: int = 1 << 20   # initial READ target; grows to the largest read
    max_read_buffer_bytes: int = 64 << 20
    inline_bytes: int = 64             # payloads this small travel inside the WQE
    max_rd_atomic: int = 16            # RDMA READs in flight

    def __post_init__(self):
        if not self.host:
            raise ValueError("verbs transport needs the daemon's address (--daemon HOST:PORT)")
        for name in ("sq_depth", "staging_bytes", "read_buffer_bytes", "max_read_buffer_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.connect_timeout_s <= 0 or self.op_timeout_s <= 0:
            raise ValueError("timeouts must be positive")


class VerbsTransport:
    shares_clock = False   # the daemon stamps heartbeat_ns with another machine's clock

    def __init__(self, config: VerbsConfig, vport, qp, sock: socket.socket, region: RingRegion):
        self.config = config
        self.vport, self.qp, self.sock, self.region = vport, qp, sock, region
        self.E = vport.E
        self.tracker = CompletionTracker(qp.sq_depth)
        self.staging = StagingRing(config.staging_bytes)
        self._staging_buf = HostBuffer(config.staging_bytes)
        self._staging_mr = vport.register(self._staging_buf.addr, config.staging_bytes, remote=False)
        self._read_buf = self._read_mr = None
        self._grow_read_buffer(config.read_buffer_bytes)
        self._limits = ChainLimits(max_wrs=qp.sq_depth, staging_bytes=config.staging_bytes,
                                   max_msg_bytes=vport.max_msg_bytes, inline_bytes=qp.inline_bytes)
        self._lock = threading.RLock()
        self._closed = False
        self.geometry: RingGeometry = RingGeometry.from_header(self._read_locked(0, HEADER.size))
        if self.geometry.total_size > region.length:
            raise LayoutMismatch(f"daemon registered {region.length} bytes, its ring header says "
                                 f"{self.geometry.total_size}")
        self._is_publish = publish_words(self.geometry)

    # -- setup ---------------------------------------------------------------------
    @classmethod
    def connect(cls, config: VerbsConfig) -> "VerbsTransport":
        """Open the RDMA port, run the bootstrap, connect the QP and read the ring header.

        NoRdmaDevice without a device, RingNotFound while no daemon answers (the
        caller may retry), LayoutMismatch for an incompatible daemon,
        TransportError otherwise.
        """
        port = pick_port(scan_ports(), config.device, config.ib_port)
        vport = VerbsPort(port, config.gid_index)
        qp = sock = None
        try:
            qp = RcQueuePair(vport, config.sq_depth, config.inline_bytes, responder=False)
            max_rd = min(config.max_rd_atomic, vport.max_qp_init_rd_atom) or 1
            hello = ClientHello(qp.address(), max_rd_atomic=max_rd)
            try:
                sock, reply = client_handshake(config.host, config.port, hello, config.connect_timeout_s)
            except BootstrapUnreachable as e:
                raise RingNotFound(str(e)) from None
            except BootstrapError as e:
                if "layout version" in str(e):
                    raise LayoutMismatch(str(e)) from None
                raise TransportError(str(e)) from None
            max_rd = min(max_rd, reply.max_dest_rd_atomic) or 1
            qp.connect(reply.qp, max_rd_atomic=max_rd, max_dest_rd_atomic=1)
            return cls(config, vport, qp, sock, reply.ring)
        except BaseException:
            if sock is not None:
                sock.close()
            vport.close()
            raise

    # -- Transport -----------------------------------------------------------------
    def read(self, offset: int, nbytes: int) -> bytes:
        with self._lock:
            self._usable()
            self.region.remote_addr(offset, nbytes)   # ValueError outside the ring
            return self._read_locked(offset, nbytes)

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill `out` with ring bytes [offset, offset + len(out)) (one copy, for bulk reads)."""
        out = memoryview(out).cast("B")
        with self._lock:
            self._usable()
            self.region.remote_addr(offset, out.nbytes)
            self._read_into_locked(offset, out)

    def read_batch(self, reads: list[tuple[int, int]]) -> list[bytes]:
        """Copies of several ring ranges, fetched as one chain of RDMA READs (one round trip)."""
        with self._lock:
            self._usable()
            for off, n in reads:
                self.region.remote_addr(off, n)
            outs = [bytearray(n) for _, n in reads]
            total = sum(n for _, n in reads)
            want = min(max(total, self.config.read_buffer_bytes), self.config.max_read_buffer_bytes)
            if want > self._read_buf.nbytes:
                self._grow_read_buffer(want)
            for rnd in plan_read_batch(reads, self._read_buf.nbytes, self.vport.max_msg_bytes, self.qp.sq_depth):
                self._read_round([op for op, _, _ in rnd])
                view = self._read_buf.view
                for op, i, pos in rnd:
                    outs[i][pos:pos + op.length] = view[op.local_offset:op.local_offset + op.length]
            return [bytes(b) for b in outs]

    def write(self, offset: int, data: bytes) -> None:
        self.write_batch([(offset, data)])

    def write_batch(self, writes: list[tuple[int, bytes]]) -> None:
        with self._lock:
            self._usable()
            for off, data in writes:
                self.region.remote_addr(off, len(data))
            pieces = coalesce(writes, self._is_publish)
            for chain in plan_write_chains(pieces, self._limits):
                # queue room first: waiting for staging room only ever frees more of it
                self._wait_for(lambda: self.tracker.room(len(chain.ops)) or None, "send queue room")
                start = self._wait_for(lambda: self.staging.reserve(chain.staging_bytes), "staging room")
                view = self._staging_buf.view
                for soff, data in chain_payload(pieces, chain):
                    view[start + soff:start + soff + len(data)] = data
                chain_id = self.tracker.posted(len(chain.ops), "RDMA WRITE", holds_staging=True)
                wrs = write_chain(self.E, list(chain.ops), chain_id, self._staging_buf.addr + start,
                                  self._staging_mr.lkey, self.region.rkey, self.region.addr)
                self._post(wrs)
            self.progress()

    def stale(self) -> bool:
        with self._lock:
            if self._closed:
                return True
            try:
                self.progress()
            except TransportError:
                return True
            return peer_closed(self.sock)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self.tracker.failed and self.tracker.in_flight:
                try:   # let posted writes land before the QP is destroyed
                    self._wait_for(lambda: (not self.tracker.in_flight) or None, "outstanding writes")
                except TransportError:
                    pass
            self.sock.close()
            for mr in (self._staging_mr, self._read_mr):
                mr.close()
            self.qp.close()
            self.vport.close()
            self._staging_buf.close()
            self._read_buf.close()

    # -- progress --------------------------------------------------------------------
    def progress(self) -> int:
        """Reap completions without blocking; TransportError once the QP has failed."""
        n = 0
        while True:
            wcs = self.qp.poll(32)
            for wrid, status, vendor_err in wcs:
                for p in self.tracker.on_completion(wrid, status, vendor_err):
                    if p.holds_staging:
                        self.staging.release_oldest()
            n += len(wcs)
            if len(wcs) < 32:
                break
        if self.tracker.failed:
            raise TransportError(f"RDMA connection to {self._peer()} lost: {self.tracker.failure()}")
        return n

    def _wait_for(self, cond, what: str):
        """Run progress until cond() returns something other than None; bounded by op_timeout_s."""
        got = cond()
        if got is not None:
            return got
        deadline = time.monotonic() + self.config.op_timeout_s
        spins = 0
        while True:
            self.progress()
            got = cond()
            if got is not None:
                return got
            spins += 1
            if spins > 2000:   # past the fast path (a few us per op): stop burning a core
                if time.monotonic() > deadline:
                    self.tracker.error = self.tracker.error or (
                        f"no completion within {self.config.op_timeout_s:g} s while waiting for {what}")
                    self.progress()
                time.sleep(50e-6)

    # -- helpers -----------------------------------------------------------------------
    def _read_locked(self, offset: int, nbytes: int) -> bytes:
        out = bytearray(nbytes)
        self._read_into_locked(offset, memoryview(out))
        return bytes(out)

    def _read_into_locked(self, offset: int, out: memoryview) -> None:
        nbytes = out.nbytes
        if nbytes == 0:
            return
        want = min(max(nbytes, self.config.read_buffer_bytes), self.config.max_read_buffer_bytes)
        if want > self._read_buf.nbytes:
            self._grow_read_buffer(want)
        pos = 0
        for ops in plan_reads(offset, nbytes, self._read_buf.nbytes, self.vport.max_msg_bytes,
                              max_wrs=self.qp.sq_depth):
            self._read_round(ops)
            n = sum(op.length for op in ops)
            out[pos:pos + n] = self._read_buf.view[:n]
            pos += n

    def _read_round(self, ops: list) -> None:
        """Post one chain of READs into the read buffer and progress until it completes."""
        self._wait_for(lambda: self.tracker.room(len(ops)) or None, "send queue room")
        chain_id = self.tracker.posted(len(ops), "RDMA READ")
        self._post(read_chain(self.E, ops, chain_id, self._read_buf.addr, self._read_mr.lkey,
                              self.region.rkey, self.region.addr))
        self._wait_for(lambda: self.tracker.finished(chain_id) or None, "an RDMA READ")

    def _grow_read_buffer(self, nbytes: int) -> None:
        buf = HostBuffer(nbytes)
        mr = self.vport.register(buf.addr, nbytes, remote=False)
        if self._read_mr is not None:
            self._read_mr.close()
            self._read_buf.close()
        self._read_buf, self._read_mr = buf, mr

    def _post(self, wrs: list) -> None:
        try:
            self.qp.post(wrs)
        except TransportError as e:
            self.tracker.error = self.tracker.error or str(e)
            raise

    def _usable(self) -> None:
        if self._closed:
            raise TransportError(f"verbs transport to {self._peer()} is closed")
        if self.tracker.failed:
            raise TransportError(f"RDMA connection to {self._peer()} lost: {self.tracker.failure()}")

    def _peer(self) -> str:
        return f"{self.config.host}:{self.config.port}"

    def __repr__(self) -> str:
        return f"VerbsTransport({self._peer()}, {self.vport.port}, ring={self.region.placement})"


def verbs_factory(config: VerbsConfig) -> TransportFactory:
    """A factory RingClient calls to (re)connect to the daemon over RDMA."""
    return functools.partial(VerbsTransport.connect, config)


# -- command line ---------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--transport shm|verbs`, `--daemon HOST:PORT` and the RDMA device options."""
    try:
        parser.add_argument("--transport", choices=("shm", "verbs"), default="shm",
                            help="how to reach the ring: shared memory on this machine (default) "
                                 "or RDMA verbs to a daemon on another machine")
    except argparse.ArgumentError:
        pass   # the caller already offers --transport
    g = parser.add_argument_group("RDMA (--transport verbs)")
    g.add_argument("--daemon", metavar="HOST:PORT", default=None,
                   help=f"the GPU daemon's RDMA bootstrap address (port defaults to {DEFAULT_PORT})")
    g.add_argument("--rdma-device", default=None, help="RDMA device, e.g. mlx5_0 (default: first active)")
    g.add_argument("--rdma-port", type=int, default=None, help="port of that device (default: first active)")
    g.add_argument("--rdma-gid-index", type=int, default=None,
                   help="GID index (default: a RoCE v2 IPv4 GID, or 0 on InfiniBand)")


def config_from_args(args: argparse.Namespace) -> VerbsConfig | None:
    """The VerbsConfig the flags ask for, or None for the shared-memory transport.

    Exits with one line (no traceback) on a bad address or when this machine
    has no RDMA device.
    """
    if getattr(args, "transport", "shm") != "verbs":
        return None
    if not args.daemon:
        raise SystemExit("--transport verbs needs --daemon HOST:PORT (the GPU daemon's RDMA bootstrap address)")
    try:
        host, port = parse_endpoint(args.daemon)
        config = VerbsConfig(host=host, port=port, device=args.rdma_device, ib_port=args.rdma_port,
                             gid_index=args.rdma_gid_index)
    except ValueError as e:
        raise SystemExit(f"--daemon: {e}") from None
    check_device(config)
    return config


def transport_factory_from_args(args: argparse.Namespace) -> TransportFactory | None:
    """`verbs_factory(config_from_args(args))`, or None for the shared-memory transport."""
    config = config_from_args(args)
    return None if config is None else verbs_factory(config)


def check_device(config: VerbsConfig) -> None:
    """Exit with one line unless pyverbs and a usable RDMA port are present."""
    try:
        pick_port(scan_ports(), config.device, config.ib_port)
        import_pyverbs()
    except TransportError as e:
        raise SystemExit(str(e)) from None
