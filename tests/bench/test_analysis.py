"""Saturation fit, operating range and the Table 6/7 summary on synthetic curves."""
import math

import pytest

from bench.analysis import LevelPoint, fit_saturation, geomean, operating_levels, ratio, summary_row
from bench.sweep import analyze


def test_fit_finds_the_knee_of_a_clean_hinge():
    x = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32]
    y = [min(v, 12.0) for v in x]                     # grows 1:1, plateau at 12 req/s
    fit = fit_saturation(x, y)
    assert fit.saturated
    assert fit.knee == pytest.approx(12.0, abs=0.1)
    assert fit.plateau == pytest.approx(12.0, abs=0.05)
    assert fit.slope == pytest.approx(1.0, abs=0.01)
    assert operating_levels(x, fit) == [1, 2, 3, 4, 5, 6, 8, 10, 12]


def test_fit_with_noise_and_a_knee_between_levels():
    x = [1, 2, 4, 6, 8, 12, 16, 24, 32]
    noise = [0.02, -0.03, 0.05, -0.04, 0.03, -0.05, 0.04, -0.02, 0.01]
    y = [0.5 * min(v, 9.0) + n for v, n in zip(x, noise)]   # knee at 9, plateau 4.5
    fit = fit_saturation(x, y)
    assert fit.saturated and 8.0 < fit.knee < 10.5
    assert fit.plateau == pytest.approx(4.5, abs=0.15)
    assert operating_levels(x, fit) == [1, 2, 4, 6, 8]


def test_linear_curve_has_no_plateau_and_flat_curve_saturates_at_once():
    x = [1, 2, 4, 8]
    fit = fit_saturation(x, [2.0 * v for v in x])
    assert not fit.saturated and fit.knee == pytest.approx(8.0)
    flat = fit_saturation(x, [3.0, 3.0, 3.0, 3.0])
    assert flat.saturated and flat.knee == pytest.approx(1.0) and flat.plateau == pytest.approx(3.0)
    assert operating_levels(x, flat) == [1]


def test_noise_below_the_line_at_the_last_level_is_not_saturation():
    x = [5, 20, 50, 100]
    fit = fit_saturation(x, [5.0, 20.1, 50.2, 98.5])          # 1.5 % short at the top: noise
    assert not fit.saturated and fit.knee == 100
    real = fit_saturation([1, 2, 4, 8], [1.0, 2.0, 4.0, 6.0])   # one level on a real plateau
    assert real.saturated and real.knee == pytest.approx(6.0, abs=0.05)
    assert operating_levels([1, 2, 4, 8], real) == [1, 2, 4]


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError):
        fit_saturation([1.0], [1.0])
    with pytest.raises(ValueError):
        fit_saturation([1.0, 2.0], [1.0])


def test_geomean_and_ratio():
    assert geomean([1.0, 100.0]) == pytest.approx(10.0)
    assert geomean([2.0, 8.0, float("nan")]) == pytest.approx(4.0)
    assert math.isnan(geomean([]))
    assert ratio(30.0, 10.0) == pytest.approx(3.0)
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(float("nan"), 1.0))


def test_summary_row_uses_the_operating_range_and_the_saturation_level():
    pts = [LevelPoint(1, 100.0, 10.0, 1.0, 100.0), LevelPoint(2, 400.0, 40.0, 2.0, 200.0),
           LevelPoint(4, 9000.0, 90.0, 2.1, 210.0)]
    row = summary_row(pts, operating=[1, 2], saturation_level=2)
    assert row["geo_p99_ttft_ms"] == pytest.approx(200.0)
    assert row["geo_p99_tpot_ms"] == pytest.approx(20.0)
    assert row["tput_at_sat_rps"] == 2.0 and row["tok_tput_at_sat"] == 200.0


def _run(system, colocated, curve):
    levels = []
    for x, (tput, ttft, tpot) in curve.items():
        levels.append({"offered": x, "summary": {"request_throughput": tput, "output_throughput": tput * 100,
                                                 "ttft": {"p99_ms": ttft}, "tpot": {"p99_ms": tpot}}})
    return {"system": system, "condition": "colocated:x" if colocated else "isolated", "colocated": colocated,
            "levels": levels}


def test_knee_between_levels_keeps_only_levels_below_it():
    fit = fit_saturation([1, 2, 4, 8, 16], [1.0, 2.0, 3.0, 3.0, 3.0])   # knee at 3 req/s
    assert fit.knee == pytest.approx(3.0, abs=0.05)
    assert operating_levels([1, 2, 4, 8, 16], fit) == [1, 2]


def test_analyze_builds_table_7_ratios_against_the_reference_range():
    ref_iso = {1: (1.0, 100, 10), 2: (2.0, 100, 10), 4: (4.0, 200, 20), 8: (4.0, 800, 40), 16: (4.0, 1600, 80)}
    ref_col = {1: (1.0, 110, 11), 2: (2.0, 110, 11), 4: (4.0, 220, 22), 8: (4.0, 900, 50), 16: (4.0, 1700, 90)}
    peer_iso = {1: (1.0, 200, 20), 2: (1.5, 400, 40), 4: (1.5, 800, 80), 8: (1.5, 1600, 160), 16: (1.5, 3200, 320)}
    peer_col = {1: (0.5, 2000, 200), 2: (0.75, 4000, 400), 4: (0.75, 8000, 800), 8: (0.75, 1, 1), 16: (0.75, 1, 1)}
    results = {"runs": [_run("blink", False, ref_iso), _run("blink", True, ref_col),
                        _run("peer", False, peer_iso), _run("peer", True, peer_col)]}
    an = analyze(results)
    ref = an["reference"]
    assert ref["system"] == "blink" and ref["operating_levels"] == [1, 2, 4] and ref["saturation_level"] == 4
    rows = {(r["system"], r["condition"]): r for r in an["table"]}
    blink_col = rows[("blink", "colocated:x")]
    assert blink_col["ratio"]["geo_p99_ttft_ms"] == pytest.approx(1.1)
    assert blink_col["ratio"]["tput_at_sat_rps"] == pytest.approx(1.0)
    assert blink_col["tput_at_sat_rps"] == 4.0 and blink_col["levels_used"] == [1, 2, 4]
    peer_col_row = rows[("peer", "colocated:x")]
    assert peer_col_row["ratio"]["geo_p99_ttft_ms"] == pytest.approx(10.0)
    assert peer_col_row["ratio"]["geo_p99_tpot_ms"] == pytest.approx(10.0)
    assert peer_col_row["ratio"]["tput_at_sat_rps"] == pytest.approx(0.5)
    assert "ratio" not in rows[("peer", "isolated")]


def test_spread_and_least_degraded_say_whether_the_order_is_clear_of_the_noise():
    from bench.analysis import least_degraded, spread
    s = spread([0.9, float("nan"), 1.1, 1.0, 0.95])
    assert s["median"] == pytest.approx(0.975) and s["min"] == 0.9 and s["max"] == 1.1 and len(s["values"]) == 4
    assert math.isnan(spread([])["median"])
    clear = least_degraded({"a": spread([0.98, 0.99, 1.0]), "b": spread([0.90, 0.93, 0.95])})
    assert clear["system"] == "a" and clear["clear"] and clear["runner_up"] == "b"
    noisy = least_degraded({"a": spread([0.94, 0.99, 1.02]), "b": spread([0.90, 0.95, 0.97])})
    assert noisy["system"] == "a" and not noisy["clear"]
    alone = least_degraded({"a": spread([0.9])})
    assert alone["runner_up"] is None and not alone["clear"]


def test_repeats_pair_each_colocated_sweep_with_the_isolated_one_of_its_repeat():
    from bench.report import markdown

    def run(system, colocated, repeat, tok):   # tok: output tokens/s at levels 1 and 8; TPOT p50 = 1000/tok
        r = _run(system, colocated, {1: (tok[0] / 100, 100, 10), 8: (tok[1] / 100, 200, 20)})
        for lv, t in zip(r["levels"], tok):
            sm = lv["summary"]
            sm["tpot"]["p50_ms"] = 1000.0 / t
            sm["ttft"]["p50_ms"] = 50.0
            sm.update(completed=10, requests=10, failed=0, timeouts=0, goodput=None,
                      itl={"p50_ms": 1.0, "p99_ms": 2.0}, e2e={"p50_ms": 1.0, "p99_ms": 2.0})
        r["repeat"] = repeat
        return r

    runs = [run("blink", False, 0, (100, 400)), run("blink", True, 0, (90, 400)),
            run("blink", False, 1, (50, 200)), run("blink", True, 1, (50, 180)),   # a slow repeat: ratios still pair
            run("peer", False, 0, (100, 300)), run("peer", True, 0, (80, 240)),
            run("peer", False, 1, (100, 300)), run("peer", True, 1, (85, 250))]
    an = analyze({"runs": runs})
    deg = {d["system"]: d for d in an["degradation"]}
    b = deg["blink"]
    assert b["repeats"] == 2 and b["condition"] == "colocated:x"
    assert b["tok_ratio_by_level"][1]["values"] == pytest.approx([0.9, 1.0])
    assert b["tok_ratio_by_level"][8]["values"] == pytest.approx([0.9, 1.0])
    assert b["tpot_p50_ratio_by_level"][1]["values"] == pytest.approx([1.0, 1 / 0.9])
    assert b["tok_ratio_geo"]["values"] == pytest.approx([0.9 ** 0.5] * 2)   # geo mean over the levels
    p = deg["peer"]["tok_ratio_geo"]
    assert p["max"] == pytest.approx((0.85 * 250 / 300) ** 0.5)
    best = an["least_degraded"]["colocated:x"]
    assert best["system"] == "blink" and best["clear"]   # blink's worst 0.95 > peer's best 0.84
    # the Table 6/7 rows compare within a repeat too
    rows = {(r["system"], r["condition"], r["repeat"]): r for r in an["table"]}
    assert rows[("blink", "colocated:x", 1)]["ratio"]["tput_at_sat_rps"] == pytest.approx(0.9)
    results = {"runs": runs, "analysis": an, "skipped": [], "meta": {
        "started": "s", "finished": "f", "model": "default", "argv": ["blink", "bench"],
        "machine": {"cpu_model": "x", "logical_cpus": 2, "mem_total_gib": 1, "os": "linux", "python": "3"},
        "load": {"mode": "concurrency", "levels": [1, 8], "duration_s": 1, "warmup_requests": 0, "timeout_s": 1},
        "workload": {"name": "w", "input_len": "1", "output_len": "1", "seed": 0},
        "placement": {"server_cpus": "0", "client_cpus": "0", "server_threads": 1}}}
    for r in runs:
        r["server"] = {"version": "v", "command": "c"}
    md = markdown(results, "t")
    assert "## Colocated / isolated over repeats" in md and "### blink / colocated:x #2" in md
    assert "| blink | colocated:x | 2 | 0.95x (0.95-0.95) | 0.95x (0.90-1.00) | 0.95x (0.90-1.00) |" in md
    assert "**blink** degrades least" in md
