"""What `blink serve` tells its frontend about restarts: one small JSON file.

    serve (supervisor): a child died or (re)started -> write(path, {name: ChildState}) (atomic rename)
    frontend: GET /metrics -> read(path) -> blink_daemon_restarts_total,
        blink_frontend_restarts_total, blink_seconds_since_last_restart{process}
        GET /health (503) -> read(path) -> "blink serve restarts the gpu-daemon" in the body

The path reaches the frontend in $BLINK_SUPERVISOR_STATE (config.supervisor_state_path);
without it (a frontend run by hand or by systemd, whose own restart count is
`systemctl show -p NRestarts`) these metrics are absent. A file, not ring header
words: the ring is the daemon/frontend contract, and restarts are the supervisor's
knowledge, exact even across a restart of the frontend that reports them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib

DAEMON, FRONTEND = "gpu-daemon", "frontend"


@dataclasses.dataclass(frozen=True)
class ChildState:
    restarts: int          # starts after the first one
    started_unix_s: float  # wall clock of the latest (re)start
    restarting: bool = False   # dead, waiting out its backoff or starting again


def write(path: pathlib.Path, children: dict[str, ChildState]) -> None:
    """Replace the file at once (a reader never sees half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({name: dataclasses.asdict(c) for name, c in children.items()}))
    os.replace(tmp, path)


def read(path: pathlib.Path | None) -> dict[str, ChildState] | None:
    """The supervisor's view, or None without a supervisor (or an unreadable file)."""
    if path is None:
        return None
    try:
        raw = json.loads(path.read_text())
        return {name: ChildState(int(c["restarts"]), float(c["started_unix_s"]), bool(c.get("restarting", False)))
                for name, c in raw.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
