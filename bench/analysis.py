"""Sweep analysis as the paper does it (§6.2-6.3, Tables 6 and 7).

    throughput curve of the reference system (offered load -> achieved req/s)
        -> fit_saturation(): two-segment fit, linear growth then plateau
        -> operating range = the measured offered loads at or below the knee
    every (system, condition) curve -> summary_row(): geometric-mean P99 TTFT and
        P99 TPOT over the operating range, throughput at the saturation level
    colocated row / isolated row of the same system -> ratios (Table 7's brackets)

The fit is y = c + m * min(x, knee): least squares for c and m at every candidate
knee on a fine grid between the smallest and largest offered load, the knee with
the smallest squared error wins. A knee at the largest load, or a plateau within
5 % of the growth line's value there, means no plateau was reached inside the
sweep (`saturated` is False, knee = the largest load).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class SaturationFit:
    knee: float            # offered load where growth turns into the plateau
    plateau: float         # fitted throughput on the plateau (c + m * knee)
    slope: float           # fitted growth per unit of offered load before the knee
    intercept: float
    saturated: bool        # False when the best knee is the largest offered load
    sse: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def fit_saturation(offered: Sequence[float], achieved: Sequence[float], grid_points: int = 400,
                   plateau_tolerance: float = 0.95) -> SaturationFit:
    """Two-segment (hinge) least-squares fit of achieved throughput against offered load.

    A plateau that reaches plateau_tolerance of where the growth line would be at the
    largest load is noise, not saturation.
    """
    x = np.asarray(offered, dtype=np.float64)
    y = np.asarray(achieved, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError("offered and achieved must be 1-D and the same length")
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    if len(x) < 2:
        raise ValueError("the saturation fit needs at least 2 offered-load levels")
    order = np.argsort(x)
    x, y = x[order], y[order]
    lo, hi = float(x[0]), float(x[-1])
    candidates = np.unique(np.concatenate([np.linspace(lo, hi, grid_points), x]))
    best = None
    for knee in candidates:
        feature = np.minimum(x, knee)
        if np.ptp(feature) == 0:
            # Flat from the first level on: the plateau is the mean.
            c, m = float(y.mean()), 0.0
        else:
            a = np.stack([np.ones_like(feature), feature], axis=1)
            (c, m), *_ = np.linalg.lstsq(a, y, rcond=None)
        sse = float(((c + m * feature - y) ** 2).sum())
        # Prefer the earliest knee among (numerically) equal fits: on a plateau, any knee
        # beyond the last rising point fits equally well.
        if best is None or sse < best[0] - 1e-12 * max(1.0, best[0]):
            best = (sse, float(knee), float(c), float(m))
    sse, knee, c, m = best
    if m <= 0:
        # No growth at all: saturated from the first level.
        knee, m, c = lo, 0.0, float(y.mean())
    saturated = knee < hi - 1e-9 * max(1.0, abs(hi))
    if saturated and m > 0 and c + m * knee >= plateau_tolerance * (c + m * hi):
        # The "plateau" sits within noise of the growth line at the largest load: no saturation seen.
        knee, saturated = hi, False
    return SaturationFit(knee=knee, plateau=c + m * knee, slope=m, intercept=c, saturated=saturated, sse=sse)


def operating_levels(levels: Sequence[float], fit: SaturationFit) -> list[float]:
    """The measured offered loads at or below the knee (the paper's operating range)."""
    inside = [lv for lv in sorted(levels) if lv <= fit.knee + 1e-9]
    return inside or [min(levels)]


def geomean(values: Sequence[float]) -> float:
    """Geometric mean of positive finite values; NaN when there are none."""
    v = [x for x in values if x is not None and math.isfinite(x) and x > 0]
    if not v:
        return math.nan
    return float(math.exp(sum(math.log(x) for x in v) / len(v)))


@dataclasses.dataclass(frozen=True)
class LevelPoint:
    """What the summary needs of one level of one run."""
    offered: float
    p99_ttft_ms: float
    p99_tpot_ms: float
    request_throughput: float
    output_throughput: float


def summary_row(points: Sequence[LevelPoint], operating: Sequence[float], saturation_level: float) -> dict:
    """Table 6's row: geometric-mean P99 TTFT and TPOT over `operating`, throughput at `saturation_level`."""
    by_load = {p.offered: p for p in points}
    inside = [by_load[lv] for lv in operating if lv in by_load]
    at_sat = by_load.get(saturation_level)
    return {
        "geo_p99_ttft_ms": geomean([p.p99_ttft_ms for p in inside]),
        "geo_p99_tpot_ms": geomean([p.p99_tpot_ms for p in inside]),
        "tput_at_sat_rps": at_sat.request_throughput if at_sat else math.nan,
        "tok_tput_at_sat": at_sat.output_throughput if at_sat else math.nan,
        "levels_used": [p.offered for p in inside],
    }


def ratio(colocated: float, isolated: float) -> float:
    """colocated / isolated, NaN when either side is missing (None, NaN) or isolated is 0."""
    if colocated is None or isolated is None or not (math.isfinite(colocated) and math.isfinite(isolated)) \
            or isolated == 0:
        return math.nan
    return colocated / isolated


def spread(values: Sequence[float]) -> dict:
    """Median, min and max of the finite values (one per repeat), and the values themselves."""
    v = sorted(x for x in values if x is not None and math.isfinite(x))
    if not v:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "values": []}
    mid = len(v) // 2
    median = v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2
    return {"median": median, "min": v[0], "max": v[-1], "values": v}


def least_degraded(geo_by_system: dict[str, dict]) -> dict | None:
    """The system whose median colocated/isolated throughput ratio is highest, and whether that is
    clear of the repeat-to-repeat spread: its worst repeat above every other system's best."""
    ranked = sorted(((s, d) for s, d in geo_by_system.items() if math.isfinite(d["median"])),
                    key=lambda sd: sd[1]["median"], reverse=True)
    if not ranked:
        return None
    best, d = ranked[0]
    others = [o["max"] for _, o in ranked[1:]]
    return {"system": best, "median": d["median"], "clear": bool(others) and d["min"] > max(others),
            "runner_up": ranked[1][0] if len(ranked) > 1 else None}
