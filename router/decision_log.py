"""The decision log: one JSON line per request, written off the event loop, rotated by size.

A request's line says when it came (`t`, Unix seconds), its session (a short hash of the session
key, never the key itself), its estimated prompt size, where it went and why, what the router
predicted (cached tokens, time to first token) and what happened (the cached tokens the replica
reported, measured time to first byte, status). The prompt text is never logged; its prefix is
described by the chain of block hashes the router already computed (`prefix_marks`), so a replay
(loadtest/trace_decision_log.py) can rebuild sessions and their prefix sharing.

Writing never blocks or fails a request: lines go into a bounded queue that a
`logging.handlers.QueueListener` thread drains into a `RotatingFileHandler`; when the queue is
full the line is dropped and counted (kvrouter_decision_log_dropped_total).
"""

from __future__ import annotations

import hashlib
import logging
import logging.handlers
import queue
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from ..policies.domain import RequestSummary
from .usage import UsageReport

if TYPE_CHECKING:
    from ..policies.predict import Prediction
    from .placement import Placement

log = logging.getLogger("kvrouter.decision_log")

LOG_FORMAT = "kvrouter-decision-log/1"  # the first line of every file names the format


def short_hash(value: int | str) -> str:
    """8 hex digits: enough to tell prefixes and sessions apart in one log, too few to reverse."""
    if isinstance(value, int):
        return f"{value & 0xFFFFFFFF:08x}"
    return hashlib.blake2b(value.encode(), digest_size=4).hexdigest()


def prefix_marks(blocks: tuple[int, ...]) -> list[str]:
    """Short hashes of the prompt's chained block hashes at positions 0, 1, 3, 7, ... (2^k - 1)
    and at its last block. The hashes are chained, so equal marks at a position mean equal
    prompts up to that block: a replay finds how much of its prefix two requests share."""
    n = len(blocks)
    out = []
    pos = 0
    while pos < n:
        out.append(short_hash(blocks[pos]))
        pos = 2 * pos + 1
    if n & (n - 1):  # n is not a power of two: the last block (n - 1) is not a mark yet
        out.append(short_hash(blocks[-1]))
    return out


def worker_path(path: str | Path, worker: int | None) -> Path:
    """Under `serve --workers N` each worker process writes its own file (`log.w0.jsonl`, ...):
    rotation needs a single writer per file."""
    p = Path(path)
    return p if worker is None else p.with_name(f"{p.stem}.w{worker}{p.suffix}")


class _Header(logging.handlers.RotatingFileHandler):
    """A rotating file whose every new file starts with the format line."""

    def _open(self):  # type: ignore[no-untyped-def]
        stream = super()._open()
        if stream.tell() == 0:
            stream.write(orjson.dumps({"format": LOG_FORMAT}).decode() + "\n")
            stream.flush()
        return stream


class _Listener(logging.handlers.QueueListener):
    """Stopping waits for room in a full queue (the stdlib's does not and raises), for a while."""

    def enqueue_sentinel(self) -> None:
        self.queue.put(self._sentinel, timeout=10.0)


class DecisionLog:
    """The log file and its writer thread. `write(entry)` only enqueues (never blocks); `close()`
    flushes what is queued and stops the thread."""

    def __init__(
        self,
        path: str | Path,
        *,
        max_bytes: int = 100 * 1024 * 1024,
        backups: int = 5,
        queue_size: int = 10_000,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        self.path = Path(path)
        # Opened here, once, so a path that cannot be written is a start-up error (OSError);
        # later disk errors are the handler's: reported on stderr, never raised to a request.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handler = _Header(self.path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(message)s"))
        self._queue: queue.Queue[logging.LogRecord] = queue.Queue(queue_size)
        self._listener = _Listener(self._queue, handler)
        self._handler = handler
        self._on_drop = on_drop
        self.dropped = 0
        self._listener.start()

    def write(self, entry: Mapping[str, Any]) -> None:
        """Queue one line. Never raises: a line that cannot be encoded or queued is dropped."""
        try:
            line = orjson.dumps(entry).decode()
            record = logging.LogRecord("kvrouter.decision", logging.INFO, "", 0, line, None, None)
            self._queue.put_nowait(record)
        except Exception:  # queue full, or an unencodable value: the request must not notice
            self.dropped += 1
            if self._on_drop is not None:
                self._on_drop()

    def close(self) -> None:
        """Write what is queued and stop the thread (blocking: call it off the event loop)."""
        try:
            self._listener.stop()  # drains the queue first
        except queue.Full:  # the writer has been stuck for 10 s: give up on the queued lines
            log.warning("decision log %s: writer stuck, %d queued lines not written",
                        self.path, self._queue.qsize())
        self._handler.close()


def decision_line(t: float, fields: dict[str, Any], status: int, duration_s: float) -> dict[str, Any]:
    """The whole line: `t` (Unix seconds the request arrived) first, then `request_fields`."""
    return {"t": round(t, 6), **fields, "status": status, "duration_s": round(duration_s, 6)}


def _ttft(p: Prediction | None) -> float | None:
    return None if p is None or p.ttft_s is None else round(p.ttft_s, 6)


def request_fields(request_id: str, summary: RequestSummary, placement: Placement | None,
                   received: float | None = None) -> dict[str, Any]:
    """One request's line, but for time, status and duration: from its last placement (the one
    that answered, or the last one tried), or from its summary alone if none was placed.
    `received`: when the router got the request, on the clock `Placement.sent_at` is read on."""
    key = summary.session_key
    blocks = summary.prefix_blocks
    out: dict[str, Any] = {
        "id": request_id,
        "route": summary.route,
        "model": summary.model,
        "session": short_hash(key) if key is not None else None,
        "prompt_tokens": summary.prompt_tokens,
        "blocks": len(blocks),
        "prefix": prefix_marks(blocks),
    }
    if placement is None:
        out["replica"] = None
        return out
    notes = placement.notes
    usage = placement.usage
    out.update({
        "replica": placement.url,
        "reason": placement.decision.reason,
        "policy": notes.policy if notes is not None else None,
        "attempts": len(placement.tried) + 1,
        "predicted_cached": notes.chosen.cached_tokens if notes is not None else None,
        "predicted_ttft_s": _ttft(notes.chosen) if notes is not None else None,
        "ttft_s": round(placement.ttfb_s, 6) if placement.ttfb_s is not None else None,
        "routed_s": (round(placement.sent_at - received, 6)
                     if placement.sent_at is not None and received is not None else None),
    })
    if isinstance(usage, UsageReport):
        out["reported_prompt_tokens"] = usage.prompt_tokens
        out["reported_cached"] = usage.cached_tokens
        out["output_tokens"] = usage.completion_tokens
    elif usage is not None:
        out["usage"] = usage  # why there is none: missing, garbage, unbuffered...
    decode = placement.decode  # PD: the decode server of the pair
    if decode is not None:
        out["decode"] = decode.url
    error = placement.error if placement.error is not None or decode is None else decode.error
    if error is not None:
        out["error"] = error
    if notes is not None and notes.shadows:
        out["shadow"] = {
            name: {"replica": d.replica if d is not None else None,
                   "predicted_cached": p.cached_tokens if p is not None else None,
                   "predicted_ttft_s": _ttft(p)}
            for name, d, p in notes.shadows
        }
    return out
