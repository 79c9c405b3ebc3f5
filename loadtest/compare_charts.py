"""The three PNG charts of ``kvrouter compare`` (matplotlib, optional: ``kvrouter[charts]``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .compare_config import RunData

__all__ = ["CHART_FILES", "write_charts"]

CHART_FILES = ("interactivity_vs_throughput.png", "ttft_distribution.png", "replica_load_over_time.png")


def _pyplot() -> Any:
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, pil_kwargs={"optimize": True})  # small PNGs: they are checked in
    plt.close(fig)


def _names(runs: Sequence[RunData]) -> list[str]:
    return list(dict.fromkeys(r.contender for r in runs))


def _colors(names: Sequence[str]) -> dict[str, Any]:
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
    return {n: palette[i % len(palette)] for i, n in enumerate(names)}


def chart_interactivity(runs: Sequence[RunData], path: Path) -> None:
    plt = _pyplot()
    names = _names(runs)
    colors = _colors(names)
    fig, ax = plt.subplots(figsize=(6, 4), dpi=80)
    for name in names:
        pts = sorted(
            (r.users, r.result["output_tps_per_user"], r.result["tokens_per_min_per_replica"])
            for r in runs
            if r.contender == name
            and r.result["output_tps_per_user"] is not None
            and r.result["tokens_per_min_per_replica"] is not None
        )
        if not pts:
            continue
        xs = [p[1] for p in pts]
        ys = [p[2] for p in pts]
        ax.plot(xs, ys, "o-", color=colors[name], label=name, markersize=4, linewidth=1.2)
        for users, x, y in pts:
            ax.annotate(f"u{users}", (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7,
                        color=colors[name])
    ax.set_xlabel("output tokens/s per user (median)")
    ax.set_ylabel("tokens/min per replica")
    ax.set_title("Interactivity vs throughput (labels: concurrent users)", fontsize=9)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    _save(plt, fig, path)


def chart_ttft(runs: Sequence[RunData], path: Path) -> None:
    """Grouped box plot: one group per users level, one box per contender (whiskers p5-p95)."""
    plt = _pyplot()
    names = _names(runs)
    colors = _colors(names)
    levels = sorted({r.users for r in runs})
    fig, ax = plt.subplots(figsize=(6, 4), dpi=80)
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        data, pos = [], []
        for i, users in enumerate(levels):
            ttft = [
                rec.ttft_s for r in runs if r.contender == name and r.users == users
                for rec in r.records if rec.ok and rec.ttft_s is not None and rec.start_s >= r.warmup_s
            ]
            if ttft:
                data.append([max(t, 1e-4) for t in ttft])
                pos.append(i - 0.4 + width * (j + 0.5))
        if not data:
            continue
        bp = ax.boxplot(data, positions=pos, widths=width * 0.85, whis=(5, 95), showfliers=False,
                        patch_artist=True, manage_ticks=False)
        for box in bp["boxes"]:
            box.set(facecolor=colors[name], alpha=0.55, edgecolor=colors[name])
        for part in ("whiskers", "caps", "medians"):
            for line in bp[part]:
                line.set(color=colors[name] if part != "medians" else "black", linewidth=1)
        ax.plot([], [], "s", color=colors[name], alpha=0.6, label=name)
    ax.set_xticks(range(len(levels)))
    ax.set_xticklabels([f"{u} users" for u in levels])
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (model s, log)")
    ax.set_title("TTFT per request (box p25-p75, whiskers p5-p95)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    _save(plt, fig, path)


def chart_replica_load(runs: Sequence[RunData], path: Path) -> None:
    """Running requests per replica over time, one panel per contender (highest users level)."""
    plt = _pyplot()
    names = _names(runs)
    top = max(r.users for r in runs)
    chosen = [next(r for r in runs if r.contender == n and r.users == top) for n in names]
    fig, axes = plt.subplots(len(chosen), 1, figsize=(6, 4), dpi=80, sharex=True, sharey=True, squeeze=False)
    for ax, r in zip(axes[:, 0], chosen):
        if r.load_samples:
            t = [s[0] / 60.0 for s in r.load_samples]
            n_rep = len(r.load_samples[0][1])
            for k in range(n_rep):
                ax.plot(t, [s[1][k] for s in r.load_samples], linewidth=0.9, drawstyle="steps-post", antialiased=False)
        if r.warmup_s > 0:
            ax.axvspan(0, r.warmup_s / 60.0, color="0.9", linewidth=0)
        ax.set_ylabel(r.contender, fontsize=7, rotation=0, ha="right", va="center")
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("model time (min)")
    shaded = " (grey: warm-up, not measured)" if any(r.warmup_s for r in chosen) else ""
    fig.suptitle(f"Running requests per replica, {top} users{shaded}", fontsize=9)
    _save(plt, fig, path)


def write_charts(runs: Sequence[RunData], out_dir: Path) -> list[Path]:
    """The three PNGs; [] when matplotlib is missing."""
    try:
        _pyplot()
    except ImportError:
        return []
    paths = [out_dir / f for f in CHART_FILES]
    chart_interactivity(runs, paths[0])
    chart_ttft(runs, paths[1])
    chart_replica_load(runs, paths[2])
    return paths
