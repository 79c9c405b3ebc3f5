"""Reading one streamed chat completion (OpenAI SSE) into a :class:`RequestRecord`.

A request is ok only with a final ``data: [DONE]`` and no SSE error event. Measured: TTFT (send ->
first chunk carrying content, else the first chunk, else the end), mean inter-token latency, e2e,
usage (prompt, completion and ``prompt_tokens_details.cached_tokens``). Durations are multiplied by
``time_scale`` so they are in model time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from .report import RequestRecord
from .turn_request import count_tokens

__all__ = ["read_chat_stream"]


async def read_chat_stream(
    resp: aiohttp.ClientResponse,
    rec: RequestRecord,
    sent: float,
    now: Callable[[], float],
    time_scale: float,
) -> str | None:
    """Fill ``rec`` from the SSE body of ``resp`` (sent at ``now()`` == ``sent``); returns the reply
    text, or None (with ``rec.error`` set) when the stream failed."""
    ts = time_scale
    parts: list[str] = []
    first_chunk = first_token = last_token = None
    usage: dict[str, Any] | None = None
    done = False
    buf = b""
    async for data in resp.content.iter_any():
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event:/id: fields
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            event = orjson.loads(payload)
            if not isinstance(event, dict):
                continue
            if event.get("error") is not None:
                rec.error = f"SSE error: {str(event['error'])[:200]}"
                return None
            t = now()
            for choice in event.get("choices") or ():
                if first_chunk is None:
                    first_chunk = t
                delta = choice.get("delta") or {}
                content = delta.get("content") or delta.get("reasoning_content")
                if content:
                    if first_token is None:
                        first_token = t
                    last_token = t
                    parts.append(content)
            if event.get("usage"):
                usage = event["usage"]
    end = now()
    if not done:
        rec.error = "stream ended before data: [DONE]"
        return None
    text = "".join(parts)
    completion = count_tokens(text)
    if usage:
        rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
        completion = int(usage.get("completion_tokens") or completion)
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = int(details.get("cached_tokens") or 0)
    rec.completion_tokens = completion
    first = first_token if first_token is not None else first_chunk
    rec.ttft_s = ((first if first is not None else end) - sent) * ts
    rec.e2e_s = (end - sent) * ts
    if first_token is not None and last_token is not None and completion > 1 and last_token > first_token:
        rec.itl_s = (last_token - first_token) / (completion - 1) * ts
    rec.ok = True
    return text
