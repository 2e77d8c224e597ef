"""bench.control_plane end to end on a tiny budget: the bare aiohttp server, blink (null daemon
+ frontend) as real processes and the load generator, both phases (saturated, paced), and the
JSON and markdown it writes."""
from __future__ import annotations

import json
import subprocess
import sys


def test_control_plane_bench_runs_both_phases_and_writes_its_results(tmp_path):
    cmd = [sys.executable, "-m", "bench.control_plane", "--concurrency", "1,2", "--duration-s", "0.6",
           "--warmup-s", "0.2", "--repeats", "1", "--max-tokens", "32", "--paced-step-ms", "5", "--no-pin",
           "--loop", "asyncio", "--date", "2000-01-01", "--machine", "test", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads((tmp_path / "2000-01-01-test-control-plane.json").read_text())
    seen = {(r["phase"], r["server"], r["concurrency"]) for r in data["runs"]}
    for c in (1, 2):
        for want in (("saturated", "blink", c), ("saturated", "bare", c), ("saturated", "bare-1tok", c),
                     ("paced", "blink", c), ("paced", "bare", c)):
            assert want in seen, (want, sorted(seen))
    for r in data["runs"]:
        assert r["events"] > 0 and r["tokens"] >= r["events"], r
    md = (tmp_path / "2000-01-01-test-control-plane.md").read_text()
    assert "## Saturated: throughput" in md and "## Paced (5 ms per step)" in md and "## Targets" in md
    assert data["loop"] == "asyncio"
