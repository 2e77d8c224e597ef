"""bench.step_kernel_count: the kernels a step launches, PyTorch's operators against the fused
Triton kernels (counted, not run), on a tiny model in a child process."""
from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

from gpu_backend.model import tiny_config

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_the_triton_step_launches_fewer_kernels_and_says_which(tmp_path):
    pytest.importorskip("triton")
    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_hf()))
    r = subprocess.run([sys.executable, "-m", "bench.step_kernel_count", "--model", f"random:{tmp_path}",
                        "--decode", "3x64"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    counts = dict(re.findall(r"kernels a step of decode\[3x1, ctx 64\], (torch|triton): (\d+)", r.stdout))
    assert set(counts) == {"torch", "triton"}, r.stdout
    layers = tiny_config().num_layers
    # per layer 4 matmuls, 2 norms, the decode attention and SiLU * up, plus the fixed parts
    assert int(counts["triton"]) < int(counts["torch"]) and int(counts["triton"]) >= 8 * layers
    line = r.stdout.splitlines()[-1]
    assert f"_decode_attention_kernel {layers}" in line and f"_silu_mul_kernel {layers}" in line
    assert f"_add_rms_norm_kernel {2 * layers + 1}" in line and "_draw_pick_kernel 1" in line
