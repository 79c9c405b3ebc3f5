"""Pure aggregation of per-request measurements into the shared results contract.

Used by the HTTP load driver and by the cluster simulator, so both report the same numbers the
same way. All times are model-time seconds. The contract (schema 1)::

    {"schema": 1, "workload": {...}, "results": {"<contender>": {
        "requests_ok", "requests_failed", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "itl_p50_s",
        "output_tps_per_user", "tokens_per_min_per_replica", "cache_hit_rate", "e2e_p95_s",
        "load_max_over_mean", "load_cv", "sessions_per_replica": [...],
        "failures": [{"status", "message", "count"}, ...]}}}

A value with no data behind it (no successful request, no load sample) is ``None`` (JSON null).
Definitions:
- latency percentiles: linear interpolation between closest ranks, over successful requests;
- ``itl_p50_s``: median over requests of each request's mean inter-token latency;
- ``output_tps_per_user``: median over requests of ``completion_tokens / (e2e - ttft)``;
- ``tokens_per_min_per_replica``: (prompt + completion tokens of successful requests) per
  model-time minute of the run, divided by the number of replicas;
- ``cache_hit_rate``: sum of cached prompt tokens / sum of prompt tokens (successful requests);
- ``load_max_over_mean`` / ``load_cv``: per load sample (running requests of every replica),
  max/mean and population std/mean, averaged over the samples whose mean is > 0;
- ``sessions_per_replica``: distinct sessions that sent at least one request to each replica,
  ordered by replica name; empty when replicas were not reported;
- ``failures``: failed requests grouped by reason: the HTTP status (or the SSE error event's code;
  null for a failure without one) and the error message with its numbers and ids replaced by
  ``N``, most frequent first.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "SCHEMA_VERSION",
    "RESULT_KEYS",
    "RequestRecord",
    "percentile",
    "load_imbalance",
    "summarize_requests",
    "failure_reason",
    "build_report",
]

SCHEMA_VERSION = 1
RESULT_KEYS = (
    "requests_ok",
    "requests_failed",
    "ttft_p50_s",
    "ttft_p95_s",
    "ttft_p99_s",
    "itl_p50_s",
    "output_tps_per_user",
    "tokens_per_min_per_replica",
    "cache_hit_rate",
    "e2e_p95_s",
    "load_max_over_mean",
    "load_cv",
    "sessions_per_replica",
    "failures",
)


@dataclass(slots=True)
class RequestRecord:
    """One request as measured by a client (times in model-time seconds)."""

    session_id: str
    ok: bool
    start_s: float = 0.0  # since the start of the run
    ttft_s: float | None = None  # request sent -> first content token
    e2e_s: float | None = None  # request sent -> stream finished
    itl_s: float | None = None  # mean inter-token latency of this request
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    replica: str | None = None
    error: str | None = None
    turn_index: int = 0
    branch_index: int = 0
    is_edit: bool = False
    reason: str | None = None  # the routing rule that placed it (simulator only)
    predicted_cached_tokens: int = 0  # the router's KV-index estimate there (simulator only)
    request_id: str | None = None  # the answer's x-request-id header, if any (joins a router's decision log)


def percentile(values: Iterable[float], q: float) -> float | None:
    """``q`` in [0, 100]; linear interpolation between closest ranks (numpy's default)."""
    s = sorted(values)
    if not s:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside [0, 100]")
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def load_imbalance(samples: Iterable[Sequence[float]]) -> tuple[float | None, float | None]:
    """Mean over samples (mean > 0) of max/mean and of the coefficient of variation."""
    ratios: list[float] = []
    cvs: list[float] = []
    for sample in samples:
        if not sample:
            continue
        mean = statistics.fmean(sample)
        if mean <= 0:
            continue
        ratios.append(max(sample) / mean)
        cvs.append(statistics.pstdev(sample) / mean)
    if not ratios:
        return None, None
    return statistics.fmean(ratios), statistics.fmean(cvs)


_HTTP = re.compile(r"HTTP (\d{3}): ?(.*)", re.S)
_MESSAGE = re.compile(r"""["']message["']\s*:\s*(?:"((?:[^"\\]|\\.)*)"|'((?:[^'\\]|\\.)*)')""", re.S)
_CUT_MESSAGE = re.compile(r"""["']message["']\s*:\s*["'](.*)""", re.S)  # body cut short by the driver
_CODE = re.compile(r"""["']code["']\s*:\s*(\d{3})\b""")
_NUMBER = re.compile(r"[\w.,-]*\d[\w.,-]*")  # numbers and ids (request ids, addresses)


def failure_reason(error: str | None) -> tuple[int | None, str]:
    """``(status, message)`` of a failed request's error text, as the load driver writes it:
    ``HTTP <status>: <body>``, ``SSE error: <error object>``, or a client-side description.
    Numbers and words with digits (request ids, addresses) become ``N``: one cause, one group."""
    text = (error or "unknown").strip()
    status: int | None = None
    http = _HTTP.match(text)
    if http:
        status, text = int(http.group(1)), http.group(2)
    message = _MESSAGE.search(text) or _CUT_MESSAGE.search(text)
    if status is None:
        code = _CODE.search(text)
        status = int(code.group(1)) if code else None
    if message:
        text = next(g for g in message.groups() if g is not None)
    elif text.startswith("SSE error:"):
        text = text[len("SSE error:"):].strip()
    text = " ".join(text.split())[:160] or "(empty body)"
    return status, _NUMBER.sub("N", text)


def group_failures(records: Iterable[RequestRecord]) -> list[dict[str, Any]]:
    counts = Counter(failure_reason(r.error) for r in records if not r.ok)
    return [{"status": status, "message": message, "count": n}
            for (status, message), n in sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))]


def summarize_requests(
    records: Sequence[RequestRecord],
    replicas: int,
    duration_model_s: float,
    load_samples: Iterable[Sequence[float]] = (),
) -> dict[str, Any]:
    """One contender's results dict (keys: :data:`RESULT_KEYS`)."""
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    itl = [r.itl_s for r in ok if r.itl_s is not None]
    tps = [
        r.completion_tokens / (r.e2e_s - r.ttft_s)
        for r in ok
        if r.e2e_s is not None and r.ttft_s is not None and r.e2e_s > r.ttft_s and r.completion_tokens > 0
    ]
    prompt = sum(r.prompt_tokens for r in ok)
    tokens = prompt + sum(r.completion_tokens for r in ok)
    minutes = duration_model_s / 60.0
    max_over_mean, cv = load_imbalance(load_samples)
    per_replica: dict[str, set[str]] = {}
    for r in records:
        if r.replica is not None:
            per_replica.setdefault(r.replica, set()).add(r.session_id)
    return {
        "requests_ok": len(ok),
        "requests_failed": len(records) - len(ok),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50),
        "output_tps_per_user": percentile(tps, 50),
        "tokens_per_min_per_replica": tokens / minutes / replicas if minutes > 0 else None,
        "cache_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt > 0 else None,
        "e2e_p95_s": percentile(e2e, 95),
        "load_max_over_mean": max_over_mean,
        "load_cv": cv,
        "sessions_per_replica": [len(per_replica[k]) for k in sorted(per_replica)],
        "failures": group_failures(records),
    }


def build_report(workload: Mapping[str, Any], results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The full contract: ``{"schema": 1, "workload": ..., "results": {contender: ...}}``."""
    return {"schema": SCHEMA_VERSION, "workload": dict(workload), "results": {k: dict(v) for k, v in results.items()}}
