"""The machine label of a GPU benchmark's result files (bench.cuda_scheduler, bench.cuda_graphs):
`--machine auto` (their default) names the card the run found, so a result taken on an H200 is
never filed as an H100's.

    device name ("NVIDIA H200", "NVIDIA H100 80GB HBM3", ...) -> "h200", "h100", ...
"""
from __future__ import annotations

import re


def machine_label(requested: str, device_name: str | None) -> str:
    """`requested` unless it is "auto"; then the card's model (letter + digits, lower case) from its
    name, or "gpu" when the name holds none."""
    if requested != "auto":
        return requested
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", device_name or "")
    return m.group(1).lower() if m else "gpu"
