"""Build the small `RequestSummary` a policy needs from a parsed request body.

Parses only what routing uses; the body bytes themselves are forwarded untouched.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..policies.base import RequestSummary
from .config import RoutingConfig
from .prefix import block_hashes, namespace, prompt_bytes, session_key

BYTES_PER_TOKEN = 4  # ~4 characters per token for code and English; token ids are 4 bytes each


def summarize(
    route: str, body: dict[str, Any], headers: Mapping[str, str], config: RoutingConfig
) -> RequestSummary:
    model = body.get("model")
    data = prompt_bytes(route, body)
    return RequestSummary(
        route=route,
        session_key=session_key(headers, body, config.session_headers, config.session_fields),
        prompt_tokens=len(data) // BYTES_PER_TOKEN,
        model=model if isinstance(model, str) else None,
        prefix_blocks=block_hashes(data, namespace(body), config.block_chars),
    )
