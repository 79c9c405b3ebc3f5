"""Trace replay: Mooncake and Claude Code (kv-cache-tester) traces as workload sessions.

A trace becomes ``[(start_s, session), ...]`` for ``ClusterSimulator(..., arrivals=...)`` (open loop
across sessions, closed loop within each) or for the live driver. Sessions follow the
:class:`kvrouter.loadtest.workload.Session` protocol (``session_id``, ``n_turns``,
``next_requests(replies)``, ``reply_segment(req, reply)``), one request per turn.

Prompts come from the trace's block hash ids, one :class:`Segment` per block, so equal ids give
equal segment keys, equal text (rendered lazily by ``synthetic_text``) and equal page keys
(``segment_keys.SegmentKeyCache``): the trace's prefix sharing becomes real cache sharing, both in
the simulator and on a live server. One segment per block keeps page keys exact for any page size
(a page's key depends only on the blocks before it and the block it lies in).

Mooncake (``{"timestamp" ms, "input_length", "output_length", "hash_ids"}`` per line, 512-token
blocks, global prefix-chained ids): each line is a one-request session arriving at
``timestamp / 1000 / speedup``; block ``h`` is keyed ``mc/<h>``. The last block is partial when the
input is not a multiple of 512; it keeps its id (its text is a prefix of the full block's text, and
its whole pages match the full block's first pages, as the id says they should).

Claude Code, kv-cache-tester format (one session per file, 64-token blocks, ids local to the file):
- block ``h`` is keyed ``<trace id>/<h>``, except the blocks of the system prompt + tool definitions,
  the first ``(tool_tokens + system_tokens) // 64`` blocks, which real deployments share across
  sessions: along the session's canonical system prefix (the most frequent first-``k``-blocks
  sequence among its requests; a few requests, e.g. side calls with another system prompt, diverge
  from it early) they are keyed ``cc-system/<block index>``, one key space for every session (so two
  sessions share ``min(k1, k2)`` system blocks: the upper end of cross-session sharing, as for one
  client version). Sub-agents use ``cc-system/<subagent_type>/<block index>``.
- ``floor(in / 64)`` blocks have ids; the remaining ``in % 64`` tokens are a segment of their own,
  keyed per request (never matches anything; never a whole page of its own prompt anyway).
- closed loop: request ``i > 0`` starts its trace ``think_time`` after request ``i - 1`` finished;
  the output length is ``out`` (``max_tokens`` too).
- ``{"type": "subagent", "t", "requests": [...]}`` entries (a concurrent branch with its own prefix)
  become separate sessions (``<trace id>/<agent_id>``) arriving at the parent's start + ``t``: an open
  loop offset, so in a replay slower than the original they start "early" relative to their parent
  (the parent's next request still waits its own think time, which in the trace covers the
  sub-agent's run). Their ids share the parent's local id space, so sub-agents of one parent share
  their common prefix.
- top-level sessions start staggered: the ``k``-th (file order, then copy) at ``k * stagger_s``.

Replies: a trace's next prompt is its own ``hash_ids`` (which already contain the previous output as
new blocks), so replies are ignored when building the next request. ``reply_segment`` still returns
a segment (``<session id>/r<turn>/reply``) for the simulator to insert output pages; that key is
unique, so cached output never matches the next prompt (the trace's own accounting gives the output
fresh block ids too). This under-counts real output caching by about the output share of prompt
tokens (out / in, ~0.1-0.5% on the Claude Code traces).

:func:`reuse_bound` gives the trace's own hit-rate bound with an infinite cache, on the same page
keys, to compare each policy's ``cache_hit_rate`` against.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import orjson

from .segment_keys import SegmentKeyCache
from .workload import ReplyLike, Segment, TurnRequest, _quantile, reply_as_segment

__all__ = [
    "DATA_DIR",
    "TraceTurnRequest",
    "TraceSession",
    "mooncake_arrivals",
    "claude_code_arrivals",
    "trace_sessions",
    "reuse_bound",
    "trace_summary",
    "bundled_traces",
    "bundled_claude_code_traces",
    "bundled_mooncake_trace",
]

DATA_DIR = Path(__file__).with_name("data") / "traces"
MOONCAKE_BLOCK_SIZE = 512
CC_BLOCK_SIZE = 64
CC_SYSTEM_NAMESPACE = "cc-system"

PathLike = Union[str, Path]
Arrivals = list[tuple[float, "TraceSession"]]


# --------------------------------------------------------------------------------------
# Bundled samples
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# Sessions
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceTurnRequest(TurnRequest):
    """A trace request. ``messages`` merges runs of same-role segments into one message (a prompt
    is thousands of block segments); the merged text still extends the previous request's text, so
    a live server's prefix cache sees the same sharing."""

    @property
    def messages(self) -> list[dict[str, str]]:
        out: list[dict[str, str]] = []
        run: list[str] = []
        role = None
        for seg in self.segments:
            if seg.role != role and run:
                out.append({"role": role, "content": "".join(run)})  # type: ignore[dict-item]
                run = []
            role = seg.role
            run.append(seg.text())
        if run:
            out.append({"role": role, "content": "".join(run)})  # type: ignore[dict-item]
        return out


@dataclass(slots=True)
class _Step:
    offset_s: float  # nominal start from the session's start, by the trace's own clock
    think_s: float  # closed-loop pause after the previous request finished
    segments: tuple[Segment, ...]
    out: int
    n_blocks: int  # leading segments that are whole blocks (the rest: a partial tail)


class TraceSession:
    """One replayed session: ``next_requests`` returns the trace's requests one at a time."""

    def __init__(self, session_id: str, steps: Sequence[_Step], *, source: str = "") -> None:
        self.session_id = session_id
        self.source = source
        self._steps = list(steps)
        self.n_turns = len(self._steps)
        self.turn = 0
        self.done = False
        self._pending: TraceTurnRequest | None = None

    def next_requests(self, replies: Sequence[ReplyLike] | None = None) -> list[TurnRequest]:
        if self._pending is not None:
            if replies is None or len(replies) != 1:
                raise ValueError(
                    f"session {self.session_id}: expected 1 reply, "
                    f"got {None if replies is None else len(replies)}"
                )
            self._pending = None
        elif replies:
            raise ValueError(f"session {self.session_id}: replies given but no requests outstanding")
        if self.done or self.turn >= self.n_turns:
            self.done = True
            return []
        req = self._request(self.turn)
        self.turn += 1
        self._pending = req
        return [req]

    def reply_segment(self, req: TurnRequest, reply: ReplyLike) -> Segment:
        """The output as a segment; unique key, so it never matches a later prompt (see module doc)."""
        return reply_as_segment(f"{self.session_id}/r{req.turn_index}/reply", req, reply)

    def planned(self) -> list[tuple[float, TurnRequest]]:
        """Every request with its nominal start offset (trace clock); does not advance the session."""
        return [(self._steps[i].offset_s, self._request(i)) for i in range(self.n_turns)]

    def _request(self, i: int) -> TraceTurnRequest:
        step = self._steps[i]
        segs = step.segments
        prompt = sum(s.tokens for s in segs)
        reused, compacted = 0, False
        if i > 0:
            prev = self._steps[i - 1].segments
            n = 0
            for a, b in zip(segs, prev):
                if a is not b:
                    break
                reused += a.tokens
                n += 1
            compacted = n < self._steps[i - 1].n_blocks  # a prefix break (compaction, side call)
        return TraceTurnRequest(
            session_id=self.session_id,
            turn_index=i,
            branch_index=0,
            n_branches=1,
            segments=segs,
            max_tokens=step.out,
            expected_output_tokens=step.out,
            think_time_s=step.think_s if i > 0 else 0.0,
            is_edit=False,
            edit_message_index=None,
            compacted=compacted,
            new_tokens=prompt - reused,
            reused_tokens=reused,
        )

    def __repr__(self) -> str:
        return f"TraceSession({self.session_id!r}, n_turns={self.n_turns})"


# --------------------------------------------------------------------------------------
# Mooncake
# --------------------------------------------------------------------------------------


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
            f"mc-{lineno:06d}", [_Step(0.0, 0.0, tuple(segs), max(1, n_out), len(segs))], source=str(path)
        )
        out.append((ts / 1000.0 / speedup, session))
    out.sort(key=lambda a: a[0])
    return out


# --------------------------------------------------------------------------------------
# Claude Code (kv-cache-tester)
# --------------------------------------------------------------------------------------


def _is_sub(r: dict[str, Any]) -> bool:
    return r.get("type") == "subagent"


@dataclass
class _Branch:
    """A request list of one file: the parent session or one sub-agent."""

    name: str  # agent id, or "" for the parent
    namespace: str  # shared key space of its system blocks
    k: int  # system + tool blocks
    t: float  # start offset from the parent's first request (trace clock)
    requests: list[dict[str, Any]]


def _branches(data: dict[str, Any], block_size: int) -> list[_Branch]:
    out: list[_Branch] = []

    def walk(
        entries: list[dict[str, Any]], name: str, namespace: str, k: int, start: float, t0: float
    ) -> None:
        reqs = [r for r in entries if not _is_sub(r)]
        out.append(_Branch(name, namespace, k, start, reqs))
        for n, sub in enumerate(r for r in entries if _is_sub(r)):
            sub_k = (int(sub.get("tool_tokens") or 0) + int(sub.get("system_tokens") or 0)) // block_size
            kind = str(sub.get("subagent_type") or "subagent")
            sub_name = str(sub.get("agent_id") or f"{name or 'sub'}-{n}")
            nested = sub.get("requests") or []
            sub_t0 = float(nested[0].get("t", 0.0)) if nested else 0.0
            walk(nested, sub_name, f"{CC_SYSTEM_NAMESPACE}/{kind}", sub_k,
                 start + float(sub.get("t", 0.0)) - t0, sub_t0)

    entries = data.get("requests") or []
    first = next((r for r in entries if not _is_sub(r)), None)
    t0 = float(first.get("t", 0.0)) if first else 0.0
    k = (int(data.get("tool_tokens") or 0) + int(data.get("system_tokens") or 0)) // block_size
    walk(entries, "", CC_SYSTEM_NAMESPACE, k, 0.0, t0)
    return out


def _shared_keys(branches: list[_Branch]) -> dict[int, tuple[str, int]]:
    """Local id -> (namespace, block index) for the blocks of each branch's canonical system prefix:
    per namespace, the most frequent first-``k``-blocks sequence (ties: the earliest). First come
    wins, so every id has one key."""
    groups: dict[str, list[_Branch]] = {}
    for b in branches:
        groups.setdefault(b.namespace, []).append(b)
    mapping: dict[int, tuple[str, int]] = {}
    for namespace, members in groups.items():
        k = Counter(b.k for b in members).most_common(1)[0][0]
        if k <= 0:
            continue
        prefixes = Counter(tuple(r["hash_ids"][:k]) for b in members for r in b.requests)
        if not prefixes:
            continue
        canonical = prefixes.most_common(1)[0][0]
        for j, h in enumerate(canonical):
            mapping.setdefault(h, (namespace, j))
    return mapping


def _cc_file_sessions(
    data: dict[str, Any],
    trace_id: str,
    source: str,
    *,
    max_requests: int | None,
    max_context_tokens: int | None,
    shared: dict[str, Segment],
) -> list[tuple[float, TraceSession]]:
    """Sessions of one file, with offsets from the parent's start (parent first)."""
    block_size = int(data.get("block_size") or CC_BLOCK_SIZE)
    branches = _branches(data, block_size)
    system = _shared_keys(branches)
    local: dict[int, Segment] = {}

    def block(h: int) -> Segment:
        seg = local.get(h)
        if seg is None:
            hit = system.get(h)
            if hit is None:
                seg = Segment("user", block_size, f"{trace_id}/{h}")
            else:
                key = f"{hit[0]}/{hit[1]}"
                seg = shared.get(key)
                if seg is None:
                    seg = shared[key] = Segment("system", block_size, key, shared=True)
            local[h] = seg
        return seg

    out: list[tuple[float, TraceSession]] = []
    parent_end: float | None = None
    for branch in branches:
        session_id = f"{trace_id}/{branch.name}" if branch.name else trace_id
        if branch.name and parent_end is not None and branch.t > parent_end:
            continue  # spawned after the parent's truncation point
        t0 = float(branch.requests[0].get("t", 0.0)) if branch.requests else 0.0
        steps: list[_Step] = []
        carry = 0.0  # think + service time of dropped requests, added to the next kept one
        for r in branch.requests:
            if max_requests is not None and len(steps) >= max_requests:
                break
            n_in, n_out = int(r["in"]), int(r.get("out") or 0)
            ids = r["hash_ids"]
            if len(ids) != n_in // block_size:
                raise ValueError(f"{source}: {session_id}: {len(ids)} hash_ids for in={n_in}")
            think = float(r.get("think_time") or 0.0)
            if max_context_tokens is not None and n_in + n_out > max_context_tokens:
                carry += think + float(r.get("api_time") or 0.0)
                continue
            segs = [block(h) for h in ids]
            tail = n_in - len(ids) * block_size
            if tail > 0:
                segs.append(Segment("user", tail, f"{session_id}/r{len(steps)}/tail"))
            steps.append(
                _Step(float(r.get("t", 0.0)) - t0, think + carry, tuple(segs), max(1, n_out), len(ids))
            )
            carry = 0.0
        if not branch.name:
            if max_requests is not None and steps:
                parent_end = steps[-1].offset_s
        if steps:
            out.append((branch.t, TraceSession(session_id, steps, source=source)))
    return out


def _expand(paths: PathLike | Iterable[PathLike]) -> list[Path]:
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    out: list[Path] = []
    for p in map(Path, items):
        if p.is_dir():
            found = sorted(p.glob("trace_*.json"))
            if not found:
                raise FileNotFoundError(f"{p}: no trace_*.json files")
            out.extend(found)
        else:
            out.append(p)
    return out


def claude_code_arrivals(
    paths: PathLike | Iterable[PathLike],
    *,
    stagger_s: float = 10.0,
    limit: int | None = None,
    copies: int = 1,
    max_requests: int | None = None,
    max_context_tokens: int | None = None,
) -> Arrivals:
    """Sessions of kv-cache-tester files (or directories of ``trace_*.json``), sorted by start.

    Top-level session ``k`` (files in the given order, all files once per copy; at most ``limit``
    of them) starts at ``k * stagger_s``; its sub-agents start at that + their ``t``. The ``n``-th
    repeat of a trace id (a copy, or a file given twice) is another user: ids ``<trace id>#<n>``
    (own local blocks, shared system blocks).
    ``max_requests`` keeps the first requests of each session (and the sub-agents started by then);
    requests whose ``in + out`` exceeds ``max_context_tokens`` are dropped (their think and service
    time is added to the next request's think time).
    """
    if stagger_s < 0 or copies < 1:
        raise ValueError("stagger_s must be >= 0 and copies >= 1")
    files = _expand(paths)
    units = [(c, p) for c in range(copies) for p in files]
    if limit is not None:
        units = units[:limit]
    shared: dict[str, Segment] = {}
    loaded: dict[Path, dict[str, Any]] = {}
    uses: Counter[str] = Counter()
    out: Arrivals = []
    for k, (_, p) in enumerate(units):
        data = loaded.get(p)
        if data is None:
            data = loaded[p] = orjson.loads(p.read_bytes())
            if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
                raise ValueError(f"{p}: not a kv-cache-tester trace (no 'requests' list)")
        base = str(data.get("id") or p.stem)
        n = uses[base]
        uses[base] += 1
        trace_id = f"{base}#{n}" if n else base  # a repeat (copy, or a file given twice): another user
        for offset, session in _cc_file_sessions(
            data, trace_id, str(p), max_requests=max_requests,
            max_context_tokens=max_context_tokens, shared=shared,
        ):
            out.append((k * stagger_s + offset, session))
    out.sort(key=lambda a: a[0])
    return out


# --------------------------------------------------------------------------------------
# Dispatch, bound, summary
# --------------------------------------------------------------------------------------


def trace_sessions(path: PathLike, **kw: Any) -> Arrivals:
    """Arrivals of any supported trace, by format: a ``.jsonl`` of ``timestamp`` + ``hash_ids``
    lines (Mooncake, see :func:`mooncake_arrivals`), a ``.json`` with ``requests`` (kv-cache-tester,
    see :func:`claude_code_arrivals`), a directory (its ``trace_*.json``), or a bundled sample name
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
    if p.suffix == ".jsonl":
        with p.open("rb") as fh:
            first = next((line for line in fh if line.strip()), b"")
        row = orjson.loads(first) if first else None
        if isinstance(row, dict) and "hash_ids" in row and "timestamp" in row:
            return mooncake_arrivals(p, **kw)
        raise ValueError(f"{p}: unknown .jsonl trace format (want Mooncake lines with timestamp, hash_ids)")
    if p.suffix == ".json":
        return claude_code_arrivals([p], **kw)
    raise ValueError(
        f"{p}: unknown trace format (want .jsonl Mooncake, .json kv-cache-tester, or a directory)"
    )


def _schedule(session: Any) -> list[tuple[float, TurnRequest]]:
    """Nominal (offset, request) list of any session, without advancing it."""
    planned = getattr(session, "planned", None)
    if callable(planned):
        return planned()
    s = copy.deepcopy(session)  # a generic closed-loop session: step a copy, zero service time
    out: list[tuple[float, TurnRequest]] = []
    t = 0.0
    batch = s.next_requests(None)
    while batch:
        t += batch[0].think_time_s
        out.extend((t, r) for r in batch)
        batch = s.next_requests([r.expected_output_tokens for r in batch])
    return out


def reuse_bound(arrivals: Iterable[tuple[float, Any]], page_size: int) -> float:
    """The trace's own cache-hit bound: the fraction of prompt tokens in whole pages already seen
    in an earlier request (infinite cache, requests in nominal start order: session start + the
    trace's own offsets), on the page keys the simulator uses. Output pages are not counted (their
    keys are unique; see the module doc)."""
    events = []
    for si, (at, session) in enumerate(arrivals):
        for ri, (offset, req) in enumerate(_schedule(session)):
            events.append((at + offset, si, ri, session.session_id, req))
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    last = {e[3]: e[2] for e in events}
    keys = SegmentKeyCache(page_size, namespace="reuse-bound")
    seen: set[int] = set()
    hit = total = 0
    for _, _, ri, sid, req in events:
        pages = keys.keys(sid, req.segments)
        hit += sum(1 for k in pages if k in seen)
        seen.update(pages)
        total += req.prompt_tokens
        if last[sid] == ri:
            keys.forget(sid)
    return hit * page_size / total if total else 0.0


def trace_summary(arrivals: Iterable[tuple[float, Any]]) -> dict[str, float]:
    """Sessions, requests, token counts and think times of a trace (nominal schedule)."""
    arrivals = list(arrivals)
    prompts: list[int] = []
    outs: list[int] = []
    thinks: list[float] = []
    for _, session in arrivals:
        for _, req in _schedule(session):
            prompts.append(req.prompt_tokens)
            outs.append(req.expected_output_tokens)
            if req.turn_index > 0:
                thinks.append(req.think_time_s)

    return {
        "sessions": len(arrivals),
        "requests": len(prompts),
        "prompt_tokens": sum(prompts),
        "output_tokens": sum(outs),
        "input_p50": _quantile(prompts, 0.5),
        "input_p90": _quantile(prompts, 0.9),
        "input_max": max(prompts, default=0),
        "output_p50": _quantile(outs, 0.5),
        "think_p50_s": _quantile(thinks, 0.5),
        "last_arrival_s": max((a for a, _ in arrivals), default=0.0),
    }
