"""The workload file: what a synthetic coding-agent session looks like, loaded from YAML.

:class:`WorkloadConfig` is validated by pydantic; :func:`load_workload` reads a YAML file or a
built-in (``loadtest/workloads/*.yaml``) and turns validation errors into one
:class:`WorkloadConfigError` that names the file and key. Sessions are drawn from a config by
:mod:`kvrouter.loadtest.workload`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .distributions import STRICT, Constant, Dist

__all__ = [
    "WORKLOADS_DIR",
    "ThinkTime",
    "Branching",
    "WorkloadConfig",
    "WorkloadConfigError",
    "builtin_workloads",
    "load_workload",
    "parse_workload",
]

WORKLOADS_DIR = Path(__file__).with_name("workloads")


class ThinkTime(BaseModel):
    """Pause before a turn (after the previous reply finished): a tool call with probability
    ``p_tool``, else a user reply. Seconds of model time."""

    model_config = STRICT
    p_tool: float = Field(ge=0, le=1)
    tool_s: Dist
    user_s: Dist

    def sample(self, rng: random.Random) -> float:
        is_tool = rng.random() < self.p_tool
        tool = self.tool_s.sample(rng)  # both drawn: a fixed number of draws per turn
        user = self.user_s.sample(rng)
        return tool if is_tool else user


class Branching(BaseModel):
    """With probability ``rate`` a turn fans out into ``fanout`` concurrent requests (>= 2)."""

    model_config = STRICT
    rate: float = Field(default=0.0, ge=0, le=1)
    fanout: Dist = Field(default_factory=lambda: Constant(value=2))


class WorkloadConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "workload"
    system_prompt_tokens: int = Field(ge=0)
    repo_context_tokens: Dist
    turns_per_session: Dist
    new_tokens_per_turn: Dist
    output_tokens: Dist
    think_time: ThinkTime
    branch: Branching = Field(default_factory=Branching)
    edit_rate: float = Field(default=0.0, ge=0, le=1)
    max_context_tokens: int = Field(gt=0)
    on_context_full: Literal["compact", "end"] = "compact"
    compact_summary_tokens: int = Field(default=0, ge=0)


class WorkloadConfigError(ValueError):
    """A workload file that does not parse or validate; the message names file and key."""


def builtin_workloads() -> list[str]:
    return sorted(p.stem for p in WORKLOADS_DIR.glob("*.yaml"))


def load_workload(path_or_name: str | Path) -> WorkloadConfig:
    """Load a workload YAML file, or a built-in by name (:func:`builtin_workloads`)."""
    path = Path(path_or_name)
    if not path.is_file():
        builtin = WORKLOADS_DIR / f"{path_or_name}.yaml"
        if not builtin.is_file():
            raise WorkloadConfigError(
                f"workload {str(path_or_name)!r}: no such file and not a built-in "
                f"({', '.join(builtin_workloads())})"
            )
        path = builtin
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise WorkloadConfigError(f"workload error: {path}: invalid YAML: {exc}") from exc
    return parse_workload(data, source=str(path))


def parse_workload(data: Any, source: str = "<dict>") -> WorkloadConfig:
    """Validate an already parsed mapping; errors name ``source`` and the key."""
    if not isinstance(data, dict):
        raise WorkloadConfigError(f"workload error: {source}: expected a mapping at top level")
    try:
        return WorkloadConfig.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            lines.append(f"workload error: {source}: {loc}: {msg}")
        raise WorkloadConfigError("\n".join(lines)) from None
