"""Verbs transport traffic on a real RDMA device (mlx5 or rxe), both players in one process.

As rdma-core's own tests do (`create_players`), the daemon side (RdmaRingServer over a
real ring in host memory) and the frontend side (VerbsTransport) are built in this
process and talk through the device over loopback. Marked `rdma`: skipped without a
device and pyverbs (tests/conftest.py).
"""
from __future__ import annotations

import dataclasses
import mmap
import time

import numpy as np
import pytest

from dpu_frontend.ring_session import RingSession
from shared_layout.errors import TransportError
from shared_layout.rdma.device import NoRdmaDevice
from dpu_frontend.transport.verbs import VerbsConfig, VerbsTransport, verbs_factory
from gpu_backend.rdma_server import RdmaRingServer, RdmaServerConfig
from shared_layout import BackendPort, FinishReason, Ring, RingGeometry, SlotState

pytestmark = pytest.mark.rdma
GEOM = RingGeometry(slot_count=64, prompt_arena_tokens=1 << 16, output_arena_tokens=1 << 16)


class Players:
    """A host ring registered by the daemon side, and frontends connected to it."""

    def __init__(self, **frontend):
        self.buf = mmap.mmap(-1, GEOM.total_size)
        self.ring = Ring.create(self.buf, GEOM)
        self.backend = BackendPort(self.ring)
        self.frontend_opts = frontend
        self.server = self.port = None
        self.start_server()

    def start_server(self, port: int = 0):
        try:
            self.server = RdmaRingServer.open(RdmaServerConfig(listen_host="127.0.0.1", listen_port=port))
        except NoRdmaDevice as e:   # e.g. only an iWARP (siw) device, which needs rdma_cm
            pytest.skip(str(e))
        self.server.register_host_ring(self.buf, GEOM.total_size)
        _, self.port = self.server.serve()

    def connect(self) -> VerbsTransport:
        return VerbsTransport.connect(VerbsConfig(host="127.0.0.1", port=self.port, **self.frontend_opts))

    def close(self):
        self.server.close()


@pytest.fixture
def players():
    p = Players()
    yield p
    p.close()


def _submit_all(session: RingSession, n: int, prompt_len: int) -> list:
    writes, flights = [], []
    for i in range(n):
        f = session.reserve(prompt_len, 8)
        prompt = np.arange(prompt_len, dtype=np.int32) + 1000 * i
        writes += session.submission(f, prompt, temperature=0.0, top_p=1.0, top_k=0, seed=None,
                                     ignore_eos=False, stop_ids=(), t_submit_ns=i + 1)
        flights.append((f, prompt))
    session.transport.write_batch(writes)
    return flights


def test_connect_reads_the_header(players):
    t = players.connect()
    try:
        assert t.geometry == GEOM and t.shares_clock is False
        assert t.region.placement == "host" and t.region.length == GEOM.total_size
        assert players.server.frontends == 1
    finally:
        t.close()


def test_a_burst_of_submissions_lands_with_payload_before_state(players):
    t = players.connect()
    try:
        session = RingSession.attach(t)
        assert players.ring.get("frontend_epoch") == session.epoch
        flights = _submit_all(session, 32, 100)
        t.read(0, 8)   # a READ after the chain: it completes only after every earlier WRITE
        pending = players.backend.pending()
        assert len(pending) == 32
        for f, prompt in flights:
            r = players.ring.slot_request(f.slot)
            assert r.seq == f.seq and r.prompt_len == prompt.size
            assert np.array_equal(players.ring.prompt_arena[r.prompt_offset:r.prompt_offset + r.prompt_len], prompt)
    finally:
        t.close()


def test_tokens_published_by_the_backend_are_read_back(players):
    t = players.connect()
    try:
        session = RingSession.attach(t)
        (f, _), = _submit_all(session, 1, 5)
        t.read(0, 8)
        players.backend.claim(f.slot)
        players.backend.move(f.slot, SlotState.DECODE_PROCESSING)
        players.backend.publish(f.slot, [7, 8, 9])
        players.backend.complete(f.slot, FinishReason.STOP)
        rec = session.read_slot(f.slot)
        assert int(rec["state"]) == SlotState.DECODE_COMPLETED and int(rec["generated"]) == 3
        assert session.read_tokens(f, 0, 3) == [7, 8, 9]
        off = t.geometry.output_token_offset(f.output_offset)
        assert t.read_batch([(off, 12), (0, 8), (off + 4, 4)]) == [
            np.array([7, 8, 9], "<i4").tobytes(), bytes(players.buf[:8]), np.array([8], "<i4").tobytes()]
        out = bytearray(12)
        t.read_into(off, memoryview(out))
        assert np.frombuffer(out, "<i4").tolist() == [7, 8, 9]
        session.write_resets([f.slot])
        t.read(0, 8)
        assert players.ring.state[f.slot] == SlotState.EMPTY
    finally:
        t.close()


def test_small_queue_and_staging_split_bursts_into_many_chains():
    p = Players(sq_depth=4, staging_bytes=4096, read_buffer_bytes=4096, max_read_buffer_bytes=8192, inline_bytes=0)
    try:
        t = p.connect()
        session = RingSession.attach(t)
        flights = _submit_all(session, 48, 300)   # 1200-byte prompts: more than fits in staging at once
        snapshot = t.read(0, GEOM.prompt_arena_offset)   # larger than the read buffer: several rounds
        assert snapshot == bytes(p.buf[:GEOM.prompt_arena_offset])
        assert len(p.backend.pending()) == 48
        for f, prompt in flights:
            assert np.array_equal(p.ring.prompt_arena[f.prompt_offset:f.prompt_offset + prompt.size], prompt)
        t.close()
    finally:
        p.close()


def test_daemon_going_away_breaks_the_transport_cleanly_and_a_new_one_reconnects(players):
    t = players.connect()
    port = players.port
    try:
        players.server.close()
        deadline = time.monotonic() + 10
        while not t.stale():
            assert time.monotonic() < deadline, "stale() never noticed the daemon leave"
            time.sleep(0.05)
        with pytest.raises(TransportError):
            for _ in range(100):   # the QP is gone: a READ fails within the retry timeout
                t.read(0, 8)
    finally:
        t.close()
    players.start_server(port)   # the daemon comes back on the same address
    t2 = verbs_factory(VerbsConfig(host="127.0.0.1", port=port))()
    try:
        assert t2.geometry == GEOM and not t2.stale()
    finally:
        t2.close()


def test_out_of_ring_access_is_refused_locally(players):
    t = players.connect()
    try:
        with pytest.raises(ValueError, match="outside"):
            t.read(GEOM.total_size - 4, 8)
        with pytest.raises(ValueError, match="outside"):
            t.write_batch([(0, b"x"), (GEOM.total_size, b"y")])
        assert not t.stale()
    finally:
        t.close()


def test_a_bad_rkey_fails_that_connection_clearly_and_nothing_else(players):
    good, bad = players.connect(), players.connect()
    try:
        bad.region = dataclasses.replace(bad.region, rkey=bad.region.rkey ^ 0x5A5A00)
        before = bytes(players.buf)
        with pytest.raises(TransportError, match="REM_ACCESS_ERR|REM_INV_REQ_ERR") as e:
            bad.write(GEOM.prompt_arena_offset, b"\x01" * 64)
            bad.read(0, 8)          # the WRITE's completion surfaces here at the latest
        assert "RDMA connection to 127.0.0.1" in str(e.value)
        assert bad.stale()
        with pytest.raises(TransportError, match="lost"):
            bad.read(0, 8)          # stays broken, with the same root cause
        assert bytes(players.buf) == before   # the refused WRITE left no byte behind
        session = RingSession.attach(good)    # the other connection never noticed
        flights = _submit_all(session, 4, 20)
        good.read(0, 8)
        assert len(players.backend.pending()) == 4 and not good.stale()
        for f, prompt in flights:
            assert np.array_equal(players.ring.prompt_arena[f.prompt_offset:f.prompt_offset + prompt.size], prompt)
    finally:
        bad.close()
        good.close()
    again = players.connect()   # and the broken frontend reconnects as new
    try:
        assert again.read(0, 8) == bytes(players.buf[:8])
    finally:
        again.close()
