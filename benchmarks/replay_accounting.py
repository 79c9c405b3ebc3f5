"""Who spent what during one contender's replay of the live sweep (benchmarks/live_sweep.py).

- :func:`cpu_split`: the CPU seconds of the router, each replica and the driver, and the
  seconds each waited for a CPU (the scheduler's run delay), process trees read from /proc.
- :func:`router_split`: the time a kvrouter contender added to each request's time to first
  token, the client's records joined by request id to the router's decision log.
- :func:`cache_prediction`: how well a kvrouter contender's KV index predicted the cached
  tokens the replicas then reported, from its decision log.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

import orjson

from dp_scenarios import cpu_seconds

from kvrouter.loadtest.report import RequestRecord


def _driver_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _tree(pid: int) -> list[int]:
    """`pid` and its live descendants."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_bytes()
            except OSError:
                continue
            kids.setdefault(int(stat[stat.rindex(b")") + 2:].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


def wait_seconds(pid: int, descendants: bool = True) -> float:
    """Seconds the threads of `pid` (and its live descendants) spent runnable but waiting for a
    CPU (the scheduler's run delay, /proc/PID/task/TID/schedstat); 0 where it is not kept."""
    total = 0
    for p in _tree(pid) if descendants else [pid]:
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                total += int(Path(f"/proc/{p}/task/{tid}/schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return total / 1e9


def cpu_split(router_pid: int, replica_pids: list[int], before: dict[str, Any] | None = None) -> dict[str, Any]:
    """CPU seconds (/proc utime + stime, process trees) of the router, each replica and this
    driver process, and the seconds each waited for a CPU (`wait`: the scheduler's run delay);
    given `before` (an earlier call's result), the seconds since. On a shared 2-core box the
    TTFT of one contender also pays for CPU the others' processes take, so each result says
    who spent what during its replay, and who waited."""
    now: dict[str, Any] = {"router": cpu_seconds(router_pid), "replicas": [cpu_seconds(p) for p in replica_pids],
                           "driver": _driver_cpu_seconds(),
                           "wait": {"router": wait_seconds(router_pid),
                                    "replicas": [wait_seconds(p) for p in replica_pids],
                                    # the driver alone: the router and replicas are its children
                                    "driver": wait_seconds(os.getpid(), descendants=False)}}
    if before is None:
        return now

    def since(a: Any, b: Any) -> Any:
        return [round(y - x, 3) for x, y in zip(a, b)] if isinstance(a, list) else round(b - a, 3)

    out = {k: since(before[k], now[k]) for k in ("router", "replicas", "driver")}
    out["wait"] = {k: since(before["wait"][k], now["wait"][k]) for k in ("router", "replicas", "driver")}
    return out


def decision_rows(decisions: Path) -> list[dict[str, Any]] | None:
    """The rows of a kvrouter contender's decision log (JSON lines), read once for both
    :func:`router_split` and :func:`cache_prediction`; None without a log."""
    if not decisions.exists():
        return None
    return [orjson.loads(line) for line in decisions.read_bytes().splitlines()]


def router_split(records: list[RequestRecord], rows: list[dict[str, Any]] | None,
                 time_scale: float) -> dict[str, Any] | None:
    """Where a kvrouter contender's time to first token went, per request joined to its
    decision-log line by request id, in wall ms: `added` is the client's TTFT (its first
    content token) minus the router's own (from its write to the replica to the replica's first
    bytes), i.e. the time the router and the hops through it added, plus any gap between the
    replica's first bytes and the first content token the client counts; `routed` the part
    from the request's handler starting to its write to the replica. None without a decision
    log (`rows` None, see :func:`decision_rows`) or a joined request."""
    if rows is None:
        return None
    lines = {}
    for row in rows:
        if row.get("ttft_s") is not None and row.get("id") is not None:
            lines[row["id"]] = row
    added, routed = [], []
    for r in records:
        row = lines.get(r.request_id) if r.ok and r.ttft_s is not None else None
        if row is not None:
            added.append(r.ttft_s / time_scale * 1000 - row["ttft_s"] * 1000)
            if row.get("routed_s") is not None:
                routed.append(row["routed_s"] * 1000)
    if not added:
        return None
    return {"requests": len(added), "added_ms_p50": round(statistics.median(added), 2),
            "added_ms_mean": round(statistics.fmean(added), 2),
            "routed_ms_p50": round(statistics.median(routed), 2) if routed else None}


def cache_prediction(rows: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The cached tokens the router's KV index predicted against those the replicas reported,
    over the decision log's requests with a report, as shares of the reported prompt tokens:
    `over_predicted` = predicted - reported (the index's cached-token miss). A prediction is
    scaled from the router's prompt-size estimate to the replica's tokens (the two differ until
    the bytes-per-token estimate has its first report). None without a decision log (`rows`
    None, see :func:`decision_rows`) or a report."""
    if rows is None:
        return None
    predicted = reported = prompt = requests = 0.0
    for row in rows:
        told, cached = row.get("reported_prompt_tokens"), row.get("reported_cached")
        if not told or cached is None or row.get("predicted_cached") is None or not row.get("prompt_tokens"):
            continue
        predicted += row["predicted_cached"] * told / row["prompt_tokens"]
        reported += cached
        prompt += told
        requests += 1
    if not prompt:
        return None
    return {"requests": int(requests), "predicted_hit_rate": round(predicted / prompt, 4),
            "reported_hit_rate": round(reported / prompt, 4),
            "over_predicted": round((predicted - reported) / prompt, 4)}
