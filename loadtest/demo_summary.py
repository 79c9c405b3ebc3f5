"""What `kvrouter demo` concludes from several seeded rounds: each policy's mean and range per
metric, how many rounds each policy won, and the verdict in words.

One live round of a few minutes is too few requests to separate policies (the verdict flipped from
run to run), so the demo repeats the comparison with different seeds and says a policy wins a
metric only when it is best in every round; otherwise it names the rounds and calls the difference
noise when the ranges overlap. Pure functions over each round's results (the schema-1 result
dicts), so the words are testable without running anything.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

# (result key, label, higher is better, how a value prints)
METRICS: tuple[tuple[str, str, bool, str], ...] = (
    ("cache_hit_rate", "cache-hit rate", True, "pct"),
    ("ttft_p50_s", "TTFT p50", False, "s"),
    ("ttft_p95_s", "TTFT p95", False, "s"),
)

Rounds = Sequence[Mapping[str, Mapping[str, Any]]]  # per round: policy -> its result dict


def _fmt(value: float | None, kind: str) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f}%" if kind == "pct" else f"{value:.2f} s"


def _values(rounds: Rounds, policy: str, key: str) -> list[float]:
    return [r[policy][key] for r in rounds if policy in r and r[policy].get(key) is not None]


def summarize_rounds(rounds: Rounds, policies: Sequence[str]) -> dict[str, Any]:
    """Per policy and metric: mean, min, max over the rounds and the rounds it was best in (ties
    count for each tied policy)."""
    out: dict[str, Any] = {"rounds": len(rounds), "policies": {}}
    for policy in policies:
        out["policies"][policy] = {}
        for key, _, higher, _ in METRICS:
            values = _values(rounds, policy, key)
            wins = 0
            for r in rounds:
                mine = r.get(policy, {}).get(key)
                others = [r[p][key] for p in policies if p in r and r[p].get(key) is not None]
                if mine is not None and mine == (max(others) if higher else min(others)):
                    wins += 1
            out["policies"][policy][key] = {
                "mean": statistics.fmean(values) if values else None,
                "min": min(values) if values else None,
                "max": max(values) if values else None,
                "wins": wins,
            }
    return out


def table(summary: Mapping[str, Any]) -> str:
    """Markdown: one row per policy, each metric as `mean (min-max)` and rounds won."""
    n = summary["rounds"]
    head = "| policy | " + " | ".join(f"{label} mean (range) | best in" for _, label, _, _ in METRICS) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(METRICS))]
    for policy, metrics in summary["policies"].items():
        cells = []
        for key, _, _, kind in METRICS:
            m = metrics[key]
            cells.append(f"{_fmt(m['mean'], kind)} ({_fmt(m['min'], kind)}-{_fmt(m['max'], kind)})")
            cells.append(f"{m['wins']} of {n}")
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(summary: Mapping[str, Any], default: str) -> list[str]:
    """Sentences saying what the rounds show for `default` against each other policy, metric by
    metric: a clear win or loss (best or beaten in every round, ranges apart), or a split."""
    n = summary["rounds"]
    pols = summary["policies"]
    if default not in pols or n == 0:
        return []
    lines: list[str] = []
    losses: list[str] = []
    for key, label, higher, kind in METRICS:
        mine = pols[default][key]
        if mine["mean"] is None:
            continue
        others = {p: m[key] for p, m in pols.items() if p != default and m[key]["mean"] is not None}
        if not others:
            continue
        best_other, theirs = (max if higher else min)(others.items(), key=lambda kv: kv[1]["mean"])
        better = mine["mean"] > theirs["mean"] if higher else mine["mean"] < theirs["mean"]
        apart = mine["min"] > theirs["max"] if higher else mine["max"] < theirs["min"]
        apart_worse = mine["max"] < theirs["min"] if higher else mine["min"] > theirs["max"]
        said = (f"{label}: {default} {_fmt(mine['mean'], kind)} against {best_other}'s "
                f"{_fmt(theirs['mean'], kind)} (mean of {n} round{'' if n == 1 else 's'})")
        if _fmt(mine["mean"], kind) == _fmt(theirs["mean"], kind):
            # (a difference the figures shown cannot show is not a lead either way)
            lines.append(f"{said}: level on average; {default} is best in {mine['wins']} of {n} rounds.")
            losses.append(label)
        elif mine["wins"] == n and apart:
            lines.append(f"{said}: {default} is best in every round, and its worst round beats "
                         f"{best_other}'s best.")
        elif better:
            lines.append(f"{said}: {default} is ahead on average and best in {mine['wins']} of {n} "
                         f"rounds; " + ("the ranges do not overlap." if apart else
                                        "the ranges overlap, so this lead is within run-to-run noise."))
        elif apart_worse or mine["wins"] == 0:
            lines.append(f"{said}: {best_other} is better on average and {default} is best in no round"
                         + ("; the ranges do not overlap." if apart_worse else
                            " (the ranges overlap, but every round points the same way)."))
            losses.append(label)
        else:
            lines.append(f"{said}: {best_other} is ahead on average; {default} is best in "
                         f"{mine['wins']} of {n} rounds and the ranges overlap (not a clear loss).")
            losses.append(label)
    if losses:
        lines.append(f"Where {default} does not win here: {', '.join(losses)}.")
    else:
        lines.append(f"{default} has the best mean on every metric shown.")
    return lines


def demo_report(command: str, seeds: Sequence[int], summary: Mapping[str, Any], words: Sequence[str]) -> str:
    """The demo's report.md: the command, the summary table and the verdict."""
    links = ", ".join(f"[seed {s}](round-{s}/report.md)" for s in seeds)
    return "\n".join([
        "# kvrouter demo", "", "```", command, "```", "",
        f"{len(seeds)} rounds (seeds {', '.join(map(str, seeds))}); within a round every policy gets the "
        "same seeded traffic from cold caches. Each cell: the mean over the rounds (lowest-highest); "
        f"`best in`: the rounds in which the policy had the best value. Each round's table and charts: {links}.",
        "", table(summary), "", "What the numbers show:", "", *(f"- {line}" for line in words), "",
    ])
