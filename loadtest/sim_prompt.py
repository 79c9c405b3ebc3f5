"""What a simulated replica prefills: the chat template it renders and the token ids it hashes.

Chat messages are rendered with a fixed ChatML-like template and tokenized with
``loadtest/tokenizer.encode``. ``kv_token_ids`` is also a router tokenizer plug-in, so the
router's block hashes equal the ones the simulated replica publishes.
"""

from __future__ import annotations

from typing import Any

import orjson

from . import tokenizer


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                if part.get("type") == "text" or "text" in part:
                    parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return str(content)


def render_chat(messages: list[dict[str, Any]], tools: Any = None) -> str:
    """Deterministic ChatML-style rendering, ending with the assistant prefix.

    Turn 1 rendered + its reply is a text prefix of turn 2 rendered (reply then ``<|im_end|>``).
    """
    out: list[str] = []
    if tools:
        out.append("<|im_start|>tools\n" + orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode() + "<|im_end|>\n")
    for m in messages:
        role = str(m.get("role", "user"))
        text = _content_text(m.get("content"))
        if m.get("tool_calls"):
            text += orjson.dumps(m["tool_calls"], option=orjson.OPT_SORT_KEYS).decode()
        out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def kv_token_ids(route: str, body: dict[str, Any]) -> list[int] | None:
    """The token ids this simulated replica prefills for a request, or None if unknown.

    A router tokenizer plug-in (``kv_events.tokenizer: kvrouter.loadtest.sim_prompt:kv_token_ids``):
    same chat template and tokenizer as the replica's handlers, so the router's block hashes equal
    the ones this replica publishes.
    """
    ids: Any = None
    if route == "/v1/chat/completions":
        messages = body.get("messages")
        if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
            return tokenizer.encode(render_chat(messages, body.get("tools")))
        return None
    if route == "/v1/completions":
        ids = body.get("prompt")
        if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], (str, list)):
            ids = ids[0]
    elif route == "/generate":
        ids = body.get("input_ids") if body.get("input_ids") is not None else body.get("text")
    if isinstance(ids, str):
        return tokenizer.encode(ids)
    if isinstance(ids, list) and ids and all(type(t) is int for t in ids):
        return ids
    return None
