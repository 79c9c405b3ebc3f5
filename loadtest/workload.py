"""Synthetic coding-agent sessions drawn from a :class:`WorkloadConfig`, and their offline summary.

Pure: no I/O, no clock, no global randomness. Every session draws from its own ``random.Random``
(see :func:`make_session`), so session ``i`` of seed ``s`` is the same whatever order or
concurrency a driver runs sessions in. The config itself is loaded by
:mod:`kvrouter.loadtest.workload_config`; requests and their messages are
:mod:`kvrouter.loadtest.turn_request` types.

Structure of a session (``Session.next_requests`` is a closed-loop state machine)::

    [system prompt]          identical text in every session (key "system/<name>")
    [repository context]     user message, per session
    [turn 1 user/tool msg]   -> request 1; the reply is appended as an assistant message
    [reply 1]
    [turn 2 user/tool msg]   -> request 2 = all of the above, byte-identical, + the new message
    ...

Per turn, in a fixed order of draws: think time (mixture of tool-call latency and user reply),
fan-out (with probability ``branch.rate`` the turn becomes ``k`` concurrent requests under the same
session id, each the shared history + its own new message; the session continues from one of them,
chosen at random), edit (with probability ``edit_rate`` one earlier user message gets new text of the
same length, so everything from it onwards misses the prefix cache; later messages are kept), new
user/tool tokens and output tokens per branch.

Context cap: when a request would not fit ``max_context_tokens`` (prompt + max_tokens), the session
either compacts (default; as coding agents do: history becomes system + repository context + a
summary message of ``compact_summary_tokens``, so the cache only holds up to the repository context)
or ends (``on_context_full: end``).
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Sequence

from .turn_request import ReplyLike, Segment, TurnRequest, reply_as_segment
from .workload_config import WorkloadConfig

__all__ = ["Session", "make_session", "fast_forward", "warm_start_batch", "summarize", "quantile"]


class Session:
    """Closed-loop state machine for one session.

    ``next_requests(None)`` first, then ``next_requests(replies)`` with one reply per request of the
    previous batch (text from the server, a token count, or None for a failed request). Returns the
    next batch (1 request, or ``k`` concurrent branches), or ``[]`` when the session is over.
    """

    def __init__(self, config: WorkloadConfig, rng: random.Random, session_id: str) -> None:
        self.config = config
        self.session_id = session_id
        self._rng = rng
        self.n_turns = max(1, round(config.turns_per_session.sample(rng)))
        repo_tokens = int(round(config.repo_context_tokens.sample(rng)))
        self._base: list[Segment] = []
        if config.system_prompt_tokens > 0:
            self._base.append(
                Segment("system", config.system_prompt_tokens, f"system/{config.name}", shared=True)
            )
        if repo_tokens > 0:
            self._base.append(Segment("user", repo_tokens, f"{session_id}/repo"))
        self._history: list[Segment] = list(self._base)
        # token totals kept alongside: summing a long history on every turn made a session's
        # cost grow with the square of its turns
        self._base_tokens = sum(s.tokens for s in self._base)
        self._history_tokens = self._base_tokens
        self._pending_prompts: list[int] = []  # prompt tokens of each pending request
        self._pending: list[TurnRequest] = []
        self._chosen = 0
        self.turn = 0
        self.done = False
        self.compactions = 0

    def next_requests(self, replies: Sequence[ReplyLike] | None = None) -> list[TurnRequest]:
        if self._pending:
            if replies is None or len(replies) != len(self._pending):
                raise ValueError(
                    f"session {self.session_id}: expected {len(self._pending)} replies, "
                    f"got {None if replies is None else len(replies)}"
                )
            req = self._pending[self._chosen]
            reply = self.reply_segment(req, replies[self._chosen])
            self._history = list(req.segments) + [reply]
            self._history_tokens = self._pending_prompts[self._chosen] + reply.tokens
            self._pending = []
        elif replies:
            raise ValueError(f"session {self.session_id}: replies given but no requests outstanding")
        if self.done or self.turn >= self.n_turns:
            self.done = True
            return []
        batch = self._draw_turn()
        if not batch:
            self.done = True
        return batch

    # -- internals ----------------------------------------------------------------------

    def reply_segment(self, req: TurnRequest, reply: ReplyLike) -> Segment:
        """The assistant message a reply becomes in the history (also what the KV cache holds)."""
        return reply_as_segment(f"{self.session_id}/t{req.turn_index}/b{req.branch_index}/reply", req, reply)

    def _draw_turn(self) -> list[TurnRequest]:
        cfg, rng, turn = self.config, self._rng, self.turn
        # Draws happen in a fixed order that never depends on reply contents.
        think = cfg.think_time.sample(rng)
        fan_draw = rng.random()
        fanout = max(2, round(cfg.branch.fanout.sample(rng)))
        edit_draw = rng.random()
        edit_pick = rng.random()
        n_branches = fanout if turn > 0 and fan_draw < cfg.branch.rate else 1
        news = [max(1, round(cfg.new_tokens_per_turn.sample(rng))) for _ in range(n_branches)]
        outs = [max(1, round(cfg.output_tokens.sample(rng))) for _ in range(n_branches)]
        self._chosen = rng.randrange(n_branches)
        if turn == 0:
            think = 0.0

        history = self._history
        history_tokens = self._history_tokens
        reused = history_tokens
        is_edit, edit_index = False, None
        if turn > 0 and edit_draw < cfg.edit_rate:
            candidates = [i for i, s in enumerate(history) if s.role == "user"]
            if candidates:
                edit_index = candidates[int(edit_pick * len(candidates))]
                old = history[edit_index]
                history = list(history)
                history[edit_index] = Segment(old.role, old.tokens, f"{old.key}~e{turn}")
                reused = sum(s.tokens for s in history[:edit_index])
                is_edit = True

        compacted = False
        need = max(n + o for n, o in zip(news, outs))
        if history_tokens + need > cfg.max_context_tokens:  # an edit keeps the token count
            if cfg.on_context_full == "end":
                return []
            self.compactions += 1
            summary = Segment("user", cfg.compact_summary_tokens, f"{self.session_id}/compact{self.compactions}")
            history = self._base + ([summary] if summary.tokens > 0 else [])
            reused = self._base_tokens
            history_tokens = reused + (summary.tokens if summary.tokens > 0 else 0)
            compacted = True
            is_edit, edit_index = False, None
            if history_tokens + need > cfg.max_context_tokens:
                return []  # even a fresh context cannot hold this turn

        self._history = history
        self._history_tokens = history_tokens
        self._pending_prompts = [history_tokens + n for n in news]
        batch = []
        for b in range(n_branches):
            msg = Segment("user", news[b], f"{self.session_id}/t{turn}/b{b}")
            batch.append(
                TurnRequest(
                    session_id=self.session_id,
                    turn_index=turn,
                    branch_index=b,
                    n_branches=n_branches,
                    segments=tuple(history) + (msg,),
                    max_tokens=outs[b],
                    expected_output_tokens=outs[b],
                    think_time_s=think,
                    is_edit=is_edit,
                    edit_message_index=edit_index,
                    compacted=compacted,
                    new_tokens=news[b],
                    reused_tokens=reused,
                )
            )
        self._pending = batch
        self.turn += 1
        return batch


def make_session(config: WorkloadConfig, seed: int, index: int) -> Session:
    """Session ``index`` of a run: its own generator, so it does not depend on run order."""
    return Session(config, random.Random(f"{seed}:{index}"), f"{config.name}-{seed}-{index:06d}")


def fast_forward(session: Session, rng: random.Random) -> list[TurnRequest]:
    """Warm start: skip `rng.randrange(n_turns)` of ``session``'s turns (replies of the expected
    length, nothing sent), so it starts mid-life with a steady-state context; returns its first
    batch to send. A session of one turn draws nothing."""
    batch = session.next_requests(None)
    if session.n_turns > 1:
        for _ in range(rng.randrange(session.n_turns)):
            nxt = session.next_requests([r.expected_output_tokens for r in batch])
            if not nxt:
                break
            batch = nxt
    return batch


def warm_start_batch(session: Session, seed: int) -> list[TurnRequest]:
    """`fast_forward` as the load driver draws it: from the seed and the session id alone, so the
    driver and the cluster simulator (`warm_start_as_driver`) start session ``i`` of a seed at the
    same turn."""
    return fast_forward(session, random.Random(f"{seed}:warm:{session.session_id}"))


# --------------------------------------------------------------------------------------
# Offline summary
# --------------------------------------------------------------------------------------


def quantile(xs: Sequence[float], q: float) -> float:
    """``q`` in [0, 1], linear interpolation between closest ranks; NaN when ``xs`` is empty."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(config: WorkloadConfig, seed: int, n_sessions: int) -> dict[str, float]:
    """Generate ``n_sessions`` sessions offline (replies = expected output length) and describe them."""
    inputs: list[int] = []
    outputs: list[int] = []
    thinks: list[float] = []
    turns: list[int] = []
    reused = prompt = 0
    n_turns = n_branch_turns = n_edit_turns = compactions = 0
    for i in range(n_sessions):
        s = make_session(config, seed, i)
        batch = s.next_requests(None)
        while batch:
            n_turns += 1
            n_branch_turns += batch[0].n_branches > 1
            n_edit_turns += batch[0].is_edit
            if batch[0].turn_index > 0:
                thinks.append(batch[0].think_time_s)
            for r in batch:
                p = r.prompt_tokens
                inputs.append(p)
                outputs.append(r.expected_output_tokens)
                prompt += p
                reused += r.reused_tokens
            batch = s.next_requests([r.expected_output_tokens for r in batch])
        turns.append(s.turn)
        compactions += s.compactions
    mean_in = statistics.fmean(inputs) if inputs else 0.0
    mean_out = statistics.fmean(outputs) if outputs else 0.0
    return {
        "sessions": n_sessions,
        "requests": len(inputs),
        "mean_input_tokens": mean_in,
        "input_p10": quantile(inputs, 0.1),
        "input_p50": quantile(inputs, 0.5),
        "input_p90": quantile(inputs, 0.9),
        "mean_output_tokens": mean_out,
        "output_p50": quantile(outputs, 0.5),
        "input_output_ratio": mean_in / mean_out if mean_out else float("inf"),
        "mean_turns_per_session": statistics.fmean(turns) if turns else 0.0,
        "median_turns_per_session": quantile(turns, 0.5),
        "requests_per_session": len(inputs) / n_sessions if n_sessions else 0.0,
        "branch_turn_fraction": n_branch_turns / n_turns if n_turns else 0.0,
        "edit_turn_fraction": n_edit_turns / n_turns if n_turns else 0.0,
        "compactions_per_session": compactions / n_sessions if n_sessions else 0.0,
        "think_p50_s": quantile(thinks, 0.5),
        "think_p90_s": quantile(thinks, 0.9),
        "reusable_prefix_fraction": reused / prompt if prompt else 0.0,
    }
