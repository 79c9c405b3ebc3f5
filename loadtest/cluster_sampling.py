"""What the cluster simulator measures: load and session-placement samples every
`sample_interval_s`, and the run's result. A mixin of
:class:`~kvrouter.loadtest.cluster_sim.ClusterSimulator`; it only observes the simulation.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from .report import summarize_requests

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
        out["sessions_rebalanced"] = self.rebalanced
        out["load_timeline"] = self.load_timeline
        out["session_timeline"] = self.session_timeline
        return out
