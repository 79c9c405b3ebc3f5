"""Policy names and YAML presets -> policy objects. The transport only sees the `Policy` protocol.

A preset is `policies/<name>.yaml`: `{policy: <type>, params: {...}}`; params given in the
router config are merged over the preset's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .domain import Policy
from .coding_agent import CodingAgent, CodingAgentParams
from .consistent_hash import ConsistentHash, ConsistentHashParams
from .least_load import LeastLoad
from .prefix_aware import PrefixAware, PrefixAwareParams
from .random_choice import RandomChoice
from .round_robin import RoundRobin

PRESET_DIR = Path(__file__).resolve().parent
DEFAULT_POLICY = "coding-agent"


def _with(cls: Callable[[Any], Policy], params_model: type[BaseModel]) -> Callable[[dict[str, Any]], Policy]:
    return lambda params: cls(params_model.model_validate(params))


def _plain(cls: Callable[[], Policy]) -> Callable[[dict[str, Any]], Policy]:
    def build(params: dict[str, Any]) -> Policy:
        if params:
            raise ValueError(f"takes no params (got {', '.join(sorted(params))})")
        return cls()
    return build


TYPES: dict[str, Callable[[dict[str, Any]], Policy]] = {
    "coding_agent": _with(CodingAgent, CodingAgentParams),
    "consistent_hash": _with(ConsistentHash, ConsistentHashParams),
    "prefix_aware": _with(PrefixAware, PrefixAwareParams),
    "least_load": _plain(LeastLoad),
    "round_robin": _plain(RoundRobin),
    "random": _plain(RandomChoice),
}


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def policy_names() -> list[str]:
    return sorted(set(TYPES) | set(preset_names()))


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def resolve(name: str, params: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """(policy type, merged params) for a type name or a preset name."""
    params = dict(params or {})
    preset = PRESET_DIR / f"{name}.yaml"
    if name not in TYPES and preset.is_file():
        data = yaml.safe_load(preset.read_text()) or {}
        return data["policy"], _merge(data.get("params") or {}, params)
    if name not in TYPES:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(policy_names())})")
    return name, params


def build_policy(name: str, params: dict[str, Any] | None = None) -> Policy:
    kind, merged = resolve(name, params)
    try:
        return TYPES[kind](merged)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{where}: {first['msg']}" if where else first["msg"]) from None
