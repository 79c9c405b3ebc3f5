"""What ``kvrouter compare`` runs: its contenders, its settings, and the data of one run.

A contender is a policy of our router or an external router given as a command template
(``NAME=TEMPLATE``) with ``{port}``, ``{worker_urls}`` (replica URLs, space-separated),
``{worker_url_flags}`` (``--replica URL`` per replica), ``{python}`` (this interpreter) and
``{free_port}`` (another free port, e.g. for a router's own metrics listener) substituted
(:func:`expand_template`). With more than one users level a run is named
``NAME@uN`` (:func:`contender_key`).
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from .process_group import free_port
from .report import RequestRecord

__all__ = [
    "Contender",
    "CompareConfig",
    "RunData",
    "parse_external",
    "parse_variant",
    "with_settings",
    "expand_template",
    "contender_key",
]


@dataclass(frozen=True)
class Contender:
    """A policy of our router (``template`` None) or an external router command template."""

    name: str
    policy: str | None = None
    template: str | None = None
    # Router config settings for a policy contender, as (dotted key, value) pairs: a variant of
    # the router, such as ("learning.eviction_order", "leaf_first").
    settings: tuple[tuple[str, Any], ...] = ()

    @property
    def kind(self) -> str:
        return "policy" if self.template is None else "external"


def parse_external(spec: str) -> Contender:
    """``NAME=COMMAND TEMPLATE`` (split at the first ``=``)."""
    name, sep, template = spec.partition("=")
    name, template = name.strip(), template.strip()
    if not sep or not name or not template:
        raise ValueError(f"--external {spec!r}: expected NAME=COMMAND TEMPLATE")
    if "@" in name or "/" in name:
        raise ValueError(f"--external {spec!r}: NAME must not contain '@' or '/'")
    if "{port}" not in template:
        raise ValueError(f"--external {spec!r}: the template must use {{port}}")
    return Contender(name=name, template=template)


def parse_variant(spec: str) -> Contender:
    """``NAME=POLICY KEY=VALUE ...``: the router with `POLICY` and config settings, each a
    dotted key (``learning.eviction_order``) and a YAML value."""
    name, sep, rest = spec.partition("=")
    name = name.strip()
    words = rest.split()
    if not sep or not name or not words:
        raise ValueError(f"--variant {spec!r}: expected NAME=POLICY KEY=VALUE ...")
    if "@" in name or "/" in name:
        raise ValueError(f"--variant {spec!r}: NAME must not contain '@' or '/'")
    settings = []
    for word in words[1:]:
        key, eq, value = word.partition("=")
        if not eq or not key or any(not part for part in key.split(".")):
            raise ValueError(f"--variant {spec!r}: {word!r} is not KEY=VALUE")
        try:
            settings.append((key, yaml.safe_load(value)))
        except yaml.YAMLError as exc:
            raise ValueError(f"--variant {spec!r}: {word!r}: {exc}") from None
    return Contender(name=name, policy=words[0], settings=tuple(settings))


def with_settings(data: dict[str, Any], settings: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """`data` (a router config) with each dotted key set to its value."""
    for key, value in settings:
        *path, last = key.split(".")
        section = data
        for part in path:
            section = section.setdefault(part, {})
            if not isinstance(section, dict):
                raise ValueError(f"setting {key!r}: {part!r} is not a section")
        section[last] = value
    return data


def expand_template(template: str, port: int, worker_urls: Sequence[str]) -> list[str]:
    """The argv of an external contender. Placeholders are replaced as plain text *before*
    :func:`shlex.split`, so an unquoted ``{worker_urls}`` becomes one argument per URL and a quoted
    one a single argument; other braces (JSON, say) are left alone. ``{free_port}`` is a port free
    right now other than ``port`` (a router's metrics listener must not collide with a fixed default
    when several run on one host)."""
    values = {
        "{port}": str(port),
        "{worker_urls}": " ".join(worker_urls),
        "{worker_url_flags}": " ".join(f"--replica {u}" for u in worker_urls),
        "{python}": shlex.quote(sys.executable),
    }
    if "{free_port}" in template:
        spare = free_port()
        while spare == port:
            spare = free_port()
        values["{free_port}"] = str(spare)
    text = template
    for key, value in values.items():
        text = text.replace(key, value)
    argv = shlex.split(text)
    if not argv:
        raise ValueError(f"external template {template!r} expands to nothing")
    return argv


def contender_key(name: str, users: int, sweep: bool) -> str:
    return f"{name}@u{users}" if sweep else name


@dataclass
class CompareConfig:
    """One comparison: the fleet, the workload, the contenders, the users levels and the timing."""

    replicas: int = 8
    profile: str = "kimi-k2.6-b200-tp4"
    workload: str = "coding-agent"
    policies: Sequence[str] = ("coding-agent", "consistent_hash", "round_robin", "prefix_aware")
    externals: Sequence[Contender] = ()
    users: Sequence[int] = (8,)
    duration_s: float = 60.0
    seed: int = 0
    time_scale: float = 1.0
    drain_timeout_s: float = 30.0
    ramp_s: float = 0.0  # model seconds over which the users start
    warm_start: bool = False  # first sessions start mid-life (steady-state contexts, cold caches)
    warmup_s: float = 0.0  # model seconds left out of the results
    metrics_interval_s: float = 0.5
    ready_timeout_s: float = 60.0
    command: str | None = None  # the command line, for the report

    def contenders(self) -> list[Contender]:
        out = [Contender(name=p, policy=p) for p in self.policies] + list(self.externals)
        names = [c.name for c in out]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"contender names must be unique: {', '.join(dupes)}")
        if not out:
            raise ValueError("nothing to compare: give --policies and/or --external")
        return out


@dataclass
class RunData:
    """One contender at one users level: the contract result plus the raw data behind the charts."""

    contender: str
    users: int
    result: dict[str, Any]
    wall_s: float
    records: list[RequestRecord] = field(default_factory=list)
    load_samples: list[tuple[float, list[float]]] = field(default_factory=list)
    warmup_s: float = 0.0  # records and samples before this (model s) are not in ``result``
