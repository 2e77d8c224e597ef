"""The daemon's RDMA side without a device: bootstrap refusals over real TCP, lifecycle, and the
GPUDirect placement rules (gpu_backend/rdma_server.py, rdma_gpudirect.py; kept here with the
rest of the verbs transport's tests)."""
from __future__ import annotations

import json
import socket

import pytest

from shared_layout.rdma import bootstrap as bs
from shared_layout.errors import TransportError
from gpu_backend import rdma_gpudirect as gd
from gpu_backend.rdma_server import RdmaRingServer, RdmaServerConfig
from shared_layout import LAYOUT_VERSION

QP = bs.QpAddress(qpn=0x99, psn=1, lid=0, gid="fe80::1", mtu=3)


@pytest.fixture
def server():
    # The bootstrap's validation runs before any device call: serve it with no device at all.
    srv = RdmaRingServer(RdmaServerConfig(listen_host="127.0.0.1", listen_port=0, handshake_timeout_s=1.0),
                         vport=None)
    srv.region = bs.RingRegion(rkey=1, addr=0x1000, length=1 << 20, placement="host")
    host, port = srv.serve()
    yield srv, port
    srv._mr = None
    srv.vport = type("NoDevice", (), {"close": lambda self: None})()
    srv.close()


def _exchange(port: int, payload: bytes) -> dict:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload)
        return json.loads(bs.read_line(s, 5.0, "daemon"))


def test_garbage_hello_gets_a_refusal(server):
    _, port = server
    assert "not a JSON line" in _exchange(port, b"GET / HTTP/1.0\r\n")["error"]


def test_layout_mismatch_is_refused_by_the_daemon(server):
    _, port = server
    hello = bs.encode_client_hello(bs.ClientHello(QP, max_rd_atomic=4, layout_version=LAYOUT_VERSION + 7))
    reply = _exchange(port, hello)
    assert f"layout version {LAYOUT_VERSION + 7}" in reply["error"]
    with pytest.raises(bs.BootstrapError, match="daemon refused the RDMA connection: frontend uses ring layout"):
        bs.decode_server_hello((json.dumps(reply) + "\n").encode())


def test_silent_or_vanishing_frontends_do_not_stop_the_daemon(server):
    _, port = server
    socket.create_connection(("127.0.0.1", port), timeout=5).close()      # connects, says nothing
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:   # stalls past the timeout
        assert "no complete hello within 1 s" in json.loads(bs.read_line(s, 5.0, "daemon"))["error"]
    assert "not a JSON object" in _exchange(port, b"[]\n")["error"]       # still serving


def test_close_stops_listening():
    srv = RdmaRingServer(RdmaServerConfig(listen_host="127.0.0.1", listen_port=0), vport=None)
    srv.region = bs.RingRegion(rkey=1, addr=0, length=4096, placement="host")
    _, port = srv.serve()
    srv.vport = type("NoDevice", (), {"close": lambda self: None})()
    srv.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_serve_needs_a_registered_ring_and_a_free_port():
    srv = RdmaRingServer(RdmaServerConfig(listen_host="127.0.0.1", listen_port=0), vport=None)
    with pytest.raises(RuntimeError, match="register the ring"):
        srv.serve()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        srv = RdmaRingServer(RdmaServerConfig(listen_host="127.0.0.1", listen_port=taken.getsockname()[1]),
                             vport=None)
        srv.region = bs.RingRegion(rkey=1, addr=0, length=4096, placement="host")
        with pytest.raises(TransportError, match="cannot listen on 127.0.0.1"):
            srv.serve()
    finally:
        taken.close()


# -- GPUDirect placement ----------------------------------------------------------------
def caps(ordering=gd.ORDERING_OWNER, flush=gd.FLUSH_OPTION_HOST, rdma=True, dmabuf=True):
    return gd.GpuDirectCaps(rdma_supported=rdma, dmabuf_supported=dmabuf, write_ordering=ordering,
                            flush_options=flush)


@pytest.mark.parametrize("c, consumer, where, flush", [
    (caps(gd.ORDERING_OWNER), "device", "gpu", False),
    (caps(gd.ORDERING_ALL_DEVICES), "device", "gpu", False),
    (caps(gd.ORDERING_OWNER), "host", "gpu", False),
    (caps(gd.ORDERING_NONE), "host", "gpu", True),            # host consumer flushes before reading
    (caps(gd.ORDERING_NONE), "device", "host", False),        # persistent kernel cannot flush
    (caps(gd.ORDERING_NONE, flush=gd.FLUSH_OPTION_MEMOPS), "host", "host", False),
    (caps(rdma=False), "device", "host", False),
    (caps(dmabuf=False), "host", "host", False),
])
def test_placement(c, consumer, where, flush):
    p = gd.plan_placement(c, consumer)
    assert (p.where, p.flush_before_read) == (where, flush), p.reason
    assert p.reason


def test_placement_rejects_unknown_consumer():
    with pytest.raises(ValueError):
        gd.plan_placement(caps(), "dpu")


def test_dmabuf_range_is_page_aligned():
    assert gd.dmabuf_range(1 << 21, 5000, page_bytes=4096) == 8192
    assert gd.dmabuf_range(1 << 21, 8192, page_bytes=4096) == 8192
    with pytest.raises(gd.GpuDirectError, match="not aligned"):
        gd.dmabuf_range((1 << 21) + 256, 4096, page_bytes=4096)
    with pytest.raises(gd.GpuDirectError):
        gd.dmabuf_range(0, 4096)


def test_flush_hook_is_a_no_op_for_host_rings():
    srv = RdmaRingServer(RdmaServerConfig(), vport=None)
    srv.flush_before_read()   # nothing registered
    srv.placement = gd.RingPlacement("host", False, "ring in host memory")
    srv.flush_before_read()   # host memory needs no GPUDirect flush (and needs no CUDA)
