"""PNG plots of a run (matplotlib, Agg): one colour per system, isolated solid, colocated dashed.

    results -> NAME-latency.png    P99 TTFT, P99 TPOT, P50 ITL, P99 E2E vs offered load
            -> NAME-throughput.png request and output-token throughput vs offered load
"""
from __future__ import annotations

import math
import pathlib

COLORS = {"blink": "tab:blue", "vllm": "tab:orange", "llamacpp": "tab:green", "llamaserver": "tab:red",
          "url": "tab:purple"}
MARKERS = ("o", "s", "^", "D", "v")


def _series(run: dict, path: tuple[str, ...]) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for lv in run["levels"]:
        v = lv["summary"]
        for key in path:
            v = v.get(key) if isinstance(v, dict) else None
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(lv["offered"])
            ys.append(v)
    return xs, ys


def _draw(ax, results: dict, path: tuple[str, ...], title: str, ylabel: str, log: bool) -> None:
    conditions = sorted({r["condition"] for r in results["runs"] if r["colocated"]})
    for run in results["runs"]:
        if run.get("repeat", 0):
            continue   # one curve per system and condition: the first repeat (the markdown has them all)
        xs, ys = _series(run, path)
        if not xs:
            continue
        colocated = run["colocated"]
        marker = MARKERS[1 + conditions.index(run["condition"]) % (len(MARKERS) - 1)] if colocated else MARKERS[0]
        label = f"{run['system']} ({'colocated' if colocated else 'isolated'})"
        if colocated and len(conditions) > 1:
            label = f"{run['system']} ({run['condition'].split(':', 1)[1]})"
        ax.plot(xs, ys, linestyle="--" if colocated else "-", marker=marker, markersize=4,
                color=COLORS.get(run["system"], None), label=label)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if log:
        ax.set_yscale("log")


def plot_all(results: dict, out_dir: pathlib.Path, name: str) -> list[pathlib.Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mode = results["meta"]["load"]["mode"]
    xlabel = "concurrent requests" if mode == "concurrency" else "offered load (req/s)"
    paths = []

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (path, title) in zip(axes.flat, (
            (("ttft", "p99_ms"), "P99 TTFT"), (("tpot", "p99_ms"), "P99 TPOT"),
            (("itl", "p50_ms"), "P50 ITL"), (("e2e", "p99_ms"), "P99 E2E latency"))):
        _draw(ax, results, path, title, "ms", log=path[0] in ("ttft", "e2e"))
        ax.set_xlabel(xlabel)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=9)
    fig.suptitle(f"{name}: latency vs load (solid isolated, dashed colocated)", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    p = out_dir / f"{name}-latency.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    _draw(axes[0], results, ("request_throughput",), "Request throughput", "completed req/s", log=False)
    _draw(axes[1], results, ("output_throughput",), "Output token throughput", "tokens/s", log=False)
    for ax in axes:
        ax.set_xlabel(xlabel)
    ref = (results.get("analysis") or {}).get("reference")
    if ref and ref.get("fit") and ref["fit"].get("saturated"):
        for ax in axes:
            ax.axvline(ref["fit"]["knee"], color="grey", linestyle=":", linewidth=1)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=9)
    fig.suptitle(f"{name}: throughput vs load (dotted: saturation knee of the reference)", fontsize=11)
    fig.tight_layout(rect=(0, 0.1, 1, 0.93))
    p = out_dir / f"{name}-throughput.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths
