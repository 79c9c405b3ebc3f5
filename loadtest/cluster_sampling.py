"""What the cluster simulator measures: load and session-placement samples every
`sample_interval_s`, and the run's result. A mixin of
:class:`~kvrouter.loadtest.cluster_sim.ClusterSimulator`; it only observes the simulation.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from .report import RequestRecord, percentile, summarize_requests

if TYPE_CHECKING:
    from .cluster_sim import ClusterSimulator


class SamplingMixin:
    def _sample(self: ClusterSimulator) -> None:
        if self.now < self.config.warmup_s:
            return
        running = [float(m.requests()) for m in self.models.values()]
        if not running:
            return
        self.load_samples.append(running)
        ordered = sorted(running)
        mean = sum(running) / len(running)
        live = self.live_sessions_per_replica()
        sessions = sorted(live.get(url, 0) for url in self.models)
        n = len(sessions)
        self.session_timeline.append({
            "t_s": round(self.now, 3), "mean": round(sum(sessions) / n, 3), "max": sessions[-1],
            "min": sessions[0], "at_most_1_fraction": round(sum(1 for x in sessions if x <= 1) / n, 4),
            "at_least_12_fraction": round(sum(1 for x in sessions if x >= 12) / n, 4),
        })
        self.load_timeline.append({
            "t_s": round(self.now, 3), "replicas": len(running), "mean": round(mean, 3),
            "max": ordered[-1], "p50": ordered[len(ordered) // 2],
            "p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
            "idle_fraction": round(sum(1 for x in running if x == 0) / len(running), 4),
        })

    def live_sessions_per_replica(self: ClusterSimulator) -> Counter[str]:
        """Homes of the sessions still running (a measurement: the router cannot tell these from
        ended sessions whose home it still keeps)."""
        homes: Counter[str] = Counter()
        for session in self._sessions.values():
            entry = self.table.entry(session.session_id)
            if entry is not None and entry.home is not None:
                homes[entry.home] += 1
        return homes

    def result(self: ClusterSimulator) -> dict[str, Any]:
        cfg = self.config
        measured = [r for r in self.records if cfg.warmup_s <= r.start_s < cfg.duration_s]
        out = summarize_requests(measured, max(1, len(self.models)), cfg.duration_s - cfg.warmup_s,
                                 self.load_samples)
        live = self.live_sessions_per_replica()
        out["homed_sessions_per_replica"] = [live.get(url, 0) for url in sorted(self.models)]
        out["router_sessions"] = len(self.table)  # live and ended sessions the router still holds
        out["decisions"] = dict(sorted(self.decisions.items()))
        out["decisions_measured"] = by_reason(measured)
        out["sessions_rebalanced"] = self.rebalanced
        out["load_timeline"] = self.load_timeline
        out["session_timeline"] = self.session_timeline
        return out


def by_reason(records: list[RequestRecord]) -> dict[str, dict[str, Any]]:
    """Per routing rule (the decision's reason): how many measured requests it placed, the share
    of their prompt tokens the replica had cached (and the router's index predicted), and their
    TTFT p95: which rule loses the cache, and where the index misjudges it."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(r.reason or "unplaced", []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for reason, group in sorted(groups.items()):
        ok = [r for r in group if r.ok]
        prompt = sum(r.prompt_tokens for r in ok)
        ttft = percentile((r.ttft_s for r in ok if r.ttft_s is not None), 95)
        out[reason] = {
            "requests": len(group), "failed": len(group) - len(ok), "prompt_tokens": prompt,
            "cache_hit_rate": round(sum(r.cached_tokens for r in ok) / prompt, 4) if prompt else None,
            "predicted_hit_rate": round(sum(r.predicted_cached_tokens for r in ok) / prompt, 4) if prompt else None,
            "ttft_p95_s": round(ttft, 3) if ttft is not None else None,
        }
    return out
