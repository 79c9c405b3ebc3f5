"""Trace replay: Mooncake and Claude Code (kv-cache-tester) traces, and the router's own decision
log, as workload sessions.

A trace becomes ``[(start_s, session), ...]`` for ``ClusterSimulator(..., arrivals=...)`` (open loop
across sessions, closed loop within each) or for the live driver. :func:`trace_sessions` picks the
reader by format: :mod:`kvrouter.loadtest.trace_mooncake` or
:mod:`kvrouter.loadtest.trace_claude_code`; sessions are
:class:`kvrouter.loadtest.trace_session.TraceSession` objects, and
:mod:`kvrouter.loadtest.trace_stats` measures a trace.

Prompts come from the trace's block hash ids, one :class:`Segment` per block, so equal ids give
equal segment keys, equal text (rendered lazily by ``synthetic_text``) and equal page keys
(``segment_keys.SegmentKeyCache``): the trace's prefix sharing becomes real cache sharing, both in
the simulator and on a live server. One segment per block keeps page keys exact for any page size
(a page's key depends only on the blocks before it and the block it lies in).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from .trace_claude_code import claude_code_arrivals
from .trace_decision_log import decision_log_arrivals, is_decision_log
from .trace_mooncake import mooncake_arrivals
from .trace_session import Arrivals, PathLike

__all__ = [
    "DATA_DIR",
    "trace_sessions",
    "bundled_traces",
    "bundled_claude_code_traces",
    "bundled_mooncake_trace",
]

DATA_DIR = Path(__file__).with_name("data") / "traces"


def bundled_claude_code_traces() -> list[Path]:
    """The bundled Claude Code sample sessions (kv-cache-tester format), sorted."""
    return sorted(DATA_DIR.glob("trace_*.json"))


def bundled_mooncake_trace() -> Path:
    """The bundled Mooncake sample (first 300 lines of the synthetic trace)."""
    return DATA_DIR / "mooncake_synthetic_trace_head300.jsonl"


def bundled_traces() -> dict[str, list[Path]]:
    """Bundled samples by name (also accepted by :func:`trace_sessions` in place of a path)."""
    return {
        "claude-code-sample": bundled_claude_code_traces(),
        "mooncake-sample": [bundled_mooncake_trace()],
    }


def trace_sessions(path: PathLike, **kw: Any) -> Arrivals:
    """Arrivals of any supported trace, by format: a ``.jsonl`` of ``timestamp`` + ``hash_ids``
    lines (Mooncake, see :func:`mooncake_arrivals`), a router decision log (any file whose
    first line names its format, see :func:`decision_log_arrivals`), a ``.json`` with
    ``requests`` (kv-cache-tester, see :func:`claude_code_arrivals`; also gzipped, ``.json.gz``), a directory (its
    ``trace_*.json`` and ``trace_*.json.gz``), or a bundled sample name
    (:func:`bundled_traces`). ``kw`` goes to the format's function."""
    p = Path(path)
    if not p.exists() and str(path) in bundled_traces():
        files = bundled_traces()[str(path)]
        if str(path).startswith("mooncake"):
            return mooncake_arrivals(files[0], **kw)
        return claude_code_arrivals(files, **kw)
    if p.is_dir():
        return claude_code_arrivals(p, **kw)
    if not p.is_file():
        raise FileNotFoundError(f"no such trace: {p} (bundled: {', '.join(bundled_traces())})")
    with p.open("rb") as fh:
        first = next((line for line in fh if line.strip()), b"")
    if first.startswith(b'{"format"') and is_decision_log(orjson.loads(first)):
        return decision_log_arrivals(p, **kw)  # any file name: rotated logs end in .1, .2, ...
    if p.suffix == ".jsonl":
        row = orjson.loads(first) if first else None
        if isinstance(row, dict) and "hash_ids" in row and "timestamp" in row:
            return mooncake_arrivals(p, **kw)
        raise ValueError(f"{p}: unknown .jsonl trace format (want Mooncake lines with timestamp, "
                         "hash_ids, or a kvrouter decision log)")
    if p.suffix == ".json" or p.name.endswith(".json.gz"):
        return claude_code_arrivals([p], **kw)
    raise ValueError(
        f"{p}: unknown trace format (want .jsonl Mooncake, .json or .json.gz kv-cache-tester, or a directory)"
    )
