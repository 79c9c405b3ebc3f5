"""A replayed trace session: the trace's requests, one per turn, as :class:`TurnRequest` objects.

Sessions follow the :class:`kvrouter.loadtest.workload.Session` protocol (``session_id``,
``n_turns``, ``next_requests(replies)``, ``reply_segment(req, reply)``), one request per turn, so the
cluster simulator and the live driver run them like synthetic sessions. The format readers
(:mod:`kvrouter.loadtest.trace_mooncake`, :mod:`kvrouter.loadtest.trace_claude_code`) build them
from :class:`TraceStep` lists.

Replies: a trace's next prompt is its own ``hash_ids`` (which already contain the previous output as
new blocks), so replies are ignored when building the next request. ``reply_segment`` still returns
a segment (``<session id>/r<turn>/reply``) for the simulator to insert output pages; that key is
unique, so cached output never matches the next prompt (the trace's own accounting gives the output
fresh block ids too). This under-counts real output caching by about the output share of prompt
tokens (out / in, ~0.1-0.5% on the Claude Code traces).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Union

from .turn_request import CHARS_PER_TOKEN, ReplyLike, Segment, TurnRequest, reply_as_segment

__all__ = ["TraceTurnRequest", "TraceStep", "TraceSession", "Arrivals", "MessageStarts", "PathLike"]

PathLike = Union[str, Path]
Arrivals = list[tuple[float, "TraceSession"]]
MessageStarts = tuple[tuple[int, str], ...]  # where a request's messages start: (token offset, role)


@dataclass(frozen=True, slots=True)
class TraceTurnRequest(TurnRequest):
    """A trace request. ``messages`` merges runs of same-role segments into one message (a prompt
    is thousands of block segments) and cuts them where the trace's loader says a message starts
    (``message_starts``): as a coding agent sends it, each request is the previous one's messages,
    unchanged, then the previous answer and the new input as messages of their own."""

    # (token offset in the prompt, role) where a new message starts inside a run
    message_starts: MessageStarts = ()

    @property
    def messages(self) -> list[dict[str, str]]:
        out: list[dict[str, str]] = []
        run: list[str] = []
        role = None
        start = at = 0  # the run's and the next segment's token offsets
        for seg in self.segments:
            if seg.role != role and run:
                out += _cut(role, "".join(run), start, self.message_starts)  # type: ignore[arg-type]
                run, start = [], at
            role = seg.role
            run.append(seg.text())
            at += seg.tokens
        if run:
            out += _cut(role, "".join(run), start, self.message_starts)  # type: ignore[arg-type]
        return out


def _cut(role: str, text: str, start: int, starts: MessageStarts) -> list[dict[str, str]]:
    """One run of text from token offset `start` as messages, cut at the `starts` inside it (trace
    text is CHARS_PER_TOKEN characters a token); the system prompt stays one message."""
    out, begin = [], 0
    for offset, next_role in () if role == "system" else starts:
        cut = (offset - start) * CHARS_PER_TOKEN
        if begin < cut < len(text):
            out.append({"role": role, "content": text[begin:cut]})
            role, begin = next_role, cut
    out.append({"role": role, "content": text[begin:]})
    return out


@dataclass(slots=True)
class TraceStep:
    """One request of a trace session, as read from the file."""

    offset_s: float  # nominal start from the session's start, by the trace's own clock
    think_s: float  # closed-loop pause after the previous request finished
    segments: tuple[Segment, ...]
    out: int
    n_blocks: int  # leading segments that are whole blocks (the rest: a partial tail)
    # where its messages start inside a run of segments (see TraceTurnRequest)
    message_starts: MessageStarts = ()


class TraceSession:
    """One replayed session: ``next_requests`` returns the trace's requests one at a time."""

    def __init__(self, session_id: str, steps: Sequence[TraceStep]) -> None:
        self.session_id = session_id
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

    def restarted(self, max_think_s: float | None = None) -> "TraceSession":
        """A new, unstarted session with the same steps (a replay runs every session once; the
        same segments keep their rendered text, so a second replay does not render it again).
        ``max_think_s`` caps every pause between requests (a user idle for half an hour, say, to
        keep a replay short; the request order and contents are unchanged)."""
        steps = self._steps
        if max_think_s is not None:
            steps = [replace(st, think_s=min(st.think_s, max_think_s)) for st in steps]
        return TraceSession(self.session_id, steps)

    def reply_segment(self, req: TurnRequest, reply: ReplyLike) -> Segment:
        """The output as a segment; unique key, so it never matches a later prompt (see the module doc)."""
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
            message_starts=step.message_starts,
        )

    def __repr__(self) -> str:
        return f"TraceSession({self.session_id!r}, n_turns={self.n_turns})"
