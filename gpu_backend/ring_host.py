"""The daemon's side of the ring's lifecycle: create or attach the shared-memory
file, the header words a starting and a stopping daemon writes, and sweeps of
backend-owned slots left behind.

    open_ring(name, geometry) -> (ShmRegion, Ring): attach a matching ring (a
        frontend may hold its mapping, so a live file is never replaced),
        replace a file that is not a ring at all, or a ring of another layout
        (an earlier build's, other sizes) that no process maps, else create it 0600
    begin(ring): STARTING, backend_pid, backend_epoch + 1, shutdown cleared,
        slots a dead daemon was serving -> ABORT/BACKEND_SHUTDOWN
    publish_model(ring, vocab, max_len) -> READY ... end(ring) -> DOWN
"""
from __future__ import annotations

import logging
import os

import numpy as np

from shared_layout import (MAGIC, BackendPort, BackendStatus, ErrorCode, FinishReason, LayoutMismatch, Ring,
                           RingGeometry, SlotState)
from shared_layout.shm import ShmRegion
from shared_layout.states import ACTIVE_BACKEND_STATES


log = logging.getLogger("blink.gpu_daemon")


class RingError(Exception):
    """The ring cannot be used; the message is the one line the user sees."""


def open_ring(name: str, geometry: RingGeometry | None) -> tuple[ShmRegion, Ring]:
    """Attach `name` if it holds a ring of `geometry` (any geometry when None), else create it."""
    try:
        ShmRegion.exists(name)
    except ValueError as e:
        raise RingError(str(e)) from None
    for _ in range(3):   # a racing creator may delete or create the file under us
        if ShmRegion.exists(name):
            try:
                region = ShmRegion.open(name)
            except FileNotFoundError:
                continue
            except PermissionError as e:
                raise RingError(f"cannot open ring {name!r}: {e}") from None
            head = bytes(region.buf[:8]) if region.size >= 8 else b""
            if len(head) < 8 or int.from_bytes(head, "little") != MAGIC:
                # Not a ring (no magic): nobody can be attached to it, so replacing it is safe.
                region.close()
                region = ShmRegion.create(name, (geometry or RingGeometry()).total_size)
                return region, Ring.create(region.buf, geometry or RingGeometry())
            try:
                ring = Ring.attach(region.buf, expected=geometry)
            except LayoutMismatch as e:
                region.close()
                users = mapped_by(region.path)
                if users == []:
                    # Left by an earlier run (another build's layout version, other sizes) and mapped
                    # by nobody: no frontend can be reading it, so a fresh ring replaces it.
                    log.warning("ring %r had another layout (%s) and no process maps it: replaced", name, e)
                    geom = geometry or RingGeometry()
                    region = ShmRegion.create(name, geom.total_size)
                    return region, Ring.create(region.buf, geom)
                who = f" (pids {', '.join(map(str, users))})" if users else ""
                raise RingError(f"ring {name!r} exists with another layout ({e}); pass matching "
                                f"--slots/--prompt-arena-tokens/--output-arena-tokens, or stop its users{who} "
                                f"and remove {region.path}") from None
            _check_no_live_daemon(name, ring)
            return region, ring
        geom = geometry or RingGeometry()
        try:
            region = ShmRegion.create(name, geom.total_size, replace=False)
        except FileExistsError:
            continue
        return region, Ring.create(region.buf, geom)
    raise RingError(f"ring {name!r} keeps changing under us; is another daemon starting?")


def mapped_by(path: str) -> list[int] | None:
    """The other processes that map `path` (Linux: /proc/<pid>/maps); None where that cannot be
    known (no /proc). Processes whose maps we may not read are skipped: the ring file is 0600, so
    only our own user (or root) can map it, and our user's maps are readable."""
    if not os.path.isdir("/proc/self"):
        return None
    me, users = os.getpid(), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[5].rstrip("\n") in (path, path + " (deleted)"):
                        users.append(int(entry.name))
                        break
        except OSError:        # gone meanwhile, or not ours to read
            continue
    return users


def _check_no_live_daemon(name: str, ring: Ring) -> None:
    pid, status = ring.get("backend_pid"), ring.get("backend_status")
    if status == BackendStatus.DOWN or pid in (0, os.getpid()):
        return
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return                      # it died without saying so; we take over
    except PermissionError:
        pass                        # alive, another user
    raise RingError(f"another daemon (pid {pid}) serves ring {name!r}")


def begin(ring: Ring) -> int:
    """Announce a starting daemon; returns the new backend epoch."""
    ring.set("backend_status", BackendStatus.STARTING)
    ring.set("backend_pid", os.getpid())
    ring.set("shutdown", 0)
    epoch = ring.get("backend_epoch") + 1
    ring.set("backend_epoch", epoch)
    BackendPort(ring).beat()
    sweep(ring, ACTIVE_BACKEND_STATES)   # a previous daemon's requests cannot resume: their KV is gone
    return epoch


def publish_model(ring: Ring, vocab_size: int, max_model_len: int) -> None:
    ring.set("model_vocab_size", vocab_size)
    ring.set("model_max_len", max_model_len)
    ring.set("backend_status", BackendStatus.READY)


def end(ring: Ring) -> int:
    """Complete every backend-owned slot (pending ones too) and mark the backend DOWN."""
    n = sweep(ring, ACTIVE_BACKEND_STATES | {SlotState.PREFILL_PENDING})
    ring.set("backend_status", BackendStatus.DOWN)
    ring.set("backend_pid", 0)
    return n


def sweep(ring: Ring, states) -> int:
    """End slots in `states` with ABORT/BACKEND_SHUTDOWN; returns how many."""
    port = BackendPort(ring)
    slots = np.flatnonzero(np.isin(ring.state, np.array(sorted(int(s) for s in states), np.uint32)))
    for slot in slots.tolist():
        port.complete(slot, FinishReason.ABORT, ErrorCode.BACKEND_SHUTDOWN)
    return len(slots)
