"""Synthetic coding-agent sessions: one structure, viewed as chat messages or as token counts.

Pure: no I/O except :func:`load_workload` reading YAML, no clock, no global randomness. Every
session draws from its own ``random.Random`` (see :func:`make_session`), so session ``i`` of seed
``s`` is the same whatever order or concurrency a driver runs sessions in.

Structure of a session (``Session.next_requests`` is a closed-loop state machine)::

    [system prompt]          identical text in every session (key "system/<name>")
    [repository context]     user message, per session
    [turn 1 user/tool msg]   -> request 1; the reply is appended as an assistant message
    [reply 1]
    [turn 2 user/tool msg]   -> request 2 = all of the above, byte-identical, + the new message
    ...

Every message is a :class:`Segment` (role, token count, content key). Its text is rendered lazily
and deterministically from the key at ~4 ASCII characters per token, so the HTTP driver sends real
text while the discrete-event simulator uses ``TurnRequest.segments`` / token counts and never builds
a string. Assistant replies are whatever the server returned (the driver passes the text back), or
a token count (the simulator), or ``None`` (a failed request: the expected length is used).

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
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal, Sequence, Union

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "Constant",
    "LogNormal",
    "Uniform",
    "Choice",
    "Dist",
    "ThinkTime",
    "Branching",
    "WorkloadConfig",
    "WorkloadConfigError",
    "load_workload",
    "builtin_workloads",
    "Segment",
    "reply_as_segment",
    "TurnRequest",
    "Session",
    "make_session",
    "summarize",
    "synthetic_text",
    "count_tokens",
]

CHARS_PER_TOKEN = 4
WORKLOADS_DIR = Path(__file__).with_name("workloads")


# --------------------------------------------------------------------------------------
# Distributions
# --------------------------------------------------------------------------------------

_STRICT = ConfigDict(extra="forbid", frozen=True)


class Constant(BaseModel):
    model_config = _STRICT
    dist: Literal["constant"] = "constant"
    value: float = Field(ge=0)

    def sample(self, rng: random.Random) -> float:
        return self.value


class LogNormal(BaseModel):
    """Log-normal given by its median and 90th percentile, clipped to [min, max]."""

    model_config = _STRICT
    dist: Literal["lognormal"] = "lognormal"
    median: float = Field(gt=0)
    p90: float = Field(gt=0)
    min: float = Field(default=0.0, ge=0)
    max: float | None = None

    @model_validator(mode="after")
    def _check(self) -> "LogNormal":
        if self.p90 < self.median:
            raise ValueError(f"p90 ({self.p90}) must be >= median ({self.median})")
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self

    @property
    def sigma(self) -> float:
        return math.log(self.p90 / self.median) / 1.2815515655446004  # z(0.9)

    def sample(self, rng: random.Random) -> float:
        x = rng.lognormvariate(math.log(self.median), self.sigma)
        x = max(self.min, x)
        return x if self.max is None else min(self.max, x)


class Uniform(BaseModel):
    model_config = _STRICT
    dist: Literal["uniform"] = "uniform"
    low: float = Field(ge=0)
    high: float = Field(ge=0)

    @model_validator(mode="after")
    def _check(self) -> "Uniform":
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) must be >= low ({self.low})")
        return self

    def sample(self, rng: random.Random) -> float:
        return rng.uniform(self.low, self.high)


class Choice(BaseModel):
    model_config = _STRICT
    dist: Literal["choice"] = "choice"
    values: list[float] = Field(min_length=1)
    weights: list[float] | None = None

    @model_validator(mode="after")
    def _check(self) -> "Choice":
        if self.weights is not None:
            if len(self.weights) != len(self.values):
                raise ValueError("weights must have as many entries as values")
            if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
                raise ValueError("weights must be >= 0 with a positive sum")
        return self

    def sample(self, rng: random.Random) -> float:
        return rng.choices(self.values, weights=self.weights)[0]


def _scalar_to_constant(v: Any) -> Any:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return {"dist": "constant", "value": v}
    return v


#: A distribution; a bare number in YAML means a constant.
Dist = Annotated[
    Union[Constant, LogNormal, Uniform, Choice],
    BeforeValidator(_scalar_to_constant),
    Field(discriminator="dist"),
]


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------


class ThinkTime(BaseModel):
    """Pause before a turn (after the previous reply finished): a tool call with probability
    ``p_tool``, else a user reply. Seconds of model time."""

    model_config = _STRICT
    p_tool: float = Field(ge=0, le=1)
    tool_s: Dist
    user_s: Dist

    def sample(self, rng: random.Random) -> float:
        is_tool = rng.random() < self.p_tool
        tool = self.tool_s.sample(rng)  # both drawn: a fixed number of draws per turn
        user = self.user_s.sample(rng)
        return tool if is_tool else user


class Branching(BaseModel):
    """With probability ``rate`` a turn fans out into ``fanout`` concurrent requests (>= 2)."""

    model_config = _STRICT
    rate: float = Field(default=0.0, ge=0, le=1)
    fanout: Dist = Field(default_factory=lambda: Constant(value=2))


class WorkloadConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "workload"
    system_prompt_tokens: int = Field(ge=0)
    repo_context_tokens: Dist
    turns_per_session: Dist
    new_tokens_per_turn: Dist
    output_tokens: Dist
    think_time: ThinkTime
    branch: Branching = Field(default_factory=Branching)
    edit_rate: float = Field(default=0.0, ge=0, le=1)
    max_context_tokens: int = Field(gt=0)
    on_context_full: Literal["compact", "end"] = "compact"
    compact_summary_tokens: int = Field(default=0, ge=0)


class WorkloadConfigError(ValueError):
    """A workload file that does not parse or validate; the message names file and key."""


def builtin_workloads() -> list[str]:
    return sorted(p.stem for p in WORKLOADS_DIR.glob("*.yaml"))


def load_workload(path_or_name: str | Path) -> WorkloadConfig:
    """Load a workload YAML file, or a built-in by name (``coding-agent``, ``tiny``)."""
    path = Path(path_or_name)
    if not path.is_file():
        builtin = WORKLOADS_DIR / f"{path_or_name}.yaml"
        if not builtin.is_file():
            raise WorkloadConfigError(
                f"workload {str(path_or_name)!r}: no such file and not a built-in "
                f"({', '.join(builtin_workloads())})"
            )
        path = builtin
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise WorkloadConfigError(f"workload error: {path}: invalid YAML: {exc}") from exc
    return parse_workload(data, source=str(path))


def parse_workload(data: Any, source: str = "<dict>") -> WorkloadConfig:
    if not isinstance(data, dict):
        raise WorkloadConfigError(f"workload error: {source}: expected a mapping at top level")
    try:
        return WorkloadConfig.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            lines.append(f"workload error: {source}: {loc}: {msg}")
        raise WorkloadConfigError("\n".join(lines)) from None


# --------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------

_WORDS = (
    "def", "return", "self", "import", "class", "if", "else", "for", "in", "while", "try",
    "except", "yield", "async", "await", "None", "True", "False", "value", "result", "items",
    "config", "request", "response", "cache", "token", "page", "index", "count", "buffer",
    "session", "replica", "prefix", "=", "==", "+=", "(", ")", ":", ",", ".", "[", "]", "0",
    "1", "x", "y", "n", "path", "len", "dict", "list", "str", "int", "assert", "raise",
)


def synthetic_text(key: str, n_tokens: int) -> str:
    """Deterministic pseudo-code of exactly ``4 * n_tokens`` ASCII characters for ``key``."""
    if n_tokens <= 0:
        return ""
    rng = random.Random(key)  # str seeds hash with SHA-512: stable across runs and hosts
    target = CHARS_PER_TOKEN * n_tokens
    lines: list[str] = []
    size = 0
    while size < target:
        line = "    " * rng.randrange(4) + " ".join(rng.choices(_WORDS, k=rng.randint(3, 12))) + "\n"
        lines.append(line)
        size += len(line)
    return "".join(lines)[:target]


@lru_cache(maxsize=8)
def _shared_text(key: str, n_tokens: int) -> str:
    return synthetic_text(key, n_tokens)


def count_tokens(text: str) -> int:
    """Token count under a ~4 characters/token tokenizer."""
    return (len(text.encode("utf-8")) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


# --------------------------------------------------------------------------------------
# Structure
# --------------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class Segment:
    """One chat message. ``key`` names its content: equal key = equal text. Immutable by use."""

    role: str
    tokens: int
    key: str
    _text: str | None = field(default=None, repr=False)
    shared: bool = False  # same text in every session (the system prompt)

    def text(self) -> str:
        if self._text is None:
            self._text = (_shared_text if self.shared else synthetic_text)(self.key, self.tokens)
        return self._text

    def message(self) -> dict[str, str]:
        return {"role": self.role, "content": self.text()}


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """One request of a session. ``segments`` is the source of truth; ``messages`` renders it."""

    session_id: str
    turn_index: int
    branch_index: int
    n_branches: int
    segments: tuple[Segment, ...]
    max_tokens: int
    expected_output_tokens: int
    think_time_s: float  # model-time pause before this request (same for all branches of a turn)
    is_edit: bool
    edit_message_index: int | None  # index in segments of the rewritten message
    compacted: bool  # history was compacted just before this turn
    new_tokens: int  # this request's own new user/tool message
    reused_tokens: int  # leading tokens identical to the previous turn's history (cacheable)

    @property
    def prompt_tokens(self) -> int:
        return sum(s.tokens for s in self.segments)

    @property
    def messages(self) -> list[dict[str, str]]:
        return [s.message() for s in self.segments]


ReplyLike = Union[str, int, None]


def reply_as_segment(key: str, req: TurnRequest, reply: ReplyLike) -> Segment:
    """A reply as an assistant segment: the server's text, a token count, or (None, a failed
    request) the expected length."""
    if isinstance(reply, str):
        return Segment("assistant", count_tokens(reply), key, _text=reply)
    tokens = req.expected_output_tokens if reply is None else int(reply)
    return Segment("assistant", tokens, key)


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
            self._history = list(req.segments) + [self.reply_segment(req, replies[self._chosen])]
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
        reused = sum(s.tokens for s in history)
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
        if sum(s.tokens for s in history) + need > cfg.max_context_tokens:
            if cfg.on_context_full == "end":
                return []
            self.compactions += 1
            summary = Segment("user", cfg.compact_summary_tokens, f"{self.session_id}/compact{self.compactions}")
            history = self._base + ([summary] if summary.tokens > 0 else [])
            reused = sum(s.tokens for s in self._base)
            compacted = True
            is_edit, edit_index = False, None
            if sum(s.tokens for s in history) + need > cfg.max_context_tokens:
                return []  # even a fresh context cannot hold this turn

        self._history = history
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


def session_id_for(config: WorkloadConfig, seed: int, index: int) -> str:
    return f"{config.name}-{seed}-{index:06d}"


def make_session(config: WorkloadConfig, seed: int, index: int) -> Session:
    """Session ``index`` of a run: its own generator, so it does not depend on run order."""
    return Session(config, random.Random(f"{seed}:{index}"), session_id_for(config, seed, index))


# --------------------------------------------------------------------------------------
# Offline summary
# --------------------------------------------------------------------------------------


def _quantile(xs: Sequence[float], q: float) -> float:
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
        "input_p10": _quantile(inputs, 0.1),
        "input_p50": _quantile(inputs, 0.5),
        "input_p90": _quantile(inputs, 0.9),
        "mean_output_tokens": mean_out,
        "output_p50": _quantile(outputs, 0.5),
        "input_output_ratio": mean_in / mean_out if mean_out else float("inf"),
        "mean_turns_per_session": statistics.fmean(turns) if turns else 0.0,
        "median_turns_per_session": _quantile(turns, 0.5),
        "requests_per_session": len(inputs) / n_sessions if n_sessions else 0.0,
        "branch_turn_fraction": n_branch_turns / n_turns if n_turns else 0.0,
        "edit_turn_fraction": n_edit_turns / n_turns if n_turns else 0.0,
        "compactions_per_session": compactions / n_sessions if n_sessions else 0.0,
        "think_p50_s": _quantile(thinks, 0.5),
        "think_p90_s": _quantile(thinks, 0.9),
        "reusable_prefix_fraction": reused / prompt if prompt else 0.0,
    }
