"""The `admission` section of the router's configuration: the router-side wait queue, priority
classes, tenants (client API keys) and TTFT SLOs. Off by default: routing is unchanged."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, model_validator

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PriorityClass(_Strict):
    rank: int = Field(..., ge=0, description="Queue order between classes: a lower rank leaves the queue first.")
    ttft_slo_s: float | None = Field(
        None, gt=0, description="TTFT SLO of the class (overrides admission.ttft_slo_s); None: the global one.")


class Tenant(_Strict):
    api_key_sha256: tuple[str, ...] = Field(
        (), description="SHA-256 (hex) of the client API keys that are this tenant "
        "(`printf %s KEY | sha256sum`): the keys themselves never sit in the config.")
    priority: str | None = Field(None, description="Priority class of the tenant's requests unless a request names one.")
    weight: float = Field(1.0, gt=0, description="Fair-share weight: prompt tokens served under contention scale with it.")
    ttft_slo_s: float | None = Field(None, gt=0, description="TTFT SLO of the tenant's requests (overrides class and global).")

    @model_validator(mode="after")
    def _hex_digests(self) -> Tenant:
        for digest in self.api_key_sha256:
            if not _SHA256_HEX.match(digest):
                raise ValueError(f"api_key_sha256: {digest[:12]!r}... is not 64 lowercase hex digits")
        return self


def _default_classes() -> dict[str, dict[str, int]]:
    return {"interactive": {"rank": 0}, "default": {"rank": 1}, "batch": {"rank": 2}}


class AdmissionConfig(_Strict):
    """Admission control (docs/admission.md). With `queue` off and no SLO the router dispatches
    every request at once, as it always did."""

    queue: bool = Field(
        False, description="When every candidate is over the policy's high-water marks, wait in a "
        "router-side queue (priority, then fair share, then arrival) if that predicts a lower TTFT "
        "than dispatching cold now.")
    max_queue: int = Field(1024, ge=1, description="Requests waiting at most; a request arriving to a full queue is dispatched at once (or gets 429 if it would miss its SLO).")
    max_wait_s: float = Field(30.0, gt=0, description="A request waits at most this long, then is dispatched wherever the policy sends it.")
    ttft_slo_s: float | None = Field(
        None, gt=0, description="Global TTFT SLO: a request whose predicted TTFT exceeds its SLO "
        "gets 429 with Retry-After. None: no SLO admission.")
    slo_header: str | None = Field(
        "x-ttft-slo-ms", description="Request header that sets a request's own TTFT SLO in ms "
        "(it can only tighten a configured one); honoured only while admission is active (a queue or a configured SLO); None: ignored.")
    priority_header: str = Field("x-priority", description="Request header naming the request's priority class.")
    priority_field: str | None = Field(
        "priority", description="Body field naming the priority class when it is a string (SGLang's "
        "integer `priority` is left alone and forwarded).")
    classes: dict[str, PriorityClass] = Field(
        default_factory=_default_classes, validate_default=True,
        description="Named priority classes.")
    default_class: str = Field("default", description="Class of a request that names none (or an unknown one).")
    tenants: dict[str, Tenant] = Field(
        default_factory=dict, description="Tenants by name: their API keys (by SHA-256), class, "
        "fair-share weight and SLO. An unlisted key is a tenant of its own, weight 1.")
    retry_after_max_s: int = Field(30, ge=1, description="Cap on the Retry-After of an SLO 429.")
    max_scan: int = Field(64, ge=1, description="Waiting requests re-decided per wake-up, in queue order.")

    @property
    def active(self) -> bool:
        """Anything to do per request: a queue or a configured SLO (the SLO header is honoured
        only then, so a router without either behaves exactly as before)."""
        return (self.queue or self.ttft_slo_s is not None
                or any(c.ttft_slo_s for c in self.classes.values())
                or any(t.ttft_slo_s for t in self.tenants.values()))

    @model_validator(mode="after")
    def _known_classes(self) -> AdmissionConfig:
        if self.default_class not in self.classes:
            raise ValueError(f"default_class {self.default_class!r} is not one of classes")
        for name, tenant in self.tenants.items():
            if tenant.priority is not None and tenant.priority not in self.classes:
                raise ValueError(f"tenants.{name}.priority {tenant.priority!r} is not one of classes")
        return self
