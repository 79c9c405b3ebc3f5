"""Read the usage a replica reports with its response: prompt tokens and cached prompt tokens.

Shapes (SGLang): OpenAI routes carry `usage.prompt_tokens` and, with `--enable-cache-report`,
`usage.prompt_tokens_details.cached_tokens` (null without it); a stream carries them in one
usage-only event (`"choices":[]`) just before `data: [DONE]` when the request set
`stream_options.include_usage`. `/generate` carries `meta_info.prompt_tokens` and
`meta_info.cached_tokens` in its body, and in every event of a stream (the last one is final).

Nothing here raises on bad input: what cannot be read comes back as a reason string, which the
caller counts, and the response goes on unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from .json_splice import SplicedBody, with_member
from ..policies.slots import slot_filler

OPENAI_ROUTES = ("/v1/chat/completions", "/v1/completions")
# A usage-only stream event, as SGLang (pydantic) and the simulated replica (orjson) write it:
# compact JSON. Inside a JSON string the quotes would be escaped, so content never matches.
USAGE_EVENT_MARKER = b'"choices":[]'
# The same event from a server writing JSON with Python's default separators (json.dumps).
SPACED_USAGE_EVENT_MARKER = b'"choices": []'
_MAX_TOKENS = 1 << 40
log = logging.getLogger("kvrouter.usage")

if TYPE_CHECKING:
    from .placement import Placement


@dataclass(frozen=True, slots=True)
class UsageReport:
    prompt_tokens: int
    cached_tokens: int | None  # None: the replica does not report its cache hits
    completion_tokens: int | None = None  # None: not reported (or not a count)


_fill_report = slot_filler(UsageReport, tuple(f.name for f in dataclasses.fields(UsageReport)))


def _must_ask_stream_usage(route: str, body: dict[str, Any]) -> bool:
    """A streaming OpenAI request whose client did not ask for the usage event. A
    `stream_options` that is not an object is left for the replica to refuse."""
    if route not in OPENAI_ROUTES or body.get("stream") is not True:
        return False
    options = body.get("stream_options")
    return options is None or (isinstance(options, dict) and not options.get("include_usage"))


def _asked_options(body: dict[str, Any]) -> dict[str, Any]:
    options = body.get("stream_options")
    return {**options, "include_usage": True} if isinstance(options, dict) else {"include_usage": True}


def ask_stream_usage(route: str, body: dict[str, Any]) -> bool:
    """Make a streaming OpenAI request whose client did not ask for the usage event ask for it
    (in place); True if it did, so the relay drops that event again."""
    if not _must_ask_stream_usage(route, body):
        return False
    body["stream_options"] = _asked_options(body)
    return True


def body_asking_stream_usage(
    route: str, body: dict[str, Any], raw: bytes
) -> bytes | SplicedBody | None:
    """The request bytes to send when the router asks for the stream's usage event (as
    `ask_stream_usage` on the parsed `body`, which is left unchanged), or None: send `raw` as it
    is. The asking `stream_options` member is added after the client's own bytes, which are
    neither re-serialized nor copied."""
    if not _must_ask_stream_usage(route, body):
        return None
    if "stream_options" in body:  # rare: re-serialize, so no strict parser sees the key twice
        return orjson.dumps({**body, "stream_options": _asked_options(body)})
    return with_member(raw, b'"stream_options":' + orjson.dumps(_asked_options(body)))


def _count(value: Any) -> int | str:
    """A token count, or the reason it is not one."""
    if isinstance(value, bool) or not isinstance(value, int):
        return "garbage"
    if value < 0:
        return "negative"
    if value > _MAX_TOKENS:
        return "garbage"
    return value


def _report(prompt: Any, cached: Any, completion: Any = None) -> UsageReport | str:
    p = _count(prompt)
    if isinstance(p, str):
        return p
    out = _count(completion)  # only logged: a bad one is left out, not held against the usage
    out_tokens = out if isinstance(out, int) else None
    if cached is None:
        return UsageReport(p, None, out_tokens)
    c = _count(cached)
    if isinstance(c, str):
        return c
    if c > p:
        return "garbage"  # more cached than the prompt: not a usage this router can trust
    return UsageReport(p, c, out_tokens)


def from_usage(usage: Any) -> UsageReport | str:
    """An OpenAI `usage` object."""
    if type(usage) is dict:  # a well-formed one, as the checks below would find it, in one pass
        prompt, out = usage.get("prompt_tokens"), usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if type(details) is dict else None
        if (type(prompt) is int and 0 <= prompt <= _MAX_TOKENS
                and (out is None or type(out) is int and 0 <= out <= _MAX_TOKENS)
                and (details is None or type(details) is dict)
                and (cached is None or type(cached) is int and 0 <= cached <= prompt)):
            return _fill_report((prompt, cached, out))  # (every response's: no frozen __init__)
    if usage is None:
        return "missing"
    if not isinstance(usage, dict):
        return "garbage"
    if "prompt_tokens" not in usage:
        return "missing"
    details = usage.get("prompt_tokens_details")
    if details is not None and not isinstance(details, dict):
        return "garbage"
    return _report(usage["prompt_tokens"], details.get("cached_tokens") if details else None,
                   usage.get("completion_tokens"))


def from_meta_info(meta: Any) -> UsageReport | str:
    """A `/generate` `meta_info` object."""
    if meta is None:
        return "missing"
    if not isinstance(meta, dict):
        return "garbage"
    if "prompt_tokens" not in meta:
        return "missing"
    return _report(meta["prompt_tokens"], meta.get("cached_tokens"), meta.get("completion_tokens"))


def from_object(route: str, obj: Any) -> UsageReport | str:
    """The usage of one parsed response object (a whole body or one stream event)."""
    if not isinstance(obj, dict):
        return "garbage"
    if route == "/generate":
        return from_meta_info(obj.get("meta_info"))
    return from_usage(obj.get("usage"))


def from_body(route: str, payload: bytes) -> UsageReport | str:
    """The usage of a whole (non-streamed) JSON body."""
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return "garbage"
    if isinstance(obj, list):  # a batch /generate: not one prompt's usage
        return "batch"
    return from_object(route, obj)


def _event_json(event: bytes) -> Any:
    """The JSON of an SSE event's data lines, or None."""
    lines = [ln[5:].strip() for ln in event.splitlines() if ln.startswith(b"data:")]
    if not lines:
        return None
    data = b"\n".join(lines)
    if data == b"[DONE]":
        return None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return _GARBAGE


_GARBAGE = object()


def _events(data: bytes) -> list[bytes]:
    """The SSE events of `data`, separators kept (a trailing partial event last)."""
    out: list[bytes] = []
    start, n = 0, len(data)
    while start < n:
        lf, crlf = data.find(b"\n\n", start), data.find(b"\r\n\r\n", start)
        ends = [e for e in (lf + 2 if lf >= 0 else -1, crlf + 4 if crlf >= 0 else -1) if e >= 0]
        end = min(ends) if ends else n
        out.append(data[start:end])
        start = end
    return out


def holds_usage_event(data: bytes) -> bool:
    """`data` may hold a usage-only event (compact or spaced JSON): worth parsing."""
    return USAGE_EVENT_MARKER in data or SPACED_USAGE_EVENT_MARKER in data


def take_usage_event(route: str, data: bytes, drop: bool) -> tuple[bytes, UsageReport | str | None]:
    """In whole SSE events `data` holding a usage-event marker: the usage of the usage-only event
    (None if there is none after all) and the bytes to relay: without that event when `drop`
    (the router asked for it, the client did not)."""
    report: UsageReport | str | None = None
    kept: list[bytes] = []
    for event in _events(data):
        if holds_usage_event(event):
            obj = _event_json(event)
            if isinstance(obj, dict) and obj.get("choices") == [] and "usage" in obj:
                report = from_object(route, obj)
                if drop:
                    continue
        kept.append(event)
    if not drop or report is None:
        return data, report
    return b"".join(kept), report


def last_generate_usage(window: bytes) -> UsageReport | str:
    """The final `meta_info` of a `/generate` stream from its last relayed bytes."""
    for event in reversed(_events(window)):
        if b'"meta_info"' not in event:
            continue
        obj = _event_json(event)
        if obj is _GARBAGE:
            return "garbage"
        return from_object("/generate", obj)
    return "missing"


_USAGE_ROUTES = (*OPENAI_ROUTES, "/generate")


class UsageAccount:
    """One request's usage accounting: what the relay found of the replica's reported usage,
    handed to the placement that got the answer (None: not a 2xx answer, nothing to read)."""

    __slots__ = ("route", "prompt_bytes", "drop", "placement", "report")

    def __init__(self, route: str, prompt_bytes: int, drop: bool) -> None:
        self.route = route
        self.prompt_bytes = prompt_bytes
        self.drop = drop  # the router asked for the stream's usage event: take it out
        self.placement: Placement | None = None
        self.report: UsageReport | str | None = None

    def _give(self, report: UsageReport | str) -> None:
        placement, self.placement = self.placement, None  # once per request
        if placement is None or self.route not in _USAGE_ROUTES:
            return
        try:
            placement.reported(report, self.prompt_bytes)
        except Exception:  # learning is a side job: a fault in it never fails a response
            log.exception("learning from %s's reported usage failed", placement.url)

    def read_body(self, payload: bytes) -> None:
        if self.placement is not None and self.route in _USAGE_ROUTES:
            self._give(from_body(self.route, payload))

    def take_event(self, events: bytes) -> bytes:
        """Whole SSE events holding the usage-event marker: note the usage, return what the
        client gets."""
        kept, report = take_usage_event(self.route, events, self.drop)
        if report is not None:
            self.report = report
        return kept

    def stream_ended(self, sse: bool, window: bytes) -> None:
        """The stream ended cleanly; `window`: a /generate stream's last relayed bytes."""
        if self.placement is None or self.route not in _USAGE_ROUTES:
            return
        if not sse:
            self._give("unbuffered")
        elif self.route == "/generate":
            self._give(last_generate_usage(window))
        else:
            self._give(self.report if self.report is not None else "missing")
