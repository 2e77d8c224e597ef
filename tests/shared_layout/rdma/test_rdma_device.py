"""The pyverbs layer without a device: port discovery from sysfs, GID choice, the enum shim,
pyverbs import on Debian and PyPI layouts, and real pyverbs work-request chains."""
from __future__ import annotations

import enum
import os
import subprocess
import sys
import types

import pytest

from shared_layout.rdma import device as rd
from shared_layout.errors import TransportError
from shared_layout.rdma.plan import ReadOp, WriteOp
from shared_layout.rdma.progress import chain_of


def _port(root, dev, port=1, *, node="1: CA", link="Ethernet", state="4: ACTIVE", lid="0x0", gids=()):
    base = root / dev / "ports" / str(port)
    (base / "gids").mkdir(parents=True, exist_ok=True)
    (base / "gid_attrs" / "types").mkdir(parents=True, exist_ok=True)
    (root / dev / "node_type").write_text(node + "\n")
    (base / "link_layer").write_text(link + "\n")
    (base / "state").write_text(state + "\n")
    (base / "lid").write_text(lid + "\n")
    for i in range(4):   # unused GID slots read as zeros, their type reads fail (absent here)
        (base / "gids" / str(i)).write_text("0000:0000:0000:0000:0000:0000:0000:0000\n")
    for i, gid, kind in gids:
        (base / "gids" / str(i)).write_text(gid + "\n")
        (base / "gid_attrs" / "types" / str(i)).write_text(kind + "\n")


LINK_LOCAL = "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
V4_MAPPED = "0000:0000:0000:0000:0000:ffff:c0a8:6401"   # ::ffff:192.168.100.1


def test_scan_ports_reads_the_sysfs_tree(tmp_path):
    _port(tmp_path, "mlx5_0", gids=[(0, LINK_LOCAL, "IB/RoCE v1"), (1, LINK_LOCAL, "RoCE v2"),
                                    (2, V4_MAPPED, "IB/RoCE v1"), (3, V4_MAPPED, "RoCE v2")])
    _port(tmp_path, "mlx5_1", link="InfiniBand", lid="0x1a", gids=[(0, LINK_LOCAL, "IB/RoCE v1")])
    _port(tmp_path, "siw0", node="4: RNIC")
    ports = rd.scan_ports(str(tmp_path))
    assert [(p.device, p.port) for p in ports] == [("mlx5_0", 1), ("mlx5_1", 1), ("siw0", 1)]
    roce, ib, siw = ports
    assert roce.link_layer == "Ethernet" and roce.state == "ACTIVE" and roce.node_type == "CA"
    assert [g.index for g in roce.gids] == [0, 1, 2, 3]      # zero GIDs dropped
    assert ib.lid == 0x1a and ib.link_layer == "InfiniBand"
    assert siw.gids == () and not siw.usable
    assert rd.pick_gid_index(roce) == 3                      # RoCE v2 + IPv4-mapped
    assert rd.pick_gid_index(ib) == 0


def test_gid_preference_without_an_ipv4_gid(tmp_path):
    _port(tmp_path, "rxe0", gids=[(0, LINK_LOCAL, "IB/RoCE v1"), (1, LINK_LOCAL, "RoCE v2")])
    assert rd.pick_gid_index(rd.scan_ports(str(tmp_path))[0]) == 1
    _port(tmp_path, "rxe1")
    with pytest.raises(TransportError, match="has no GID: give its network interface an IP address"):
        rd.pick_gid_index(rd.scan_ports(str(tmp_path))[1])


def test_no_device_is_one_clear_message(tmp_path):
    assert rd.scan_ports(str(tmp_path / "absent")) == []
    with pytest.raises(rd.NoRdmaDevice) as e:
        rd.pick_port([])
    assert str(e.value) == "no RDMA device found, use the shared-memory transport"


def test_pick_port_prefers_active_and_names_what_exists(tmp_path):
    _port(tmp_path, "mlx5_0", state="1: DOWN", gids=[(0, LINK_LOCAL, "RoCE v2")])
    _port(tmp_path, "mlx5_1", gids=[(0, LINK_LOCAL, "RoCE v2")])
    ports = rd.scan_ports(str(tmp_path))
    assert rd.pick_port(ports).device == "mlx5_1"
    assert rd.pick_port(ports, device="mlx5_1", port=1).device == "mlx5_1"
    with pytest.raises(rd.NoRdmaDevice, match="no active port: mlx5_0 port 1 .Ethernet, DOWN."):
        rd.pick_port(ports, device="mlx5_0")
    with pytest.raises(TransportError, match="mlx5_9 port any not found; this machine has: mlx5_0, mlx5_1"):
        rd.pick_port(ports, device="mlx5_9")


def test_iwarp_only_machine_is_told_why(tmp_path):
    _port(tmp_path, "siw0", node="4: RNIC", gids=[(0, V4_MAPPED, "")])
    with pytest.raises(rd.NoRdmaDevice, match="siw0 is iWARP, which needs rdma_cm"):
        rd.pick_port(rd.scan_ports(str(tmp_path)))


# -- enums ----------------------------------------------------------------------------
def test_collect_enums_from_the_old_flat_module():
    old = types.ModuleType("pyverbs.enums")
    old.IBV_QPT_RC, old.IBV_WR_RDMA_WRITE, old.ibv_helper = 2, 0, 5
    assert rd.collect_enums([old]) == {"IBV_QPT_RC": 2, "IBV_WR_RDMA_WRITE": 0}


def test_collect_enums_from_the_new_enum_classes():
    new = types.ModuleType("pyverbs.libibverbs_enums")

    class ibv_qp_type(enum.IntEnum):
        IBV_QPT_RC = 2
        IBV_QPT_UD = 4

    class ibv_send_flags(enum.IntFlag):
        IBV_SEND_SIGNALED = 2
        IBV_SEND_INLINE = 8

    new.ibv_qp_type, new.ibv_send_flags, new.IBV_LINK_LAYER_ETHERNET = ibv_qp_type, ibv_send_flags, 2
    got = rd.collect_enums([new])
    assert got == {"IBV_QPT_RC": 2, "IBV_QPT_UD": 4, "IBV_SEND_SIGNALED": 2, "IBV_SEND_INLINE": 8,
                   "IBV_LINK_LAYER_ETHERNET": 2}
    assert all(type(v) is int for v in got.values())


def _have_pyverbs() -> bool:
    try:
        rd.import_pyverbs()
        return True
    except TransportError:
        return False


needs_pyverbs = pytest.mark.skipif(not _have_pyverbs(), reason="pyverbs not installed (apt install python3-pyverbs)")

# Values fixed by <infiniband/verbs.h>: the shim must agree with them on every layout.
VERBS_H = {"IBV_QPT_RC": 2, "IBV_WR_RDMA_WRITE": 0, "IBV_WR_RDMA_READ": 4, "IBV_SEND_SIGNALED": 2,
           "IBV_SEND_INLINE": 8, "IBV_ACCESS_LOCAL_WRITE": 1, "IBV_ACCESS_REMOTE_WRITE": 2,
           "IBV_ACCESS_REMOTE_READ": 4, "IBV_ACCESS_REMOTE_ATOMIC": 8, "IBV_WC_SUCCESS": 0,
           "IBV_WC_RETRY_EXC_ERR": 12, "IBV_MTU_1024": 3}


@needs_pyverbs
def test_verbs_enums_match_verbs_h_on_the_installed_pyverbs():
    E = rd.verbs_enums()
    for name, value in VERBS_H.items():
        assert getattr(E, name) == value, name


@needs_pyverbs
def test_ring_memory_never_allows_remote_atomics():
    E = rd.verbs_enums()
    port = rd.RdmaPort("x", 1, "CA", "Ethernet", "ACTIVE", 0, ())
    vp = rd.VerbsPort.__new__(rd.VerbsPort)   # access() needs only the enums, not an open device
    vp.E, vp.port = E, port
    assert vp.access(True) & E.IBV_ACCESS_REMOTE_ATOMIC == 0
    assert vp.access(True) & E.IBV_ACCESS_RELAXED_ORDERING == 0
    assert vp.access(True) & (E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_REMOTE_READ) == 6
    assert vp.access(False) == E.IBV_ACCESS_LOCAL_WRITE


DEBIAN_PYVERBS = os.path.join(rd.DEBIAN_DIST_PACKAGES[0], "pyverbs")


@pytest.mark.skipif(not os.path.isdir(DEBIAN_PYVERBS), reason="Debian's python3-pyverbs not installed")
def test_a_venv_finds_debians_pyverbs():
    """The project venv hides /usr/lib/python3/dist-packages; the fallback loads only pyverbs from it."""
    code = ("import sys; from shared_layout.rdma import device as rd; m = rd.import_pyverbs(); "
            "E = rd.verbs_enums(); print(m.__file__, E.IBV_QPT_RC, "
            "any(p.startswith('/usr/lib/python3/dist-packages') for p in sys.path))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    path, rc, on_path = out.stdout.split()
    assert path.startswith(rd.DEBIAN_DIST_PACKAGES[0]) and rc == "2" and on_path == "False"


# -- work-request chains with real pyverbs objects --------------------------------------
def _has_next(wr) -> bool:
    """Is wr.next set? rdma-core 44's next_wr getter raises instead of copying a WR, but only
    when the pointer is set (it returns None for NULL first)."""
    from pyverbs.pyverbs_error import PyverbsUserError
    try:
        return wr.next_wr is not None
    except PyverbsUserError:
        return True


@needs_pyverbs
def test_write_chain_links_rdma_writes_and_signals_only_the_last():
    E = rd.verbs_enums()
    ops = [WriteOp(remote_offset=4096, length=256, staging_offset=0, inline=False, piece=0, piece_start=0),
           WriteOp(remote_offset=1024 + 4, length=116, staging_offset=256, inline=False, piece=1, piece_start=0),
           WriteOp(remote_offset=1024, length=4, staging_offset=376, inline=True, piece=2, piece_start=0)]
    wrs = rd.write_chain(E, ops, chain_id=9, local_addr=0x10000, lkey=0x11, rkey=0x22, remote_addr=0x7000_0000)
    got = [(chain_of(w.wr_id), w.wr_id & 0xFFFF, w.opcode, w.send_flags, _has_next(w)) for w in wrs]
    assert got == [(9, 0, E.IBV_WR_RDMA_WRITE, 0, True), (9, 1, E.IBV_WR_RDMA_WRITE, 0, True),
                   (9, 2, E.IBV_WR_RDMA_WRITE, E.IBV_SEND_INLINE | E.IBV_SEND_SIGNALED, False)]


@needs_pyverbs
def test_read_chain_is_rdma_reads_with_one_signal():
    E = rd.verbs_enums()
    ops = [ReadOp(0, 4096, 0), ReadOp(4096, 4096, 4096)]
    wrs = rd.read_chain(E, ops, chain_id=3, local_addr=0x20000, lkey=1, rkey=2, remote_addr=0)
    assert [w.opcode for w in wrs] == [E.IBV_WR_RDMA_READ] * 2
    assert [w.send_flags for w in wrs] == [0, E.IBV_SEND_SIGNALED]
    assert [_has_next(w) for w in wrs] == [True, False]
