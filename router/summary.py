"""Build the small `RequestSummary` a policy needs from a parsed request body.

Parses only what routing uses; the body bytes themselves are forwarded untouched.
"""

from __future__ import annotations

from typing import Any

from ..policies.base import RequestSummary

CHARS_PER_TOKEN = 4  # rough estimate when the client sends text, not token ids


def _text_len(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):  # OpenAI content parts / batched prompts
        return sum(_text_len(v.get("text", "") if isinstance(v, dict) else v) for v in value)
    return 0


def estimate_prompt_tokens(route: str, body: dict[str, Any]) -> int:
    if route == "/v1/chat/completions":
        messages = body.get("messages")
        if isinstance(messages, list):
            chars = sum(_text_len(m.get("content")) for m in messages if isinstance(m, dict))
            return chars // CHARS_PER_TOKEN
        return 0
    if route == "/generate":
        ids = body.get("input_ids")
        if isinstance(ids, list):
            return len(ids)
        return _text_len(body.get("text")) // CHARS_PER_TOKEN
    return _text_len(body.get("prompt")) // CHARS_PER_TOKEN


def summarize(route: str, body: dict[str, Any]) -> RequestSummary:
    model = body.get("model")
    return RequestSummary(
        route=route,
        prompt_tokens=estimate_prompt_tokens(route, body),
        model=model if isinstance(model, str) else None,
    )


def wants_stream(body: dict[str, Any]) -> bool:
    return body.get("stream") is True
