"""`kvrouter profile-traffic LOG`: the workload contract of a decision log, before any tuning.

Five distributions, bucketed, printed as a table (and drawn with matplotlib when it is installed,
the `charts` extra):
- input length: prompt tokens (the replica's reported count, else the router's estimate);
- output length: output tokens the replica reported (requests without a report are left out);
- prefix overlap: share of a request's prompt blocks that repeat an earlier request's prefix,
  found as the replay finds it (loadtest/trace_decision_log.py): its session's previous request
  when it extends it, else the deepest power-of-two mark any earlier request agrees with;
- session concurrency: sessions with a request in flight when each request arrives (itself
  included), from the logged arrival times and durations;
- inter-arrival: gaps between consecutive arrivals.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .trace_decision_log import LoggedRequest, logged_request, read_log, shared_blocks

__all__ = ["Distribution", "profile_traffic", "render_table", "write_chart", "add_parser"]


@dataclass(frozen=True)
class Distribution:
    name: str
    unit: str
    edges: tuple[float, ...]  # bucket i holds values in (edges[i-1], edges[i]]; the last is open
    labels: tuple[str, ...]
    values: tuple[float, ...]

    def counts(self) -> list[int]:
        out = [0] * len(self.labels)
        for v in self.values:
            out[min(bisect.bisect_left(self.edges, v), len(self.labels) - 1)] += 1
        return out

    def quantile(self, q: float) -> float | None:
        if not self.values:
            return None
        ordered = sorted(self.values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _dist(name: str, unit: str, edges: tuple[float, ...], labels: tuple[str, ...], values: list[float]) -> Distribution:
    assert len(labels) == len(edges) + 1
    return Distribution(name, unit, edges, labels, tuple(values))


TOKENS = (1024, 4096, 16384, 32768, 65536, 131072)
TOKEN_LABELS = ("<=1k", "1k-4k", "4k-16k", "16k-32k", "32k-64k", "64k-128k", ">128k")
OUTPUT = (64, 256, 1024, 4096, 16384)
OUTPUT_LABELS = ("<=64", "65-256", "257-1k", "1k-4k", "4k-16k", ">16k")
OVERLAP = (0.0, 0.25, 0.5, 0.75, 0.9, 0.99)
OVERLAP_LABELS = ("0%", "0-25%", "25-50%", "50-75%", "75-90%", "90-99%", ">99%")
CONCURRENCY = (1, 4, 16, 64, 256)
CONCURRENCY_LABELS = ("1", "2-4", "5-16", "17-64", "65-256", ">256")
GAPS = (0.01, 0.1, 1.0, 10.0, 60.0)
GAP_LABELS = ("<=10ms", "10-100ms", "0.1-1s", "1-10s", "10-60s", ">60s")


def _overlaps(requests: list[tuple[str, LoggedRequest]]) -> list[float]:
    """Per request (in arrival order), the share of its blocks an earlier request's prefix covers."""
    seen: set[tuple[int, str]] = set()  # (mark index, hash) of every earlier request
    last: dict[str, LoggedRequest] = {}
    out = []
    for session, r in requests:
        shared = 0
        k = 0
        while k < len(r.marks) and (1 << k) - 1 < r.blocks and (k, r.marks[k]) in seen:
            shared = 1 << k
            k += 1
        prev = last.get(session)
        if prev is not None and prev.blocks:
            common, agrees = shared_blocks(prev, r)
            shared = max(shared, prev.blocks if agrees and r.blocks >= prev.blocks else common)
        if r.blocks:
            out.append(min(1.0, shared / r.blocks))
        for k, mark in enumerate(r.marks):
            if (1 << k) - 1 < r.blocks:
                seen.add((k, mark))
        last[session] = r
    return out


def _concurrency(requests: list[tuple[str, LoggedRequest]]) -> list[float]:
    """Sessions with a request in flight at each arrival (the arriving one counted)."""
    active: dict[str, int] = {}
    ends: list[tuple[float, str]] = []
    out = []
    for session, r in requests:
        while ends and ends[0][0] <= r.t:
            _, done = heapq.heappop(ends)
            active[done] -= 1
            if not active[done]:
                del active[done]
        active[session] = active.get(session, 0) + 1
        heapq.heappush(ends, (r.t + r.duration_s, session))
        out.append(float(len(active)))
    return out


def profile_traffic(path: str | Path) -> list[Distribution]:
    rows = read_log(Path(path))
    requests = sorted(((row.get("session") or f"r{i}", logged_request(row), row) for i, row in enumerate(rows)),
                      key=lambda x: x[1].t)
    reqs = [(s, r) for s, r, _ in requests]
    outputs = [float(row["output_tokens"]) for _, _, row in requests if row.get("output_tokens") is not None]
    times = [r.t for _, r in reqs]
    return [
        _dist("input length", "tokens", TOKENS, TOKEN_LABELS, [float(r.prompt) for _, r in reqs]),
        _dist("output length", "tokens", OUTPUT, OUTPUT_LABELS, outputs),
        _dist("prefix overlap", "share of prompt", OVERLAP, OVERLAP_LABELS, _overlaps(reqs)),
        _dist("session concurrency", "sessions", CONCURRENCY, CONCURRENCY_LABELS, _concurrency(reqs)),
        _dist("inter-arrival", "seconds", GAPS, GAP_LABELS, [b - a for a, b in zip(times, times[1:])]),
    ]


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if v < 1000 else f"{v:,.0f}"


def render_table(dists: list[Distribution]) -> str:
    lines = []
    for d in dists:
        n = len(d.values)
        lines.append(f"### {d.name} ({d.unit}; n={n}, p50 {_fmt(d.quantile(0.5))}, "
                     f"p90 {_fmt(d.quantile(0.9))}, p99 {_fmt(d.quantile(0.99))})")
        lines.append("")
        lines.append("| bucket | requests | share |")
        lines.append("|---|---:|---:|")
        for label, count in zip(d.labels, d.counts()):
            lines.append(f"| {label} | {count} | {100 * count / n if n else 0:.1f}% |")
        lines.append("")
    return "\n".join(lines)


def as_json(dists: list[Distribution]) -> dict[str, Any]:
    return {d.name: {"unit": d.unit, "n": len(d.values), "buckets": dict(zip(d.labels, d.counts())),
                     "p50": d.quantile(0.5), "p90": d.quantile(0.9), "p99": d.quantile(0.99)}
            for d in dists}


def write_chart(dists: list[Distribution], path: Path) -> bool:
    """One PNG with a bar chart per distribution; False if matplotlib is not installed."""
    try:
        from .compare_charts import _pyplot, _save
        plt = _pyplot()
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(dists), figsize=(4 * len(dists), 3.2))
    for ax, d in zip(axes, dists):
        ax.bar(range(len(d.labels)), d.counts(), color="#1f77b4")
        ax.set_xticks(range(len(d.labels)), d.labels, rotation=45, ha="right", fontsize=8)
        ax.set_title(d.name, fontsize=10)
        ax.set_xlabel(d.unit, fontsize=8)
    axes[0].set_ylabel("requests")
    _save(plt, fig, path)
    return True


def run(args: argparse.Namespace) -> int:
    try:
        dists = profile_traffic(args.log)
    except (OSError, ValueError) as err:
        print(f"kvrouter profile-traffic: {err}", file=sys.stderr)
        return 2
    print(render_table(dists))
    if args.json:
        Path(args.json).write_text(json.dumps(as_json(dists), indent=2) + "\n")
    if args.chart:
        if write_chart(dists, Path(args.chart)):
            print(f"chart: {args.chart}", file=sys.stderr)
        else:
            print("chart skipped: matplotlib is not installed (pip install 'kvrouter[charts]')",
                  file=sys.stderr)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("profile-traffic", help="distributions of a decision log's traffic (sizes, "
                       "prefix overlap, session concurrency, inter-arrival)")
    p.add_argument("log", help="decision log (observability.decision_log)")
    p.add_argument("--chart", metavar="PNG", help="also draw the distributions (needs matplotlib)")
    p.add_argument("--json", metavar="FILE", help="also write the buckets and quantiles as JSON")
    p.set_defaults(func=run)
