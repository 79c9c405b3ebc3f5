"""Policy names -> factories. The transport only ever sees the `Policy` protocol."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import Policy
from .random_choice import RandomChoice
from .round_robin import RoundRobin

PolicyFactory = Callable[[dict[str, Any]], Policy]

_FACTORIES: dict[str, PolicyFactory] = {
    "round_robin": lambda params: RoundRobin(),
    "random": lambda params: RandomChoice(),
}


def policy_names() -> list[str]:
    return sorted(_FACTORIES)


def build_policy(name: str, params: dict[str, Any] | None = None) -> Policy:
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r} (known: {', '.join(policy_names())})"
        ) from None
    return factory(dict(params or {}))
