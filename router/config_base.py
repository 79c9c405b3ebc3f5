"""What every configuration model shares: strict frozen models, the one-line error, replica URLs."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict
from yarl import URL


class ConfigError(Exception):
    """A configuration problem, already phrased as one line that names the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def normalize_replica_url(value: str) -> str:
    """Accept http(s)://host[:port][/prefix]; return it without a trailing slash."""
    if not isinstance(value, str):
        raise ValueError("must be a URL string")
    url = URL(value.strip())
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"invalid replica URL {value!r} (want http://host:port)")
    if url.query_string or url.fragment:
        raise ValueError(f"replica URL {value!r} must not have a query or fragment")
    return str(url).rstrip("/")


ReplicaUrl = Annotated[str, BeforeValidator(normalize_replica_url)]
