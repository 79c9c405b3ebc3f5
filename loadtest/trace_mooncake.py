"""Mooncake traces (JSONL) as one-request sessions.

Each line is ``{"timestamp" ms, "input_length", "output_length", "hash_ids"}``, with 512-token
blocks and global prefix-chained ids; it becomes a one-request session arriving at
``timestamp / 1000 / speedup``. Block ``h`` is one :class:`Segment` keyed ``mc/<h>``, so equal ids
give equal page keys. The last block is partial when the input is not a multiple of 512; it keeps
its id (its text is a prefix of the full block's text, and its whole pages match the full block's
first pages, as the id says they should).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson

from .trace_session import Arrivals, PathLike, TraceSession, TraceStep
from .turn_request import Segment

__all__ = ["MOONCAKE_BLOCK_SIZE", "mooncake_arrivals"]

MOONCAKE_BLOCK_SIZE = 512


def _read_jsonl(path: Path, limit: int | None) -> list[tuple[int, dict[str, Any]]]:
    rows = []
    with path.open("rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and len(rows) >= limit:
                break
            if line.strip():
                rows.append((lineno, orjson.loads(line)))
    return rows


def mooncake_arrivals(
    path: PathLike,
    *,
    speedup: float = 1.0,
    limit: int | None = None,
    max_context_tokens: int | None = None,
) -> Arrivals:
    """One one-request session per line (the first ``limit`` lines), arriving at
    ``timestamp / 1000 / speedup`` seconds. Lines whose input + output exceed
    ``max_context_tokens`` are skipped."""
    if speedup <= 0:
        raise ValueError("speedup must be > 0")
    path = Path(path)
    blocks: dict[tuple[int, int], Segment] = {}
    out: Arrivals = []
    for lineno, row in _read_jsonl(path, limit):
        try:
            ts, n_in, n_out = float(row["timestamp"]), int(row["input_length"]), int(row["output_length"])
            ids = row["hash_ids"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{lineno}: not a Mooncake trace line ({exc})") from None
        if len(ids) != math.ceil(n_in / MOONCAKE_BLOCK_SIZE):
            raise ValueError(f"{path}:{lineno}: {len(ids)} hash_ids for input_length {n_in}")
        if max_context_tokens is not None and n_in + n_out > max_context_tokens:
            continue
        segs = []
        for j, h in enumerate(ids):
            size = min(MOONCAKE_BLOCK_SIZE, n_in - j * MOONCAKE_BLOCK_SIZE)
            seg = blocks.get((h, size))
            if seg is None:
                seg = blocks[(h, size)] = Segment("user", size, f"mc/{h}")
            segs.append(seg)
        session = TraceSession(
            f"mc-{lineno:06d}", [TraceStep(0.0, 0.0, tuple(segs), max(1, n_out), len(segs))]
        )
        out.append((ts / 1000.0 / speedup, session))
    out.sort(key=lambda a: a[0])
    return out
