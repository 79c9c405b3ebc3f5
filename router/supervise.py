"""Supervised background loops: a loop that crashes is logged, counted and started again.

Every long-lived task of the router (signal poller, housekeeping, each KV-event subscriber,
each discovery source) runs under :func:`supervise`. An unexpected exception is logged once
with its traceback, counted in ``kvrouter_background_restarts_total{task}``, and the loop is
started anew after an exponential backoff (capped, with jitter, so that many replicas'
subscribers failing together do not retry in lockstep). A run that lasted ``healthy_after_s``
or longer resets the backoff: one crash a day is not treated like a crash loop. Cancellation
is shutdown (or a removed replica), never a crash: it propagates at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvrouter.supervise")


@dataclass(frozen=True, slots=True)
class Backoff:
    initial_s: float = 0.1
    max_s: float = 30.0
    healthy_after_s: float = 60.0

    def delay(self, failures: int, rng: random.Random | Any = random) -> float:
        """Wait before restart number `failures + 1` in a row: half the exponential step,
        plus up to half again at random ("equal jitter": never zero, never in lockstep)."""
        step = min(self.max_s, self.initial_s * 2 ** min(failures, 32))
        return step / 2 + rng.uniform(0, step / 2)


DEFAULT_BACKOFF = Backoff()


async def supervise(
    task: str,
    run: Callable[[], Awaitable[None]],
    *,
    metrics: Any = None,
    detail: str = "",
    backoff: Backoff = DEFAULT_BACKOFF,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | Any = random,
) -> None:
    """Await `run()` until it returns; restart it after every unexpected exception.

    `task` is the metric label (a kind of loop, e.g. ``kv-events``: bounded cardinality);
    `detail` names the instance in the log (e.g. the replica URL). `metrics` is a
    RouterMetrics, or None to count nothing."""
    failures = 0
    label = f"{task} {detail}".strip()
    while True:
        started = clock()
        try:
            await run()
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            if clock() - started >= backoff.healthy_after_s:
                failures = 0
            wait = backoff.delay(failures, rng)
            failures += 1
            log.exception("background task %s crashed; restart %d in %.2f s", label, failures, wait)
            if metrics is not None:
                metrics.background_restarts.labels(task).inc()
        await asyncio.sleep(wait)


def spawn(
    task: str,
    run: Callable[[], Awaitable[None]],
    *,
    metrics: Any = None,
    detail: str = "",
    backoff: Backoff = DEFAULT_BACKOFF,
) -> asyncio.Task[None]:
    """Start `run` under :func:`supervise` as an asyncio task named after it."""
    name = f"{task} {detail}".strip()
    return asyncio.get_running_loop().create_task(
        supervise(task, run, metrics=metrics, detail=detail, backoff=backoff), name=name
    )
