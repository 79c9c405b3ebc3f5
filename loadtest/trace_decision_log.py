"""The router's decision log (router/decision_log.py) as a trace: production traffic replayed as a
frozen benchmark by ``kvrouter simulate --trace`` and ``kvrouter loadtest --trace``.

The log has no prompt text; what it has is enough to rebuild the workload's shape:
- sessions: requests with the same ``session`` hash form one session, in time order; a request
  without one is a one-request session. A session's first request arrives at its logged time
  (from the log's first line); each later one starts the logged gap after the previous one ended
  (``t`` minus the previous ``t + duration_s``: a closed loop, as the client ran it).
- prompt size: the replica's ``reported_prompt_tokens``, else the router's estimate; output size:
  ``output_tokens``, else ``DEFAULT_OUTPUT_TOKENS``.
- prefix sharing: the prompt is ``blocks`` blocks (one size for the whole log: a low percentile of
  prompt tokens per block, rounded down) plus a tail. ``prefix`` holds short hashes of the router's chained block hashes
  at positions 0, 1, 3, 7, ... and at the last block. Block ``j`` is keyed by the hash at the first
  of those positions at or past ``j``: requests with equal hashes there share every block up to it
  (the hashes are chained), across sessions too. Within a session a request that agrees with the
  previous one at all their common positions is taken to extend it (coding agents append to their
  context) and reuses that request's keys for all of its blocks; otherwise it shares up to the
  last position where they agree.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from .trace_session import Arrivals, PathLike, TraceSession, TraceStep
from .turn_request import Segment

__all__ = ["DECISION_LOG_FORMAT", "DEFAULT_OUTPUT_TOKENS", "LoggedRequest", "decision_log_arrivals",
           "is_decision_log", "logged_request", "read_log", "shared_blocks"]

DECISION_LOG_FORMAT = "kvrouter-decision-log/1"  # router/decision_log.py's LOG_FORMAT
DEFAULT_OUTPUT_TOKENS = 256  # a line without reported output tokens (e.g. a failed request)


def is_decision_log(first_line: Any) -> bool:
    return isinstance(first_line, dict) and first_line.get("format") == DECISION_LOG_FORMAT


@dataclass
class LoggedRequest:
    """What replay and profiling use of one logged request."""

    t: float
    duration_s: float
    prompt: int
    out: int
    blocks: int
    marks: list[str]


def read_log(path: Path) -> list[dict[str, Any]]:
    """The request lines of a decision log (format lines checked and skipped)."""
    rows = []
    with path.open("rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({exc})") from None
            if "format" in row:  # a rotated file's header (several files concatenated)
                if not is_decision_log(row):
                    raise ValueError(f"{path}:{lineno}: unknown log format {row['format']!r}")
                continue
            rows.append(row)
    return rows


def logged_request(row: dict[str, Any]) -> LoggedRequest:
    prompt = row.get("reported_prompt_tokens") or row["prompt_tokens"]
    out = row.get("output_tokens") or DEFAULT_OUTPUT_TOKENS
    return LoggedRequest(float(row["t"]), float(row.get("duration_s") or 0.0), int(prompt), int(out),
                    int(row.get("blocks") or 0), list(row.get("prefix") or []))


def _mark_of(marks: list[str], n: int, j: int) -> str:
    """The hash at the first mark position (2^k - 1, or the last block) at or past block `j`."""
    k = j.bit_length()
    return marks[k] if (1 << k) - 1 < n and k < len(marks) else marks[-1]


def shared_blocks(a: LoggedRequest, b: LoggedRequest) -> tuple[int, bool]:
    """Blocks `b` shares with `a` by their power-of-two marks (2^k when they agree up to mark k),
    and whether they agree at every common one (then `b` may extend `a`)."""
    shared, k = 0, 0
    while (1 << k) - 1 < min(a.blocks, b.blocks) and k < len(a.marks) and k < len(b.marks):
        if a.marks[k] != b.marks[k]:
            return shared, False
        shared = 1 << k  # blocks 0 .. 2^k - 1
        k += 1
    return shared, True


def decision_log_arrivals(
    path: PathLike,
    *,
    speedup: float = 1.0,
    limit: int | None = None,
    max_context_tokens: int | None = None,
) -> Arrivals:
    """Sessions of a decision log (the first `limit` lines), arriving `speedup` times faster than
    logged. Requests whose prompt + output exceed `max_context_tokens` are left out."""
    if speedup <= 0:
        raise ValueError("speedup must be > 0")
    path = Path(path)
    rows = read_log(path)[:limit] if limit is not None else read_log(path)
    try:
        requests = [(row.get("session") or f"r{i}", logged_request(row)) for i, row in enumerate(rows)]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not a decision-log line ({exc!r})") from None
    requests = [(s, r) for s, r in requests if r.prompt > 0 and
                (max_context_tokens is None or r.prompt + r.out <= max_context_tokens)]
    if not requests:
        return []
    # A prompt is its blocks plus a tail under one block, so prompt / blocks is a little above the
    # block size: a low percentile, rounded down, keeps every request's blocks whole.
    per_block = sorted(r.prompt / r.blocks for _, r in requests if r.blocks)
    block_tokens = max(1, math.floor(per_block[len(per_block) // 10])) if per_block else 64
    t0 = min(r.t for _, r in requests)
    sessions: dict[str, list[LoggedRequest]] = defaultdict(list)
    for key, r in requests:
        sessions[key].append(r)
    segments: dict[tuple[str, int], Segment] = {}
    out: Arrivals = []
    for key, reqs in sessions.items():
        reqs.sort(key=lambda r: r.t)
        steps, prev_keys, prev = [], [], None
        for i, r in enumerate(reqs):
            n = min(r.blocks, r.prompt // block_tokens) if r.marks else 0
            keys = [f"dl/{_mark_of(r.marks, r.blocks, j)}/{j}" for j in range(n)]
            if prev is not None and prev_keys:
                shared, agrees = shared_blocks(prev, r)
                if agrees and r.blocks >= prev.blocks:
                    shared = len(prev_keys)
                shared = min(shared, len(prev_keys), n)
                keys[:shared] = prev_keys[:shared]
            segs = []
            for k in keys:
                seg = segments.get((k, block_tokens))
                if seg is None:
                    seg = segments[(k, block_tokens)] = Segment("user", block_tokens, k)
                segs.append(seg)
            tail = r.prompt - n * block_tokens
            if tail > 0:
                segs.append(Segment("user", tail, f"dl-tail/{key}/{i}"))
            think = 0.0 if prev is None else max(0.0, r.t - (prev.t + prev.duration_s))
            steps.append(TraceStep((r.t - reqs[0].t) / speedup, think / speedup, tuple(segs), max(1, r.out), n))
            prev, prev_keys = r, keys
        out.append(((reqs[0].t - t0) / speedup, TraceSession(f"dl-{key}", steps)))
    out.sort(key=lambda a: (a[0], a[1].session_id))
    return out
