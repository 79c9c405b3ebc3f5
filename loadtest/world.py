"""A simulated world that is not the policy's model: the fleet's true speed, KV capacity and signal
lag, set apart from the constants the routing policy assumes.

`--world-perturb SPEC` takes comma-separated `key=value` items:

    speed=F       prefill, decode and host load-back run F times as fast as the profile says
    capacity=F    each replica's device KV pool holds F x the profile's tokens (replicas report the
                  true size in their signals, as SGLang does; the router's default stays nominal)
    signal-lag=S  every polled signal reaches the router S seconds after the replica published it

`nominal` (or an empty spec) is the profile as written. The policy, its cost constants and the
engine's default capacity are never touched: only the replicas change, and what the router hears.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from ..sglang_protocol.signals import ReplicaSignals

NOMINAL = "nominal"
_KEYS = {"speed": "speed", "capacity": "capacity", "signal-lag": "signal_lag_s"}


class WorldSpecError(ValueError):
    """A `--world-perturb` spec that cannot be read; the message is one line."""


@dataclass(frozen=True)
class World:
    speed: float = 1.0
    capacity: float = 1.0
    signal_lag_s: float = 0.0
    spec: str = NOMINAL

    @property
    def nominal(self) -> bool:
        return self.speed == 1.0 and self.capacity == 1.0 and self.signal_lag_s == 0.0


def parse_world(spec: str) -> World:
    """`speed=2`, `capacity=0.7,signal-lag=2`, `nominal`. Raises WorldSpecError."""
    text = spec.strip()
    if text in ("", NOMINAL):
        return World()
    values: dict[str, float] = {}
    for item in text.split(","):
        key, sep, raw = item.strip().partition("=")
        key = key.strip()
        if not sep or key not in _KEYS:
            raise WorldSpecError(
                f"bad world spec {spec!r}: {item.strip()!r} is not key=value with key one of "
                f"{', '.join(_KEYS)}"
            )
        if _KEYS[key] in values:
            raise WorldSpecError(f"bad world spec {spec!r}: {key} given twice")
        try:
            value = float(raw)
        except ValueError:
            raise WorldSpecError(f"bad world spec {spec!r}: {key}={raw.strip()!r} is not a number") from None
        if not math.isfinite(value):
            raise WorldSpecError(f"bad world spec {spec!r}: {key} must be finite")
        if key == "signal-lag":
            if value < 0:
                raise WorldSpecError(f"bad world spec {spec!r}: signal-lag must be >= 0 seconds")
        elif not 0 < value <= 100:
            raise WorldSpecError(f"bad world spec {spec!r}: {key} must be a factor in (0, 100]")
        values[_KEYS[key]] = value
    return World(spec=",".join(item.strip() for item in text.split(",")), **values)


class SignalDelay:
    """What stands between a replica's published signals and the router's registry: each signal
    published at `t` is due at exactly `t + lag_s`. Publications come in time order and the lag is
    constant, so a FIFO is the whole queue."""

    def __init__(self, lag_s: float) -> None:
        if lag_s < 0:
            raise ValueError("lag_s must be >= 0")
        self.lag_s = lag_s
        self._queue: deque[tuple[float, str, ReplicaSignals]] = deque()

    def publish(self, url: str, signals: ReplicaSignals, now: float) -> float:
        """Queue `signals` of `url` published at `now`; returns when they are due."""
        due = now + self.lag_s
        self._queue.append((due, url, signals))
        return due

    def due(self, now: float) -> list[tuple[str, ReplicaSignals]]:
        """The signals due by `now`, oldest first (each delivered once)."""
        out = []
        queue = self._queue
        while queue and queue[0][0] <= now:
            _, url, signals = queue.popleft()
            out.append((url, signals))
        return out

    def __len__(self) -> int:
        return len(self._queue)
