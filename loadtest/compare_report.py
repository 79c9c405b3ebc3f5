"""The outputs of ``kvrouter compare``: the results JSON, the markdown tables and ``report.md``.

``results.json`` is the schema-1 results contract; with more than one users level the contenders
are named ``NAME@uN`` and a ``sweep`` section lists each contender's levels. ``report.md`` holds the
table, failures by reason and the charts (:mod:`kvrouter.loadtest.compare_charts`) when matplotlib
is installed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .compare_charts import CHART_FILES, write_charts
from .compare_config import CompareConfig, Contender, RunData, contender_key
from .report import SCHEMA_VERSION
from .workload_config import WorkloadConfig

__all__ = ["build_compare_report", "markdown_table", "failures_table", "report_markdown", "write_outputs"]


def build_compare_report(
    cfg: CompareConfig,
    workload: WorkloadConfig,
    contenders: Sequence[Contender],
    runs: Sequence[RunData],
    wall_s: float,
) -> dict[str, Any]:
    """The results JSON: one result per run (``NAME@uN`` with several users levels, plus a
    ``sweep`` section per contender) and the settings under ``workload``."""
    sweep = len(cfg.users) > 1
    results: dict[str, Any] = {}
    by_contender: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        results[contender_key(r.contender, r.users, sweep)] = r.result
        by_contender.setdefault(r.contender, []).append({"users": r.users, **r.result})
    report: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "workload": {
            **workload.model_dump(mode="json"),
            "seed": cfg.seed,
            "users": list(cfg.users) if sweep else cfg.users[0],
            "arrival_rate": None,
            "duration_s": cfg.duration_s,
            "time_scale": cfg.time_scale,
            "ramp_s": cfg.ramp_s,
            "warm_start": cfg.warm_start,
            "warmup_s": cfg.warmup_s,
            "replicas": cfg.replicas,
            "profile": cfg.profile,
            "contenders": {
                c.name: ({"policy": c.policy} if c.template is None else {"external": c.template})
                for c in contenders
            },
            "wall_s": round(wall_s, 1),
        },
        "results": results,
    }
    if sweep:
        report["sweep"] = by_contender
    return report

def _f(v: Any, digits: int = 2, pct: bool = False) -> str:
    if v is None:
        return "-"
    if pct:
        return f"{100 * v:.1f}%"
    if isinstance(v, float) and abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}"


def markdown_table(runs: Sequence[RunData]) -> str:
    head = (
        "| contender | users | ok | failed | TTFT p50 (s) | TTFT p95 (s) | cache hit | out tok/s/user "
        "| tok/min/replica | e2e p95 (s) | load max/mean | load CV | sessions/replica |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        x = r.result
        spr = x.get("sessions_per_replica") or []
        lines.append(
            f"| {r.contender} | {r.users or '-'} | {x['requests_ok']} | {x['requests_failed']} "
            f"| {_f(x['ttft_p50_s'], 3)} | {_f(x['ttft_p95_s'], 3)} | {_f(x['cache_hit_rate'], pct=True)} "
            f"| {_f(x['output_tps_per_user'], 1)} | {_f(x['tokens_per_min_per_replica'], 0)} "
            f"| {_f(x['e2e_p95_s'], 2)} | {_f(x['load_max_over_mean'], 2)} | {_f(x['load_cv'], 2)} "
            f"| {'/'.join(str(s) for s in spr) if spr else '-'} |"
        )
    return "\n".join(lines)


def failures_table(runs: Sequence[RunData]) -> str:
    """Failed requests of every run by reason (HTTP status, message); "" when none failed."""
    rows = [(r, f) for r in runs for f in r.result.get("failures") or ()]
    if not rows:
        return ""
    lines = ["| contender | users | status | reason | requests |", "|---|---|---|---|---:|"]
    for r, f in rows:
        message = str(f["message"]).replace("|", "\\|")
        lines.append(f"| {r.contender} | {r.users or '-'} | {f['status'] or '-'} | {message} | {f['count']} |")
    return "\n".join(lines)

def report_markdown(cfg: CompareConfig, report: dict[str, Any], runs: Sequence[RunData], charts: bool) -> str:
    w = report["workload"]
    walls = [r.wall_s for r in runs]
    lines = ["# Router comparison", ""]
    if cfg.command:
        lines += ["```", cfg.command, "```", ""]
    lines += [
        f"{cfg.replicas} simulated replicas (`{cfg.profile}`), workload `{w['name']}` (seed {cfg.seed}), "
        f"closed-loop users {', '.join(str(u) for u in cfg.users)}, {cfg.duration_s:g} s of wall time per "
        f"run at time scale {cfg.time_scale:g} (~{cfg.duration_s * cfg.time_scale / 60:.1f} model minutes), "
        + (f"users starting evenly over the first {cfg.ramp_s:g} model seconds, " if cfg.ramp_s else "")
        + ("each user's first session starting mid-life (warm start: steady-state context sizes, cold "
           "caches), " if cfg.warm_start else "")
        + (f"the first {cfg.warmup_s:g} model seconds not measured, " if cfg.warmup_s else "")
        + f"caches flushed before every run. Times are model seconds. Whole comparison: {w['wall_s']:.0f} s wall"
        + (f" (runs {min(walls):.0f}-{max(walls):.0f} s incl. drain)." if walls else "."),
        "",
        markdown_table(runs),
        "",
        "Columns: `ok`/`failed` requests; TTFT percentiles; `cache hit` = cached / prompt tokens; "
        "`out tok/s/user` = median per-request decode speed; `tok/min/replica` = prompt + output tokens "
        "per model minute per replica; `load max/mean` and `load CV` = imbalance of running requests "
        "across replicas (mean over samples); `sessions/replica` = distinct sessions each replica served.",
        "",
    ]
    failures = failures_table(runs)
    if failures:
        lines += ["Failed requests by reason (HTTP status or SSE error code, message with numbers as N):", "",
                  failures, ""]
    if charts:
        lines += [f"![{f[:-4]}]({f})" for f in CHART_FILES] + [""]
    else:
        lines += ["Charts skipped: matplotlib is not installed (`pip install 'kvrouter[charts]'`).", ""]
    return "\n".join(lines)


def write_outputs(
    cfg: CompareConfig,
    report: dict[str, Any],
    runs: Sequence[RunData],
    out_dir: Path | None,
    json_path: Path | None,
) -> list[Path]:
    """Write the results JSON to ``json_path`` and, with ``out_dir``, ``report.md`` and the charts
    there (and the JSON as ``out_dir/results.json`` when no ``json_path``); returns what it wrote."""
    written: list[Path] = []
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        written.append(json_path)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        charts = write_charts(runs, out_dir)
        written += charts
        md = out_dir / "report.md"
        md.write_text(report_markdown(cfg, report, runs, bool(charts)))
        written.append(md)
        if json_path is None:
            default_json = out_dir / "results.json"
            default_json.write_text(json.dumps(report, indent=2) + "\n")
            written.append(default_json)
    return written

