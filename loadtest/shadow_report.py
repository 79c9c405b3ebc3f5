"""`kvrouter report LOG`: how the shadow policies (routing.shadow) compare with the live one, from
the decision log.

Per shadow policy, over the requests it was asked about: how often it picked the live policy's
replica, and its picks' predicted cached tokens and TTFT against the live picks' (the same cost
model for both, on the same snapshot). The predicted gain is the shadow's mean predicted TTFT minus
the live one's: positive, the live policy is predicted faster; negative, switching to the shadow
is predicted to help. For the live policy alone the log also holds the truth: the cached tokens
the replicas reported and the measured TTFT, shown beside their predictions, so the yardstick's
own error is on the same page.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from .trace_decision_log import read_log

__all__ = ["shadow_report", "render_report", "add_parser"]


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def shadow_report(path: str | Path) -> dict[str, Any]:
    rows = [r for r in read_log(Path(path)) if r.get("predicted_ttft_s") is not None]
    live: dict[str, Any] = {
        "requests": len(rows),
        "policy": sorted({r.get("policy") for r in rows if r.get("policy")}),
        "predicted_cached_mean": _mean([r["predicted_cached"] for r in rows]),
        "reported_cached_mean": _mean([r["reported_cached"] for r in rows
                                       if r.get("reported_cached") is not None]),
        "predicted_ttft_mean_s": _mean([r["predicted_ttft_s"] for r in rows]),
        "measured_ttft_mean_s": _mean([r["ttft_s"] for r in rows if r.get("ttft_s") is not None]),
    }
    names = sorted({name for r in rows for name in r.get("shadow") or {}})
    shadows = {}
    for name in names:
        asked = [(r, r["shadow"][name]) for r in rows if name in (r.get("shadow") or {})]
        costed = [(r, s) for r, s in asked if s.get("predicted_ttft_s") is not None]
        live_ttft = _mean([r["predicted_ttft_s"] for r, _ in costed])
        shadow_ttft = _mean([s["predicted_ttft_s"] for _, s in costed])
        shadows[name] = {
            "requests": len(asked),
            "agreement": sum(s.get("replica") == r["replica"] for r, s in asked) / len(asked),
            "predicted_cached_mean": _mean([s["predicted_cached"] for _, s in asked
                                            if s.get("predicted_cached") is not None]),
            "live_predicted_cached_mean": _mean([r["predicted_cached"] for r, _ in asked]),
            "predicted_ttft_mean_s": shadow_ttft,
            "live_predicted_ttft_mean_s": live_ttft,
            "predicted_gain_s": (shadow_ttft - live_ttft
                                 if shadow_ttft is not None and live_ttft is not None else None),
            "shadow_faster_share": (sum(s["predicted_ttft_s"] < r["predicted_ttft_s"] for r, s in costed)
                                    / len(costed) if costed else None),
        }
    return {"live": live, "shadows": shadows}


def _f(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def render_report(report: dict[str, Any]) -> str:
    live = report["live"]
    lines = [
        f"Live policy {', '.join(live['policy']) or '-'}: {live['requests']} decisions; cached tokens "
        f"predicted {_f(live['predicted_cached_mean'], 0)} vs reported {_f(live['reported_cached_mean'], 0)} "
        f"(mean); TTFT predicted {_f(live['predicted_ttft_mean_s'])} s vs measured "
        f"{_f(live['measured_ttft_mean_s'])} s (mean).",
        "",
    ]
    if not report["shadows"]:
        lines.append("No shadow policies in this log (routing.shadow).")
        return "\n".join(lines)
    lines += [
        "| shadow | decisions | agrees | cached (shadow / live) | TTFT s (shadow / live) | "
        "predicted gain s | shadow faster |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in report["shadows"].items():
        faster = s["shadow_faster_share"]
        lines.append(
            f"| {name} | {s['requests']} | {100 * s['agreement']:.1f}% | "
            f"{_f(s['predicted_cached_mean'], 0)} / {_f(s['live_predicted_cached_mean'], 0)} | "
            f"{_f(s['predicted_ttft_mean_s'])} / {_f(s['live_predicted_ttft_mean_s'])} | "
            f"{_f(s['predicted_gain_s'])} | {'-' if faster is None else f'{100 * faster:.1f}%'} |")
    lines += ["", "predicted gain: the shadow's mean predicted TTFT minus the live one's "
              "(positive: the live policy is predicted faster)."]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        report = shadow_report(args.log)
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(f"kvrouter report: {args.log}: {err!r}", file=sys.stderr)
        return 2
    print(render_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("report", help="shadow policies against the live one, from a decision log")
    p.add_argument("log", help="decision log (observability.decision_log)")
    p.add_argument("--json", metavar="FILE", help="also write the summary as JSON")
    p.set_defaults(func=run)
