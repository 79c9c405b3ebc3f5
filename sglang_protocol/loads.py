"""The parser of SGLang's load reports: ``/v1/loads`` (and the deprecated ``/get_load`` list).

:func:`parse_loads_json` folds every DP rank's entry into one :class:`ReplicaSignals`; it
raises :class:`SignalParseError` on a body that is not what SGLang serves.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

from .signals import ReplicaSignals, SignalParseError, fold_rank_kv, fold_signal

__all__ = ["parse_loads_json", "parse_rank_loads"]

# /v1/loads per-rank JSON field -> ReplicaSignals field (core section).
_LOADS_TO_FIELD = {
    "num_running_reqs": "num_running_reqs",
    "num_waiting_reqs": "num_queue_reqs",
    "num_used_tokens": "num_used_tokens",
    "max_total_num_tokens": "max_total_num_tokens",
    "token_usage": "token_usage",
    "gen_throughput": "gen_throughput",
    "cache_hit_rate": "cache_hit_rate",
}


def _num(entry: Mapping[str, Any], key: str) -> Optional[float]:
    if key not in entry or entry[key] is None:
        return None
    v = entry[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SignalParseError(f"field {key!r} is not a number: {v!r}")
    try:
        v = float(v)
    except OverflowError:  # an integer beyond float range
        v = math.inf
    if not math.isfinite(v):  # JSON's 1e400 decodes to inf: garbage, not a pool or a count
        raise SignalParseError(f"field {key!r} is not a finite number: {entry[key]!r:.40}")
    return v


def _entry_fields(entry: Any) -> dict[str, float]:
    if not isinstance(entry, Mapping):
        raise SignalParseError(f"load entry is not an object: {entry!r:.80}")
    out: dict[str, float] = {}
    if "num_running_reqs" in entry or "max_total_num_tokens" in entry:
        # /v1/loads shape.
        for key, field in _LOADS_TO_FIELD.items():
            v = _num(entry, key)
            if v is not None:
                out[field] = v
        if "max_total_num_tokens" not in out:
            memory = entry.get("memory")
            if isinstance(memory, Mapping):
                cap = _num(memory, "token_capacity")
                if cap is not None:
                    out["max_total_num_tokens"] = cap
    elif "num_reqs" in entry:
        # /get_load shape: num_reqs = running + waiting; num_tokens = used (+ pending
        # prefill tokens in current SGLang, which then also sends num_pending_tokens).
        num_reqs = _num(entry, "num_reqs")
        waiting = _num(entry, "num_waiting_reqs")
        tokens = _num(entry, "num_tokens")
        pending = _num(entry, "num_pending_tokens")
        if waiting is not None:
            out["num_queue_reqs"] = waiting
            if num_reqs is not None:
                out["num_running_reqs"] = max(0.0, num_reqs - waiting)
        elif num_reqs is not None:
            out["num_running_reqs"] = num_reqs
        if tokens is not None:
            out["num_used_tokens"] = max(0.0, tokens - (pending or 0.0))
    else:
        raise SignalParseError(f"unrecognised load entry keys: {sorted(entry)[:8]}")
    return out


def parse_loads_json(obj: Any) -> ReplicaSignals:
    """Fold a ``/v1/loads`` body (``{"loads": [...]}``), a single per-rank load object, or a
    ``/get_load`` list into one :class:`ReplicaSignals`. ``str``/``bytes`` are JSON-decoded.

    Across DP ranks: counts and pool sizes are summed, throughput summed, cache_hit_rate
    averaged, token_usage is the max reported ratio (SGLang's own "bottleneck" reading),
    or sum(used)/sum(capacity) when no rank reports a ratio (``/get_load``). Several ranks
    also give each rank's KV usage and pool (``rank_kv``), in ``dp_rank`` order.
    """
    if isinstance(obj, (bytes, bytearray, memoryview, str)):
        import orjson

        try:
            obj = orjson.loads(obj)
        except orjson.JSONDecodeError as exc:
            raise SignalParseError(f"not JSON: {exc}") from exc
    if isinstance(obj, Mapping):
        if "loads" in obj:
            entries = obj["loads"]
            if not isinstance(entries, list):
                raise SignalParseError("'loads' is not a list")
        else:
            entries = [obj]
    elif isinstance(obj, list):
        entries = obj
    else:
        raise SignalParseError(f"unexpected load payload type {type(obj).__name__}")
    if not entries:
        raise SignalParseError("load payload has no entries")

    per_field: dict[str, list[float]] = {}
    per_rank: list[tuple[Any, dict[str, float]]] = []
    for i, entry in enumerate(entries):
        fields = _entry_fields(entry)
        per_rank.append((entry.get("dp_rank", i), fields))
        for field, v in fields.items():
            per_field.setdefault(field, []).append(v)
    if not per_field:
        raise SignalParseError("load payload carries no known signal")

    values: dict[str, Any] = {}
    for field, vs in per_field.items():
        if field == "token_usage":
            continue
        values[field] = fold_signal(field, vs)
    used = per_field.get("num_used_tokens")
    cap = per_field.get("max_total_num_tokens")
    if "token_usage" in per_field:
        values["token_usage"] = max(per_field["token_usage"])
    elif used and cap and len(used) == len(cap) and sum(cap) > 0:
        values["token_usage"] = math.fsum(used) / math.fsum(cap)
    if len(per_rank) > 1:
        ranks = [f for _, f in sorted(per_rank, key=_rank_order)]
        values["rank_kv"] = fold_rank_kv([(f.get("token_usage"), f.get("num_used_tokens"),
                                           f.get("max_total_num_tokens")) for f in ranks])
    return ReplicaSignals(**values)


def _rank_order(item: tuple[Any, dict[str, float]]) -> tuple[bool, Any]:
    """Entries by `dp_rank` (an entry without a usable one keeps its place after them)."""
    rank = item[0]
    return (not isinstance(rank, int), rank if isinstance(rank, int) else 0)


def parse_rank_loads(obj: Any) -> dict[int, ReplicaSignals]:
    """A ``/v1/loads`` body (already decoded) per DP rank: ``{dp_rank: signals}``; an entry
    without ``dp_rank`` takes its position. Raises :class:`SignalParseError` like
    :func:`parse_loads_json`."""
    entries = obj.get("loads") if isinstance(obj, Mapping) else obj
    if not isinstance(entries, list):
        raise SignalParseError("'loads' is not a list")
    out: dict[int, ReplicaSignals] = {}
    for i, entry in enumerate(entries):
        rank = entry.get("dp_rank", i) if isinstance(entry, Mapping) else i
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise SignalParseError(f"dp_rank {rank!r} is not a rank")
        out[rank] = parse_loads_json(entry)
    return out
