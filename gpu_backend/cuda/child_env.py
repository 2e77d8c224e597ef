"""The environment of a process the CUDA checks start (a daemon, a frontend, a
benchmark's server): the parent's, with every PYTHONPATH entry kept in its
order and the checkout added if missing, so the child imports exactly the
modules the parent does. On the lent GPU machine the carried wheels live in a
folder on PYTHONPATH (scripts/gpu_check.sh); a child that got
PYTHONPATH=<checkout> alone would lose them.

    os.environ (+ extra variables) -> child_env() -> subprocess.Popen(env=...)
"""
from __future__ import annotations

import os
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]


def child_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """`base` (default os.environ) with PYTHONPATH = its entries + the checkout, and `extra` set."""
    env = dict(os.environ if base is None else base)
    entries = [e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e]
    if not any(pathlib.Path(e).resolve() == REPO for e in entries):
        entries.append(str(REPO))
    env["PYTHONPATH"] = os.pathsep.join(entries)
    env.update(extra)
    return env
