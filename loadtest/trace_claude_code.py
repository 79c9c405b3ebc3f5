"""Claude Code traces (kv-cache-tester format) as sessions with shared system prompts.

One session per file, 64-token blocks, ids local to the file:
- block ``h`` is keyed ``<trace id>/<h>``, except the blocks of the system prompt + tool definitions,
  the first ``(tool_tokens + system_tokens) // 64`` blocks, which real deployments share across
  sessions: along the session's canonical system prefix (the most frequent first-``k``-blocks
  sequence among its requests; a few requests, e.g. side calls with another system prompt, diverge
  from it early) they are keyed ``cc-system/<block index>``, one key space for every session (so two
  sessions share ``min(k1, k2)`` system blocks: the upper end of cross-session sharing, as for one
  client version). Sub-agents use ``cc-system/<subagent_type>/<block index>``.
- ``floor(in / 64)`` blocks have ids; the remaining ``in % 64`` tokens are a segment of their own,
  keyed per request (the simulator never matches it; never a whole page of its own prompt anyway).
  Its text, for a live replay, is the start of the block the next request of the same prefix has
  there, so a conversation's text only grows.
- live replay sends a request as the previous request's messages, then the answer and the new
  input (``TraceStep.message_starts``, made here from the block ids).
- closed loop: request ``i > 0`` starts its trace ``think_time`` after request ``i - 1`` finished;
  the output length is ``out`` (``max_tokens`` too).
- ``{"type": "subagent", "t", "requests": [...]}`` entries (a concurrent branch with its own prefix)
  become separate sessions (``<trace id>/<agent_id>``) arriving at the parent's start + ``t``: an open
  loop offset, so in a replay slower than the original they start "early" relative to their parent
  (the parent's next request still waits its own think time, which in the trace covers the
  sub-agent's run). Their ids share the parent's local id space, so sub-agents of one parent share
  their common prefix.
- top-level sessions start staggered: the ``k``-th (file order, then copy) at ``k * stagger_s``.
"""

from __future__ import annotations

import gzip
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from .trace_session import Arrivals, MessageStarts, PathLike, TraceSession, TraceStep
from .turn_request import Segment

__all__ = ["CC_BLOCK_SIZE", "CC_SYSTEM_NAMESPACE", "claude_code_arrivals", "read_trace_file", "trace_file_stem"]

CC_BLOCK_SIZE = 64
CC_SYSTEM_NAMESPACE = "cc-system"


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
    rendered: list[tuple[list[int], MessageStarts]] = []  # every request so far, of any branch: its ids, its cuts
    for branch in branches:
        session_id = f"{trace_id}/{branch.name}" if branch.name else trace_id
        if branch.name and parent_end is not None and branch.t > parent_end:
            continue  # spawned after the parent's truncation point
        t0 = float(branch.requests[0].get("t", 0.0)) if branch.requests else 0.0
        kept: list[tuple[dict[str, Any], list[int], float]] = []  # request, its block ids, its pause
        carry = 0.0  # think + service time of dropped requests, added to the next kept one
        for r in branch.requests:
            if max_requests is not None and len(kept) >= max_requests:
                break
            n_in, n_out = int(r["in"]), int(r.get("out") or 0)
            ids = r["hash_ids"]
            if len(ids) != n_in // block_size:
                raise ValueError(f"{source}: {session_id}: {len(ids)} hash_ids for in={n_in}")
            think = float(r.get("think_time") or 0.0)
            if max_context_tokens is not None and n_in + n_out > max_context_tokens:
                carry += think + float(r.get("api_time") or 0.0)
                continue
            kept.append((r, ids, think + carry))
            carry = 0.0
        steps: list[TraceStep] = []
        all_ids = [ids for _, ids, _ in kept]
        for k, (r, ids, think) in enumerate(kept):
            n_in, n_out = int(r["in"]), int(r.get("out") or 0)
            segs = [block(h) for h in ids]
            tail = n_in - len(ids) * block_size
            if tail > 0:
                segs.append(Segment("user", tail, f"{session_id}/r{k}/tail",
                                    text_key=_tail_text_key(all_ids, k, session_id, block)))
            before = (all_ids[k - 1], int(kept[k - 1][0]["in"]), steps[-1]) if k else None
            starts = _message_starts(ids, n_in, before, rendered, block_size)
            steps.append(TraceStep(float(r.get("t", 0.0)) - t0, think, tuple(segs), max(1, n_out), len(ids), starts))
            rendered.append((ids, starts))
        if not branch.name:
            if max_requests is not None and steps:
                parent_end = steps[-1].offset_s
        if steps:
            out.append((branch.t, TraceSession(session_id, steps)))
    return out


def _message_starts(ids: list[int], n_in: int, before: tuple[list[int], int, TraceStep] | None,
                    rendered: list[tuple[list[int], MessageStarts]], block_size: int) -> MessageStarts:
    """Where this request's messages start (see `TraceTurnRequest`). One that extends the previous
    request of its branch keeps that request's messages and adds the answer to it (an assistant
    message of its output length, less where the new text is shorter, as when reasoning is not
    sent back) and a user message with the rest. Any other (the first, or after a prefix break)
    takes the cuts of the earlier request of the file, of any branch, sharing the most whole
    blocks with it, within what they share: equal tokens are then equal messages, so a live
    cache reuses what the trace says it shares."""
    if before is not None:
        prev_ids, prev_in, prev = before
        if len(ids) >= len(prev_ids) and ids[:len(prev_ids)] == prev_ids and n_in > prev_in:
            answer = min(prev.out, n_in - prev_in - 1)  # the new input after it is never empty
            cut = ((prev_in, "assistant"), (prev_in + answer, "user")) if answer else ((prev_in, "user"),)
            return prev.message_starts + cut
    shared, starts = 0, ()
    for other_ids, other_starts in rendered:
        n = 0
        for a, b in zip(ids, other_ids):
            if a != b:
                break
            n += 1
        if n >= shared:
            shared, starts = n, other_starts
    end = min(shared * block_size, n_in - 1)  # the user's turn ends a request: never empty
    kept = tuple(c for c in starts if c[0] < end)
    if kept and kept[-1][1] != "user":
        kept += ((end, "user"),)
    return kept


def _tail_text_key(all_ids: list[list[int]], k: int, session_id: str, block: Any) -> str:
    """Whose text request `k`'s partial last block starts with. A conversation only grows, so its
    last tokens are the start of the whole block a later request of the same prefix has at that
    position (the trace names whole blocks only): that block's key, else, while no later request
    has it whole, a key shared by the requests with these same whole blocks. The block is a user
    message either way: one inside the system prompt would leave its request without a user turn."""
    ids, n = all_ids[k], len(all_ids[k])
    for later in all_ids[k + 1:]:
        if len(later) < n or later[:n] != ids:
            break
        if len(later) > n:
            return block(later[n]).key
    first = k
    while first > 0 and all_ids[first - 1] == ids:
        first -= 1
    return f"{session_id}/r{first}/tail"


def _expand(paths: PathLike | Iterable[PathLike]) -> list[Path]:
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    out: list[Path] = []
    for p in map(Path, items):
        if p.is_dir():
            found = sorted([*p.glob("trace_*.json"), *p.glob("trace_*.json.gz")], key=lambda f: f.name)
            if not found:
                raise FileNotFoundError(f"{p}: no trace_*.json or trace_*.json.gz files")
            out.extend(found)
        else:
            out.append(p)
    return out


def read_trace_file(path: Path) -> Any:
    """The JSON of one trace file, gunzipped first when its name ends in ``.gz``."""
    raw = path.read_bytes()
    return orjson.loads(gzip.decompress(raw) if path.name.endswith(".gz") else raw)


def trace_file_stem(path: Path) -> str:
    """``trace_0001`` for ``trace_0001.json`` and for ``trace_0001.json.gz``."""
    name = path.name.removesuffix(".gz")
    return name.removesuffix(".json")


def claude_code_arrivals(
    paths: PathLike | Iterable[PathLike],
    *,
    stagger_s: float = 10.0,
    limit: int | None = None,
    copies: int = 1,
    max_requests: int | None = None,
    max_context_tokens: int | None = None,
) -> Arrivals:
    """Sessions of kv-cache-tester files (or directories of ``trace_*.json`` and
    ``trace_*.json.gz``; a ``.gz`` file is read gunzipped), sorted by start.

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
            data = loaded[p] = read_trace_file(p)
            if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
                raise ValueError(f"{p}: not a kv-cache-tester trace (no 'requests' list)")
        base = str(data.get("id") or trace_file_stem(p))
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
