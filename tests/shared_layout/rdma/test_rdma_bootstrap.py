"""The RDMA bootstrap protocol: wire format, validation, and the exchange over real TCP sockets."""
from __future__ import annotations

import json
import socket
import threading

import pytest

from shared_layout.rdma import bootstrap as bs
from shared_layout import LAYOUT_VERSION

GID = "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
QP = bs.QpAddress(qpn=0x1234, psn=0xABCDE, lid=0, gid=GID, mtu=3)
RING = bs.RingRegion(rkey=0xDEADBEEF, addr=0x7F00_0000_0000, length=1 << 24, placement="host")
SERVER = bs.ServerHello(QP, max_dest_rd_atomic=16, ring=RING)
CLIENT = bs.ClientHello(QP, max_rd_atomic=16)


def test_hellos_round_trip():
    assert bs.decode_client_hello(bs.encode_client_hello(CLIENT)) == CLIENT
    assert bs.decode_server_hello(bs.encode_server_hello(SERVER)) == SERVER
    line = bs.encode_server_hello(SERVER)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    d = json.loads(line)
    assert d["proto"] == bs.PROTOCOL and d["layout_version"] == LAYOUT_VERSION
    assert {"qpn", "gid", "lid", "rkey", "addr", "length"} <= d.keys()


def test_gid_is_normalized_to_pyverbs_form():
    qp = bs.QpAddress(qpn=1, psn=0, lid=0, gid="::ffff:192.168.1.7", mtu=5)
    assert qp.gid == "0000:0000:0000:0000:0000:ffff:c0a8:0107"
    with pytest.raises(bs.BootstrapError, match="not a 128-bit GID"):
        bs.QpAddress(qpn=1, psn=0, lid=0, gid="fe80::zz", mtu=5)


def _server_dict(**changes):
    d = json.loads(bs.encode_server_hello(SERVER))
    d.update(changes)
    return (json.dumps({k: v for k, v in d.items() if v is not _DROP}) + "\n").encode()


_DROP = object()


@pytest.mark.parametrize("changes, message", [
    ({"proto": "blink-rdma/0"}, "speaks 'blink-rdma/0'"),
    ({"layout_version": LAYOUT_VERSION + 1}, "layout version"),
    ({"qpn": 0}, "qpn must be an integer in"),
    ({"qpn": 1 << 24}, "qpn must be an integer in"),
    ({"psn": -1}, "psn must be"),
    ({"mtu": 6}, "mtu must be"),
    ({"lid": True}, "must be int, got bool"),
    ({"rkey": "12"}, "must be int, got str"),
    ({"rkey": 1 << 32}, "rkey must be"),
    ({"length": 0}, "length must be"),
    ({"addr": (1 << 64) - 8, "length": 16}, "wraps the 64-bit address space"),
    ({"placement": "nvme"}, "placement must be one of"),
    ({"gid": 5}, "must be str"),
    ({"max_dest_rd_atomic": _DROP}, "lacks field 'max_dest_rd_atomic'"),
])
def test_server_hello_validation(changes, message):
    with pytest.raises(bs.BootstrapError, match=message):
        bs.decode_server_hello(_server_dict(**changes))


@pytest.mark.parametrize("line, message", [
    (b"GET / HTTP/1.1\r\n", "not a JSON line"),
    (b"[1, 2]\n", "not a JSON object"),
    (b"\xff\xfe\n", "not a JSON line"),
    (b"{" + b" " * bs.MAX_LINE_BYTES + b"}\n", "longer than"),
])
def test_garbage_is_refused_with_a_reason(line, message):
    with pytest.raises(bs.BootstrapError, match=message):
        bs.decode_client_hello(line)


def test_daemon_refusal_becomes_the_error_message():
    with pytest.raises(bs.BootstrapError, match="daemon refused the RDMA connection: too many frontends"):
        bs.decode_server_hello(bs.encode_error("too many frontends"))


def test_unknown_fields_are_ignored_for_forward_compatibility():
    d = json.loads(bs.encode_client_hello(CLIENT))
    d["future_option"] = [1, 2]
    assert bs.decode_client_hello(json.dumps(d).encode() + b"\n") == CLIENT


def test_remote_addr_bounds():
    assert RING.remote_addr(0, RING.length) == RING.addr
    assert RING.remote_addr(100, 4) == RING.addr + 100
    for off, n in ((-1, 4), (RING.length - 3, 4), (0, RING.length + 1)):
        with pytest.raises(ValueError, match="outside"):
            RING.remote_addr(off, n)


@pytest.mark.parametrize("text, want", [
    ("10.0.0.2:7471", ("10.0.0.2", 7471)),
    ("gpu-host", ("gpu-host", bs.DEFAULT_PORT)),
    ("[fe80::1]:9000", ("fe80::1", 9000)),
    ("[::1]", ("::1", bs.DEFAULT_PORT)),
])
def test_parse_endpoint(text, want):
    assert bs.parse_endpoint(text) == want


@pytest.mark.parametrize("text", ["", ":80", "host:0", "host:70000", "host:http", "fe80::1", "[::1"])
def test_parse_endpoint_rejects(text):
    with pytest.raises(ValueError):
        bs.parse_endpoint(text)


# -- the exchange over loopback TCP ------------------------------------------------------
class TinyDaemon:
    """A listening socket whose one connection is answered by `reply(line) -> bytes | None`."""

    def __init__(self, reply):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self.conn = None
        self.thread = threading.Thread(target=self._run, args=(reply,), daemon=True)
        self.thread.start()

    def _run(self, reply):
        conn, _ = self.sock.accept()
        self.conn = conn
        line = bs.read_line(conn, 5.0, "frontend")
        self.received.append(line)
        out = reply(line)
        if out is not None:
            conn.sendall(out)

    def close(self):
        if self.conn is not None:
            self.conn.close()
        self.sock.close()


def test_handshake_over_tcp_and_peer_close_detection():
    daemon = TinyDaemon(lambda line: bs.encode_server_hello(SERVER))
    try:
        sock, reply = bs.client_handshake("127.0.0.1", daemon.port, CLIENT, timeout_s=5.0)
        assert reply == SERVER
        assert bs.decode_client_hello(daemon.received[0]) == CLIENT
        assert not bs.peer_closed(sock)
        daemon.thread.join(5)
        daemon.conn.close()   # the daemon goes away
        for _ in range(100):
            if bs.peer_closed(sock):
                break
            threading.Event().wait(0.01)
        assert bs.peer_closed(sock)
        sock.close()
    finally:
        daemon.close()


def test_handshake_refused_by_daemon():
    daemon = TinyDaemon(lambda line: bs.encode_error("layout version 9, this side speaks 1"))
    try:
        with pytest.raises(bs.BootstrapError, match="refused the RDMA connection: layout version 9"):
            bs.client_handshake("127.0.0.1", daemon.port, CLIENT, timeout_s=5.0)
    finally:
        daemon.close()


def test_handshake_when_daemon_hangs_up_or_stalls():
    daemon = TinyDaemon(lambda line: None)
    try:
        with pytest.raises(bs.BootstrapError, match="no complete hello within 0.3 s"):
            bs.client_handshake("127.0.0.1", daemon.port, CLIENT, timeout_s=0.3)
    finally:
        daemon.close()
    daemon = TinyDaemon(lambda line: b"")
    daemon_thread_done = daemon.thread
    try:
        def hang_up():
            daemon_thread_done.join(5)
            daemon.conn.close()
        threading.Thread(target=hang_up, daemon=True).start()
        with pytest.raises(bs.BootstrapError, match="closed the bootstrap connection"):
            bs.client_handshake("127.0.0.1", daemon.port, CLIENT, timeout_s=5.0)
    finally:
        daemon.close()


def test_handshake_with_no_daemon_is_unreachable():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()   # nothing listens there now
    with pytest.raises(bs.BootstrapUnreachable, match=f"no BLINK daemon answers at 127.0.0.1:{port}"):
        bs.client_handshake("127.0.0.1", port, CLIENT, timeout_s=2.0)


def test_trailing_data_after_hello_is_refused():
    a, b = socket.socketpair()
    try:
        a.sendall(bs.encode_client_hello(CLIENT) + b"extra")
        with pytest.raises(bs.BootstrapError, match="data after its hello"):
            bs.read_line(b, 1.0, "frontend")
    finally:
        a.close()
        b.close()
