"""The router's once-a-second loop: idle sessions, drained replicas, fresh replicas, rebalancing.

The composition root (router/app.py) runs `Housekeeping.run` under router/supervise.py's
supervision: a crash is logged, counted and the loop restarted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..metrics.router_metrics import RouterMetrics
from .affinity import AffinityStore
from .config import RoutingConfig
from .engine import RoutingEngine
from .membership import Membership


class Housekeeping:
    def __init__(
        self,
        engine: RoutingEngine,
        membership: Membership,
        affinity: AffinityStore,
        metrics: RouterMetrics,
        routing: RoutingConfig,
        clock: Callable[[], float],
    ) -> None:
        self.engine = engine
        self.membership = membership
        self.affinity = affinity
        self.metrics = metrics
        self.routing = routing
        self.clock = clock

    async def run(self) -> None:
        """Once a second: forget idle sessions, remove drained replicas, settle fresh replicas,
        export load balance; every rebalance interval, move a few idle sessions onto fresh
        replicas."""
        routing = self.routing
        engine, metrics = self.engine, self.metrics
        last_rebalance = self.clock()
        while True:
            await asyncio.sleep(1.0)
            now = self.clock()
            engine.table.expire(now)
            self.membership.remove_drained()
            engine.settle_fresh()
            _, max_over_mean, cv = engine.load_stats()
            metrics.load_max_over_mean.set(max_over_mean)
            metrics.load_cv.set(cv)
            metrics.sessions.set(len(engine.table))
            metrics.affinity_degraded.set(1 if self.affinity.degraded else 0)
            if now - last_rebalance >= routing.rebalance_interval_s:
                last_rebalance = now
                for move in engine.plan_rebalance(
                    now, routing.rebalance_interval_s, routing.rebalance_max_moves,
                    kv_pressure=routing.rebalance_kv_pressure,
                ):
                    await self.affinity.move(move.session, move.target)
                    metrics.rebalanced.inc()
