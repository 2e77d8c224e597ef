"""The one-time TCP exchange that connects a verbs frontend to the daemon's ring.

    frontend: create its RC QP -> connect TCP -> send ClientHello (one JSON line)
    daemon:   validate -> create a QP for it, move it to RTR/RTS -> send ServerHello
              (QPN, GID, LID, PSN, MTU + the ring's rkey, address, length, layout version)
    frontend: validate -> move its QP to RTR/RTS -> RDMA READ/WRITE the ring

Nothing else ever crosses this socket: it stays open only so each side notices
when the other goes away (EOF), and the daemon then destroys that frontend's QP.
Everything here is plain data in, data out (plus two small socket helpers), so
the protocol and its validation are tested without an RDMA device. The daemon
side (gpu_backend/rdma_server.py) imports this module: both sides speak one
definition of the wire format.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import json
import socket
import time

from shared_layout import LAYOUT_VERSION

PROTOCOL = "blink-rdma/1"
DEFAULT_PORT = 7470
MAX_LINE_BYTES = 4096
PLACEMENTS = ("host", "gpu")   # where the daemon's ring lives (host-mapped memory or GPU memory)
_U24 = (1 << 24) - 1
_U16 = (1 << 16) - 1
_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1


class BootstrapError(ConnectionError):
    """The exchange failed or the peer sent something this side cannot use."""


class BootstrapUnreachable(BootstrapError):
    """No daemon answers at the bootstrap address (not started yet, or gone)."""


@dataclasses.dataclass(frozen=True)
class QpAddress:
    """What a peer needs to reach one RC queue pair."""
    qpn: int          # queue pair number, 24 bits
    psn: int          # first packet sequence number this QP sends, 24 bits
    lid: int          # local identifier (InfiniBand); 0 on RoCE
    gid: str          # 128-bit GID as 8 groups of 4 hex digits (pyverbs' format)
    mtu: int          # the port's active MTU as ibv_mtu (1=256 .. 5=4096)

    def __post_init__(self):
        _check_int("qpn", self.qpn, 1, _U24)
        _check_int("psn", self.psn, 0, _U24)
        _check_int("lid", self.lid, 0, _U16)
        _check_int("mtu", self.mtu, 1, 5)
        object.__setattr__(self, "gid", normalize_gid(self.gid))


@dataclasses.dataclass(frozen=True)
class ClientHello:
    qp: QpAddress
    max_rd_atomic: int            # RDMA READs this frontend keeps in flight at most
    layout_version: int = LAYOUT_VERSION

    def __post_init__(self):
        _check_int("max_rd_atomic", self.max_rd_atomic, 0, 255)
        _check_int("layout_version", self.layout_version, 0, _U32)


@dataclasses.dataclass(frozen=True)
class RingRegion:
    """The daemon's ring as a remote memory region."""
    rkey: int         # remote key of the memory region
    addr: int         # RDMA address of ring byte 0 (a virtual address, or the IOVA of a dmabuf MR)
    length: int       # bytes registered; covers the whole ring
    placement: str    # "host" or "gpu"

    def __post_init__(self):
        _check_int("rkey", self.rkey, 0, _U32)
        _check_int("addr", self.addr, 0, _U64)
        _check_int("length", self.length, 1, _U64)
        if self.addr + self.length > _U64 + 1:
            raise BootstrapError(f"ring region [{self.addr:#x}, +{self.length}) wraps the 64-bit address space")
        if self.placement not in PLACEMENTS:
            raise BootstrapError(f"ring placement must be one of {PLACEMENTS}, got {self.placement!r}")

    def remote_addr(self, offset: int, nbytes: int) -> int:
        """RDMA address of ring bytes [offset, offset + nbytes); ValueError outside the region."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.length:
            raise ValueError(f"ring access [{offset}, {offset + nbytes}) outside the {self.length}-byte region")
        return self.addr + offset


@dataclasses.dataclass(frozen=True)
class ServerHello:
    qp: QpAddress
    max_dest_rd_atomic: int       # RDMA READs the daemon's QP accepts in flight
    ring: RingRegion
    layout_version: int = LAYOUT_VERSION

    def __post_init__(self):
        _check_int("max_dest_rd_atomic", self.max_dest_rd_atomic, 0, 255)
        _check_int("layout_version", self.layout_version, 0, _U32)


# -- encoding ------------------------------------------------------------------
def encode_client_hello(h: ClientHello) -> bytes:
    return _line({"proto": PROTOCOL, "layout_version": h.layout_version, **_qp_dict(h.qp),
                  "max_rd_atomic": h.max_rd_atomic})


def encode_server_hello(h: ServerHello) -> bytes:
    return _line({"proto": PROTOCOL, "layout_version": h.layout_version, **_qp_dict(h.qp),
                  "max_dest_rd_atomic": h.max_dest_rd_atomic, "rkey": h.ring.rkey, "addr": h.ring.addr,
                  "length": h.ring.length, "placement": h.ring.placement})


def encode_error(message: str) -> bytes:
    """The daemon's refusal (e.g. layout mismatch, too many frontends)."""
    return _line({"proto": PROTOCOL, "error": str(message)[:MAX_LINE_BYTES // 2]})


def decode_client_hello(line: bytes, expect_layout: int = LAYOUT_VERSION) -> ClientHello:
    """Parse and validate a frontend's hello; BootstrapError names what is wrong."""
    d = _parse(line, "frontend")
    _check_layout(d, expect_layout, "frontend")
    return _build("frontend", lambda: ClientHello(_qp_from(d), _field(d, "max_rd_atomic"),
                                                  _field(d, "layout_version")))


def decode_server_hello(line: bytes, expect_layout: int = LAYOUT_VERSION) -> ServerHello:
    """Parse and validate the daemon's reply (or raise its refusal as BootstrapError)."""
    d = _parse(line, "daemon")
    if "error" in d:
        raise BootstrapError(f"daemon refused the RDMA connection: {d['error']}")
    _check_layout(d, expect_layout, "daemon")
    return _build("daemon", lambda: ServerHello(
        _qp_from(d), _field(d, "max_dest_rd_atomic"),
        RingRegion(_field(d, "rkey"), _field(d, "addr"), _field(d, "length"), _field(d, "placement", str)),
        _field(d, "layout_version")))


def normalize_gid(gid: str) -> str:
    """A GID as pyverbs writes it ('fe80:0000:...:0001'); accepts any IPv6 spelling."""
    if not isinstance(gid, str):
        raise BootstrapError(f"gid must be a string, got {type(gid).__name__}")
    try:
        return ipaddress.IPv6Address(gid).exploded
    except ValueError:
        raise BootstrapError(f"gid {gid!r} is not a 128-bit GID") from None


def parse_endpoint(text: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """'HOST:PORT', 'HOST' or '[v6]:PORT' -> (host, port); ValueError with the reason."""
    text = text.strip()
    if not text:
        raise ValueError("empty daemon address; expected HOST:PORT")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"bad daemon address {text!r}; expected [IPv6]:PORT")
        port_s = rest[1:] if rest else ""
    elif text.count(":") == 1:
        host, port_s = text.split(":")
    elif ":" in text:
        raise ValueError(f"bad daemon address {text!r}; write an IPv6 address as [ADDR]:PORT")
    else:
        host, port_s = text, ""
    if not host:
        raise ValueError(f"bad daemon address {text!r}: no host")
    if not port_s:
        return host, default_port
    if not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ValueError(f"bad port in daemon address {text!r}: expected 1..65535")
    return host, int(port_s)


# -- sockets -------------------------------------------------------------------
def read_line(sock: socket.socket, timeout_s: float, who: str) -> bytes:
    """One newline-terminated message of at most MAX_LINE_BYTES, within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    buf = bytearray()
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BootstrapError(f"{who} sent no complete hello within {timeout_s:g} s")
        sock.settimeout(left)
        try:
            chunk = sock.recv(MAX_LINE_BYTES + 1 - len(buf))
        except socket.timeout:
            continue
        except OSError as e:
            raise BootstrapError(f"bootstrap connection to {who} failed: {e}") from None
        if not chunk:
            raise BootstrapError(f"{who} closed the bootstrap connection before its hello")
        buf += chunk
        if len(buf) > MAX_LINE_BYTES and b"\n" not in buf:
            raise BootstrapError(f"{who} hello longer than {MAX_LINE_BYTES} bytes")
    line, _, rest = bytes(buf).partition(b"\n")
    if rest:
        raise BootstrapError(f"{who} sent data after its hello")
    return line + b"\n"


def client_handshake(host: str, port: int, hello: ClientHello, timeout_s: float
                     ) -> tuple[socket.socket, ServerHello]:
    """Connect, send `hello`, return the open socket and the daemon's validated reply."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except (ConnectionRefusedError, socket.timeout, socket.gaierror, OSError) as e:
        raise BootstrapUnreachable(f"no BLINK daemon answers at {host}:{port} ({e})") from None
    try:
        keepalive(sock)
        sock.sendall(encode_client_hello(hello))
        reply = decode_server_hello(read_line(sock, timeout_s, f"daemon at {host}:{port}"))
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)   # from now on only peer_closed() looks at it
    return sock, reply


def keepalive(sock: socket.socket, idle_s: int = 5, interval_s: int = 2, count: int = 3) -> None:
    """Let TCP notice a peer host that vanished without closing (about idle + interval*count s)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPINTVL", interval_s), ("TCP_KEEPCNT", count)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def peer_closed(sock: socket.socket) -> bool:
    """True once the peer closed (or reset) the bootstrap socket; never blocks."""
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError, socket.timeout):
        return False
    except OSError:
        return True
    return data == b""


# -- helpers -------------------------------------------------------------------
def _line(d: dict) -> bytes:
    data = json.dumps(d, separators=(",", ":")).encode() + b"\n"
    if len(data) > MAX_LINE_BYTES:
        raise BootstrapError(f"hello of {len(data)} bytes exceeds {MAX_LINE_BYTES}")
    return data


def _qp_dict(qp: QpAddress) -> dict:
    return {"qpn": qp.qpn, "psn": qp.psn, "lid": qp.lid, "gid": qp.gid, "mtu": qp.mtu}


def _qp_from(d: dict) -> QpAddress:
    return QpAddress(_field(d, "qpn"), _field(d, "psn"), _field(d, "lid"), _field(d, "gid", str),
                     _field(d, "mtu"))


def _parse(line: bytes, who: str) -> dict:
    if len(line) > MAX_LINE_BYTES:
        raise BootstrapError(f"{who} hello longer than {MAX_LINE_BYTES} bytes")
    try:
        d = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise BootstrapError(f"{who} hello is not a JSON line (not a BLINK {PROTOCOL} peer?)") from None
    if not isinstance(d, dict):
        raise BootstrapError(f"{who} hello is not a JSON object")
    if d.get("proto") != PROTOCOL:
        raise BootstrapError(f"{who} speaks {d.get('proto')!r}, this side speaks {PROTOCOL!r}")
    return d


def _check_layout(d: dict, expect: int, who: str) -> None:
    got = _field(d, "layout_version")
    if got != expect:
        raise BootstrapError(f"{who} uses ring layout version {got}, this side speaks {expect}: "
                             f"upgrade both sides to the same BLINK release")


def _field(d: dict, name: str, kind: type = int):
    if name not in d:
        raise BootstrapError(f"hello lacks field {name!r}")
    v = d[name]
    if type(v) is not kind:   # bool is not an int here
        raise BootstrapError(f"hello field {name!r} must be {kind.__name__}, got {type(v).__name__}")
    return v


def _build(who: str, make):
    try:
        return make()
    except BootstrapError as e:
        raise BootstrapError(f"{who} hello: {e}") from None


def _check_int(name: str, v, lo: int, hi: int) -> None:
    if type(v) is not int or not lo <= v <= hi:
        raise BootstrapError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")
