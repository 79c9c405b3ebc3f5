"""Prefill/decode disaggregation settings (SGLang's PD mode): the prefill and decode servers."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from .config_base import ReplicaUrl, _Strict


SGLANG_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default


def parse_prefill_spec(value: str) -> dict[str, Any]:
    """``URL[=BOOTSTRAP_PORT]`` (the ``--prefill`` flag) as a prefill server entry."""
    url, sep, port = value.rpartition("=") if "=" in value else (value, "", "")
    if not sep:
        return {"url": value}
    try:
        return {"url": url, "bootstrap_port": int(port)}
    except ValueError:
        raise ValueError(f"invalid prefill server {value!r} (want URL or URL=BOOTSTRAP_PORT)") from None


class PrefillServer(_Strict):
    url: ReplicaUrl = Field(description="Base URL of an SGLang server started with --disaggregation-mode prefill.")
    bootstrap_port: int = Field(
        SGLANG_BOOTSTRAP_PORT, ge=1, le=65535,
        description="Its --disaggregation-bootstrap-port (SGLang's default 8998), sent to the decode server.",
    )


class DisaggregationConfig(_Strict):
    """Prefill/decode disaggregation (SGLang's PD mode): every request goes to one prefill and
    one decode server at once, with bootstrap_host/port/room added to its body; the client
    streams from the decode server. The prefill servers are the routed replica pool (the
    policy, affinity and KV index apply to them); decode servers are chosen by load and KV usage."""

    prefill: tuple[PrefillServer, ...] = Field((), description="Prefill servers (the policy's replica pool).")
    decode: tuple[ReplicaUrl, ...] = Field((), description="Decode servers.")
    from_discovery: bool = Field(
        False, description="A PD fleet found by discovery: endpoints tagged `role: decode` join the decode "
        "servers, the others (`role: prefill` or untagged) the prefill servers. The static lists may then be "
        "empty; /ready waits for a healthy member of each pool.",
    )

    @field_validator("prefill", mode="before")
    @classmethod
    def _prefill_specs(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [parse_prefill_spec(v) if isinstance(v, str) else v for v in value]
        return value

    @model_validator(mode="after")
    def _both_pools(self) -> DisaggregationConfig:
        if bool(self.prefill) != bool(self.decode) and not self.from_discovery:
            raise ValueError("prefill and decode servers go together: give at least one of each "
                             "(or set from_discovery: true)")
        overlap = {p.url for p in self.prefill} & set(self.decode)
        if overlap:
            raise ValueError(f"a server cannot be both prefill and decode: {sorted(overlap)}")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.prefill) or self.from_discovery

    def bootstrap_port(self, url: str) -> int:
        """The bootstrap port of prefill server `url` (SGLang's default for one not listed)."""
        for p in self.prefill:
            if p.url == url:
                return p.bootstrap_port
        return SGLANG_BOOTSTRAP_PORT
