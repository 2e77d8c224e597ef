"""`blink bench`'s memory-bandwidth probe (bench/bandwidth.py): the served model's weight bytes a
decode step, and the report line that gives blink's 1-stream decode (1 / TPOT p50) as a fraction
of the triad bound."""
from __future__ import annotations

import pytest

from bench import bandwidth
from bench.report import bandwidth_lines


def _results(tpot_p50_ms: float | None, bw: dict | None) -> dict:
    def level(offered, tpot):
        return {"offered": offered, "summary": {"tpot": {"p50_ms": tpot}}}
    meta = {} if bw is None else {"bandwidth": bw}
    return {"meta": meta, "runs": [
        {"system": "blink", "condition": "isolated", "colocated": False,
         "levels": [level(1, tpot_p50_ms), level(8, 20.0)]},
        {"system": "blink", "condition": "hog x2", "colocated": True, "levels": [level(1, 50.0)]},
        {"system": "llamaserver", "condition": "isolated", "colocated": False, "levels": [level(1, 9.0)]}]}


BW = {"triad_gb_s": 40.0, "threads": 2, "weight_bytes_per_token": 100_000_000, "decode_bound_tok_s": 400.0}


def test_the_fraction_is_one_stream_decode_over_the_triad_bound():
    tok_s, frac = bandwidth.decode_fraction(BW, 5.0)
    assert tok_s == pytest.approx(200.0) and frac == pytest.approx(0.5)
    text = "\n".join(bandwidth_lines(_results(5.0, BW)))
    assert "Triad 40.0 GB/s with 2 threads" in text and "100.0 MB of weights" in text and "400 tok/s" in text
    assert "200.0 tok/s: 0.50 of the bound" in text
    assert text.count("of the bound") == 1           # only blink, only isolated, only at 1 stream


def test_no_probe_or_no_one_stream_level_means_no_fraction():
    assert bandwidth_lines(_results(5.0, None)) == []
    assert "of the bound" not in "\n".join(bandwidth_lines(_results(None, BW)))


def test_the_served_default_model_streams_its_blocks_and_head():
    """The embedded SmolLM2 served with the defaults: Q4_1 layers and the tied Q8_0 head as blocks,
    ~96.5 MB a step (the float32 table alone would be 113 MB)."""
    n = bandwidth.served_weight_bytes("default")
    assert 90e6 < n < 100e6
