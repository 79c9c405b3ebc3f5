"""The `discovery:` section of the router config: where replicas come from besides `replicas:`.

Kept apart from `config.py` so the discovery sources and their settings live together; the
models use the same strict base (unknown keys are errors, values frozen).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileDiscoveryConfig(_Strict):
    """A file listing replica URLs, typically a mounted ConfigMap. It is re-read every
    `interval_s` and applied when its content changed (ConfigMap updates arrive as an atomic
    symlink swap, so reading the content is more reliable than watching inotify events)."""

    path: str = Field(..., description="YAML or JSON file: a list of replica URLs, or a mapping with a `replicas:` list.")
    interval_s: float = Field(5.0, gt=0, description="How often the file is re-read.")


class DNSDiscoveryConfig(_Strict):
    """A/AAAA records of a name, typically a Kubernetes headless Service
    (`<svc>.<namespace>.svc.cluster.local`), re-resolved every `interval_s`. Every address
    becomes `<scheme>://<address>:<port>`."""

    name: str = Field(..., min_length=1, description="Host name to resolve, e.g. sglang.inference.svc.cluster.local.")
    port: int = Field(30000, ge=1, le=65535, description="Replica HTTP port (SGLang's --port).")
    scheme: Literal["http", "https"] = Field("http", description="URL scheme of the replicas.")
    family: Literal["any", "ipv4", "ipv6"] = Field("any", description="Which records to use: A, AAAA or both.")
    interval_s: float = Field(5.0, gt=0, description="How often the name is re-resolved.")


class KubernetesDiscoveryConfig(_Strict):
    """EndpointSlices of a Service (label `kubernetes.io/service-name=<service>`), listed and
    then watched through the Kubernetes API with the pod's service-account token. Only
    endpoints whose `conditions.ready` is not false are used, so a terminating or unready pod
    stops getting new work at once while its in-flight requests finish."""

    service: str = Field(..., min_length=1, description="Name of the Service whose EndpointSlices are watched "
                         "(with `decode_service`: the prefill servers).")
    decode_service: str | None = Field(
        None, min_length=1, description="A disaggregated fleet's decode Service: its endpoints become decode "
        "servers (needs disaggregation.from_discovery). Both Services are watched in one list/watch.",
    )
    bootstrap_port_name: str = Field(
        "bootstrap", min_length=1, description="Name of the EndpointSlice port that is a prefill server's "
        "SGLang bootstrap port (--disaggregation-bootstrap-port); never taken as the HTTP port. Without it: 8998.",
    )
    namespace: str | None = Field(
        None, description="Namespace of the Service; default: the pod's own (service-account `namespace` file)."
    )
    port_name: str | None = Field(
        None, description="Name of the EndpointSlice port to use (e.g. `http`); default: the slice's first port."
    )
    port: int | None = Field(
        None, ge=1, le=65535, description="Use this port instead of the EndpointSlice's ports."
    )
    scheme: Literal["http", "https"] = Field("http", description="URL scheme of the replicas.")
    api_server: str | None = Field(
        None, description="API server base URL; default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT (in-cluster).",
    )
    service_account_dir: str = Field(
        SERVICE_ACCOUNT_DIR, description="Directory holding the service-account `token`, `ca.crt` and `namespace`."
    )
    watch_timeout_s: int = Field(
        300, ge=1, description="`timeoutSeconds` of one watch request; the watch is then resumed from the last resourceVersion."
    )
    retry_interval_s: float = Field(2.0, gt=0, description="Wait after an API error before retrying.")


class DiscoveryConfig(_Strict):
    """Replica sources besides the static `replicas:` list; several may be combined (the fleet
    is the union). A replica that appears is added as *fresh* (the scale-out rule steers new
    sessions to it); one that disappears is drained: it gets no new requests, and requests
    already running on it finish. A source that fails keeps its last known set."""

    file: FileDiscoveryConfig | None = Field(None, description="Watched file of replica URLs (e.g. a mounted ConfigMap).")
    dns: DNSDiscoveryConfig | None = Field(None, description="DNS A/AAAA records of a headless Service.")
    kubernetes: KubernetesDiscoveryConfig | None = Field(None, description="Kubernetes EndpointSlice list+watch.")

    @property
    def enabled(self) -> bool:
        return any(s is not None for s in (self.file, self.dns, self.kubernetes))

    @model_validator(mode="after")
    def _sane(self) -> "DiscoveryConfig":
        k = self.kubernetes
        if k is not None and k.api_server is not None and not k.api_server.startswith(("http://", "https://")):
            raise ValueError(f"kubernetes.api_server {k.api_server!r} must be an http(s):// URL")
        if k is not None and k.decode_service == k.service:
            raise ValueError("kubernetes.decode_service must differ from kubernetes.service")
        return self
