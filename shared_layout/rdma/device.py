"""The thin layer over pyverbs both RDMA sides use: find a port, open it, build QPs and WRs.

    sysfs (/sys/class/infiniband) -> scan_ports -> pick_port, pick_gid_index   (pure, no pyverbs)
    import_pyverbs + verbs_enums (Debian rdma-core 44 and PyPI/newer layouts)
    VerbsPort (context, PD, port attributes, GID) -> register / register_dmabuf -> MR
    RcQueuePair (CQ + RC QP) -> address() -> connect(peer) -> post / poll
    write_chain / read_chain: plan ops (plan.py) -> linked SendWRs for one post_send

The frontend's verbs transport and the daemon's RDMA server (gpu_backend/rdma_server.py)
both build on it; it is the only module that imports pyverbs, and it does so
lazily: a process without RDMA never loads it. Ring memory is registered for
REMOTE_WRITE and REMOTE_READ only: no remote atomics (a NIC atomic on GPU
memory is not atomic with the SMs' atomics) and no relaxed ordering (the
ring's publish words rely on RDMA WRITEs landing in post order).
"""
from __future__ import annotations

import ctypes
import dataclasses
import enum
import errno
import importlib
import importlib.machinery
import importlib.util
import ipaddress
import mmap
import os
import random
import sys
import types

from ..errors import TransportError
from .bootstrap import QpAddress
from .plan import ReadOp, WriteOp
from .progress import wr_id

SYSFS_ROOT = "/sys/class/infiniband"
NO_DEVICE_MESSAGE = "no RDMA device found, use the shared-memory transport"
# Where Debian/Ubuntu (and so BlueField OS) install python3-pyverbs.
DEBIAN_DIST_PACKAGES = ("/usr/lib/python3/dist-packages",)
_GID_ZERO = "0000:0000:0000:0000:0000:0000:0000:0000"

# QP timing (same values as ibv_rc_pingpong / rdma-core's tests): local ACK
# timeout 4.096 us * 2^14 = 67 ms, 7 retries -> a dead peer is reported in ~0.5 s.
ACK_TIMEOUT = 14
RETRY_COUNT = 7
RNR_RETRY = 7
MIN_RNR_TIMER = 12
HOP_LIMIT = 64


class NoRdmaDevice(TransportError):
    """No usable RDMA device on this machine (the message says what to do instead)."""

    def __init__(self, detail: str = ""):
        super().__init__(NO_DEVICE_MESSAGE + (f" ({detail})" if detail else ""))


class PyverbsMissing(TransportError):
    def __init__(self):
        super().__init__("the verbs transport needs pyverbs (rdma-core): `apt install python3-pyverbs` "
                         "on Debian/Ubuntu/BlueField OS, or `pip install 'blink-py[rdma]'`; "
                         "see docs/deployment.md")


# -- pyverbs and its enums ---------------------------------------------------------
def import_pyverbs() -> types.ModuleType:
    """Import pyverbs; fall back to Debian's python3-pyverbs when a venv cannot see it.

    Debian installs pyverbs into the system dist-packages, which a virtual
    environment hides. When the interpreter's ABI matches (the extension
    modules carry it in their names), load just that package from there.
    """
    try:
        return importlib.import_module("pyverbs")
    except ImportError:
        pass
    for d in DEBIAN_DIST_PACKAGES:
        spec = importlib.machinery.PathFinder.find_spec("pyverbs", [d])
        if spec is None or not _abi_matches(os.path.join(d, "pyverbs")):
            continue
        mod = importlib.util.module_from_spec(spec)
        sys.modules["pyverbs"] = mod
        try:
            spec.loader.exec_module(mod)
            importlib.import_module("pyverbs.device")
        except ImportError:
            for name in [n for n in sys.modules if n == "pyverbs" or n.startswith("pyverbs.")]:
                del sys.modules[name]
            continue
        return mod
    raise PyverbsMissing()


def _abi_matches(pkg_dir: str) -> bool:
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    try:
        names = os.listdir(pkg_dir)
    except OSError:
        return False
    exts = [n for n in names if n.endswith(".so")]
    return bool(exts) and all(any(n.endswith(s) for s in suffixes) for n in exts)


def collect_enums(modules) -> dict[str, int]:
    """IBV_* names -> values from pyverbs enum modules of any layout.

    rdma-core <= 55 (Debian 44): `pyverbs.enums` exposes every IBV_* name at
    module level. Newer rdma-core moved them to `pyverbs.libibverbs_enums`,
    where named enums are Python enum classes (`ibv_qp_type.IBV_QPT_RC`) and
    only anonymous enums stay at module level.
    """
    out: dict[str, int] = {}
    for mod in modules:
        for name, val in vars(mod).items():
            if isinstance(val, type) and issubclass(val, enum.Enum):
                for member in val:
                    out.setdefault(member.name, int(member.value))
            elif name.startswith("IBV_") and isinstance(val, int):
                out.setdefault(name, int(val))
    return out


_ENUMS: types.SimpleNamespace | None = None


def verbs_enums() -> types.SimpleNamespace:
    """The IBV_* constants as attributes, whichever pyverbs is installed."""
    global _ENUMS
    if _ENUMS is None:
        import_pyverbs()
        mods = []
        for name in ("pyverbs.libibverbs_enums", "pyverbs.enums"):
            try:
                mods.append(importlib.import_module(name))
            except ImportError:
                pass
        values = collect_enums(mods)
        if "IBV_QPT_RC" not in values:
            raise TransportError("this pyverbs exposes no IBV_* enums (neither pyverbs.enums nor "
                                 "pyverbs.libibverbs_enums); unsupported rdma-core version")
        _ENUMS = types.SimpleNamespace(**values)
    return _ENUMS


# -- finding a port (sysfs; pure given the tree) ---------------------------------------
@dataclasses.dataclass(frozen=True)
class GidEntry:
    index: int
    gid: str
    kind: str          # "IB/RoCE v1", "RoCE v2" or "" when unknown


@dataclasses.dataclass(frozen=True)
class RdmaPort:
    device: str        # e.g. mlx5_0, rxe0, siw0
    port: int          # 1-based
    node_type: str     # "CA" (InfiniBand/RoCE) or "RNIC" (iWARP)
    link_layer: str    # "InfiniBand" or "Ethernet"
    state: str         # "ACTIVE", "DOWN", ...
    lid: int
    gids: tuple[GidEntry, ...]

    @property
    def usable(self) -> bool:
        """Active and able to connect an RC QP without rdma_cm (iWARP cannot)."""
        return self.state == "ACTIVE" and self.node_type != "RNIC"

    def __str__(self) -> str:
        return f"{self.device} port {self.port} ({self.link_layer}, {self.state})"


def scan_ports(root: str = SYSFS_ROOT) -> list[RdmaPort]:
    """Every port of every RDMA device under `root`, sorted by device and port."""
    try:
        devices = sorted(os.listdir(root))
    except OSError:
        return []
    ports = []
    for dev in devices:
        node_type = _after_colon(_read(os.path.join(root, dev, "node_type")))
        pdir = os.path.join(root, dev, "ports")
        try:
            port_names = sorted(os.listdir(pdir), key=lambda p: int(p) if p.isdigit() else 0)
        except OSError:
            continue
        for p in port_names:
            if not p.isdigit():
                continue
            base = os.path.join(pdir, p)
            try:
                lid = int(_read(os.path.join(base, "lid")) or "0", 0)
            except ValueError:
                lid = 0
            ports.append(RdmaPort(dev, int(p), node_type, _read(os.path.join(base, "link_layer")),
                                  _after_colon(_read(os.path.join(base, "state"))), lid, _scan_gids(base)))
    return ports


def _scan_gids(port_dir: str) -> tuple[GidEntry, ...]:
    gdir = os.path.join(port_dir, "gids")
    try:
        names = sorted((n for n in os.listdir(gdir) if n.isdigit()), key=int)
    except OSError:
        return ()
    out = []
    for n in names:
        gid = _read(os.path.join(gdir, n))
        try:
            gid = ipaddress.IPv6Address(gid).exploded
        except ValueError:
            continue
        if gid == _GID_ZERO:
            continue
        out.append(GidEntry(int(n), gid, _read(os.path.join(port_dir, "gid_attrs", "types", n))))
    return tuple(out)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:    # absent, or EINVAL for an unused GID's attributes
        return ""


def _after_colon(text: str) -> str:
    """sysfs writes '4: ACTIVE' and '1: CA'."""
    return text.split(":", 1)[1].strip() if ":" in text else text


def pick_port(ports: list[RdmaPort], device: str | None = None, port: int | None = None) -> RdmaPort:
    """The port to use: the named one, else the first active one; NoRdmaDevice when none."""
    if not ports:
        raise NoRdmaDevice()
    cands = [p for p in ports if (device is None or p.device == device) and (port is None or p.port == port)]
    if not cands:
        names = ", ".join(sorted({p.device for p in ports}))
        want = f"{device or 'any device'} port {port or 'any'}"
        raise TransportError(f"RDMA {want} not found; this machine has: {names}")
    for p in cands:
        if p.usable:
            return p
    if all(p.node_type == "RNIC" for p in cands):
        raise NoRdmaDevice(f"{cands[0].device} is iWARP, which needs rdma_cm; the verbs transport "
                           f"needs InfiniBand or RoCE (mlx5, rxe)")
    raise NoRdmaDevice("no active port: " + "; ".join(str(p) for p in cands))


def pick_gid_index(port: RdmaPort) -> int:
    """RoCE: a RoCE v2 GID, IPv4-mapped first (routable, what rdma_cm picks); IB: index 0."""
    if port.link_layer != "Ethernet":
        return 0
    if not port.gids:
        raise TransportError(f"{port} has no GID: give its network interface an IP address")

    def rank(g: GidEntry) -> tuple[int, int]:
        v4 = ipaddress.IPv6Address(g.gid).ipv4_mapped is not None
        return ({"RoCE v2": 0, "": 2}.get(g.kind, 4) + (0 if v4 else 1), g.index)

    return min(port.gids, key=rank).index


# -- opened device --------------------------------------------------------------------
class HostBuffer:
    """Page-aligned anonymous memory with its address, for local MRs (staging, READ target)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.mm = mmap.mmap(-1, nbytes)
        self._anchor = ctypes.c_char.from_buffer(self.mm)   # holds the export while registered
        self.addr = ctypes.addressof(self._anchor)
        self.view = memoryview(self.mm)

    def close(self) -> None:
        self.view.release()
        del self._anchor
        try:
            self.mm.close()
        except BufferError:
            pass   # a caller still holds a view; the mapping goes with it


def buffer_address(buf) -> tuple[int, object]:
    """Address of a writable buffer (mmap, bytearray) and an anchor to keep while it is registered."""
    anchor = (ctypes.c_char * len(memoryview(buf).cast("B"))).from_buffer(buf)
    return ctypes.addressof(anchor), anchor


class VerbsPort:
    """An opened device port: context, protection domain, port attributes, chosen GID."""

    def __init__(self, port: RdmaPort, gid_index: int | None = None):
        import_pyverbs()
        from pyverbs.device import Context
        from pyverbs.pd import PD
        from pyverbs.pyverbs_error import PyverbsError
        self.E = verbs_enums()
        self.port = port
        try:
            self.ctx = Context(name=port.device)
        except PyverbsError as e:
            raise TransportError(f"cannot open RDMA device {port.device}: {e}") from None
        try:
            self.pd = PD(self.ctx)
            self.attr = self.ctx.query_port(port.port)
            dev = self.ctx.query_device()
            self.max_qp_rd_atom = int(dev.max_qp_rd_atom)          # READs a responder QP accepts
            self.max_qp_init_rd_atom = int(dev.max_qp_init_rd_atom)  # READs a requester QP issues
            self.gid_index = pick_gid_index(port) if gid_index is None else gid_index
            self.gid = ipaddress.IPv6Address(str(self.ctx.query_gid(port.port, self.gid_index))).exploded
        except PyverbsError as e:
            self.ctx.close()
            raise TransportError(f"cannot set up {port}: {e}") from None
        self.lid = int(self.attr.lid)
        self.mtu = int(self.attr.active_mtu)
        self.max_msg_bytes = int(self.attr.max_msg_sz) or (1 << 30)
        self.is_global = self.gid != _GID_ZERO

    def access(self, remote: bool) -> int:
        E = self.E
        acc = E.IBV_ACCESS_LOCAL_WRITE
        if remote:
            acc |= E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_REMOTE_READ
        return acc

    def register(self, address: int, nbytes: int, remote: bool):
        """MR over host memory at `address` (ring memory: remote=True)."""
        from pyverbs.mr import MR
        from pyverbs.pyverbs_error import PyverbsError
        try:
            return MR(self.pd, nbytes, self.access(remote), address=address)
        except PyverbsError as e:
            raise TransportError(f"cannot register {nbytes} bytes with {self.port.device}: {e} "
                                 f"(locked-memory limit? see LimitMEMLOCK in docs/deployment.md)") from None

    def register_dmabuf(self, fd: int, nbytes: int):
        """MR over GPU memory exported as a dma-buf (IOVA 0 = its first byte)."""
        from pyverbs.mr import DmaBufMR
        from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError
        try:
            return DmaBufMR(self.pd, nbytes, self.access(True), dmabuf=fd, offset=0)
        except PyverbsRDMAError as e:
            if e.error_code == errno.EOPNOTSUPP:
                raise TransportError(f"{self.port.device} cannot register dma-buf memory "
                                     f"(kernel or driver without dma-buf MR support)") from None
            raise TransportError(f"dma-buf registration with {self.port.device} failed: {e}") from None
        except PyverbsError as e:
            raise TransportError(f"dma-buf registration with {self.port.device} failed: {e}") from None

    def close(self) -> None:
        if self.ctx is not None:
            self.ctx.close()   # closes every PD, MR, CQ and QP made from it
            self.ctx = None


class RcQueuePair:
    """One CQ and one RC queue pair on a VerbsPort (requester or responder side)."""

    def __init__(self, vport: VerbsPort, sq_depth: int, inline_bytes: int, responder: bool):
        from pyverbs.cq import CQ
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
        E = self.E = vport.E
        self.vport = vport
        self.psn = random.getrandbits(24)
        try:
            self.cq = CQ(vport.ctx, 2 * sq_depth + 1, None, None, 0)
            attr = QPAttr(port_num=vport.port.port)
            attr.qp_access_flags = (E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_REMOTE_READ
                                    | E.IBV_ACCESS_LOCAL_WRITE) if responder else E.IBV_ACCESS_LOCAL_WRITE
            self.qp, self.inline_bytes = None, inline_bytes
            for inline in (inline_bytes, 0):   # a device without inline sends refuses the first
                cap = QPCap(max_send_wr=sq_depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1,
                            max_inline_data=inline)
                init = QPInitAttr(qp_type=E.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
                try:
                    self.qp = QP(vport.pd, init, attr)   # returned in INIT (RC needs the peer for RTR)
                    self.inline_bytes = inline
                    break
                except PyverbsError:
                    if inline == 0:
                        raise
        except PyverbsError as e:
            raise TransportError(f"cannot create an RC queue pair on {vport.port}: {e}") from None
        self.sq_depth = sq_depth

    def address(self) -> QpAddress:
        v = self.vport
        return QpAddress(qpn=int(self.qp.qp_num), psn=self.psn, lid=v.lid, gid=v.gid, mtu=v.mtu)

    def connect(self, peer: QpAddress, max_rd_atomic: int, max_dest_rd_atomic: int) -> None:
        """INIT -> RTR -> RTS towards `peer` (both sides call this with the other's address)."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.qp import QPAttr
        v = self.vport
        attr = QPAttr(port_num=v.port.port)
        attr.path_mtu = min(v.mtu, peer.mtu)
        attr.dest_qp_num = peer.qpn
        attr.rq_psn = peer.psn
        attr.sq_psn = self.psn
        attr.max_dest_rd_atomic = max_dest_rd_atomic
        attr.max_rd_atomic = max_rd_atomic
        attr.min_rnr_timer = MIN_RNR_TIMER
        attr.timeout = ACK_TIMEOUT
        attr.retry_cnt = RETRY_COUNT
        attr.rnr_retry = RNR_RETRY
        if v.is_global or v.port.link_layer == "Ethernet":
            gr = GlobalRoute(dgid=GID(peer.gid), sgid_index=v.gid_index, hop_limit=HOP_LIMIT)
            attr.ah_attr = AHAttr(port_num=v.port.port, is_global=1, gr=gr, dlid=peer.lid)
        else:
            attr.ah_attr = AHAttr(port_num=v.port.port, is_global=0, dlid=peer.lid)
        try:
            self.qp.to_rts(attr)
        except PyverbsError as e:
            raise TransportError(f"cannot connect the RC queue pair to QPN {peer.qpn:#x} "
                                 f"(GID {peer.gid}, LID {peer.lid}): {e}") from None

    def post(self, wrs: list) -> None:
        """Post a linked chain (wrs[0] is its head; the list keeps every WR alive meanwhile)."""
        from pyverbs.pyverbs_error import PyverbsError
        try:
            self.qp.post_send(wrs[0])
        except PyverbsError as e:
            raise TransportError(f"post_send failed: {e}") from None

    def poll(self, max_entries: int = 16) -> list[tuple[int, int, int]]:
        """Up to `max_entries` completions as (wr_id, status, vendor_err); never blocks."""
        from pyverbs.pyverbs_error import PyverbsError
        try:
            _, wcs = self.cq.poll(max_entries)
        except PyverbsError as e:
            raise TransportError(f"polling the completion queue failed: {e}") from None
        return [(int(wc.wr_id), int(wc.status), int(wc.vendor_err)) for wc in wcs]

    def close(self) -> None:
        for obj in (getattr(self, "qp", None), getattr(self, "cq", None)):
            if obj is not None:
                obj.close()
        self.qp = self.cq = None


# -- work requests ----------------------------------------------------------------------
def write_chain(E, ops: list[WriteOp], chain_id: int, local_addr: int, lkey: int,
                rkey: int, remote_addr: int) -> list:
    """Linked RDMA WRITE WRs for one post_send; only the last is signaled.

    `local_addr` is where the chain's staging span starts, `remote_addr` the
    RDMA address of ring byte 0. Never an atomic opcode.
    """
    from pyverbs.wr import SGE, SendWR
    wrs = []
    for i, op in enumerate(ops):
        flags = E.IBV_SEND_INLINE if op.inline else 0
        if i == len(ops) - 1:
            flags |= E.IBV_SEND_SIGNALED
        sge = SGE(local_addr + op.staging_offset, op.length, lkey)
        wr = SendWR(wr_id=wr_id(chain_id, i), opcode=E.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge],
                    send_flags=flags)
        wr.set_wr_rdma(rkey, remote_addr + op.remote_offset)
        wrs.append(wr)
    _link(wrs)
    return wrs


def read_chain(E, ops: list[ReadOp], chain_id: int, local_addr: int, lkey: int,
               rkey: int, remote_addr: int) -> list:
    """Linked RDMA READ WRs into the read buffer; only the last is signaled."""
    from pyverbs.wr import SGE, SendWR
    wrs = []
    for i, op in enumerate(ops):
        flags = E.IBV_SEND_SIGNALED if i == len(ops) - 1 else 0
        sge = SGE(local_addr + op.local_offset, op.length, lkey)
        wr = SendWR(wr_id=wr_id(chain_id, i), opcode=E.IBV_WR_RDMA_READ, num_sge=1, sg=[sge],
                    send_flags=flags)
        wr.set_wr_rdma(rkey, remote_addr + op.remote_offset)
        wrs.append(wr)
    _link(wrs)
    return wrs


def _link(wrs: list) -> None:
    # pyverbs' next_wr stores a pointer into the next SendWR object: the caller keeps
    # the list alive until post_send returns (the NIC copies WQEs at post time)
    for a, b in zip(wrs, wrs[1:]):
        a.next_wr = b
