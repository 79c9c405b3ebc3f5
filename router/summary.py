"""Build the small `RequestSummary` a policy needs from a parsed request body.

Parses only what routing uses; the body bytes themselves are forwarded untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..policies.domain import RequestSummary
from .config import RoutingConfig
from .prefix import namespace, prompt_bytes_and_boundaries, session_key, text_block_hashes
from .prefix_chain import PrefixChains

BYTES_PER_TOKEN = 4  # ~4 characters per token for code and English; token ids are 4 bytes each


# (route, body) -> (prompt tokens, SGLang block hashes) or None: see kv_index_exact.request_blocks.
ExactBlocks = Callable[[str, dict[str, Any]], "tuple[int, tuple[int, ...]] | None"]


def summarize(
    route: str,
    body: dict[str, Any],
    headers: Mapping[str, str],
    config: RoutingConfig,
    exact: ExactBlocks | None = None,
    bytes_per_token: float = BYTES_PER_TOKEN,
    chains: PrefixChains | None = None,
) -> tuple[RequestSummary, int]:
    """The request's summary, and the size of the prompt text its tokens were estimated from:
    what calibration divides by the reported prompt tokens (0 when there is nothing to calibrate:
    token ids, or an exact tokenizer count).

    With `exact` (KV events on), prefix blocks are SGLang's block hashes of the request's token
    ids, or none when its tokenizer cannot tell: text blocks would match nothing in the exact
    index, so such a request is placed on session affinity and load alone. Otherwise the prompt
    size is its bytes over `bytes_per_token` (calibrated per model, router/learning.py).
    With `chains`, a prompt that extends a recent one has only its new bytes hashed (and, for
    a chat request, only its new messages rendered)."""
    model = body.get("model")
    key = session_key(headers, body, config.session_headers, config.session_fields)
    exact_blocks = exact(route, body) if exact is not None else None
    text_bytes = 0
    if exact_blocks is not None:
        prompt_tokens, blocks = exact_blocks
    elif chains is not None and exact is None and route == "/v1/chat/completions":
        blocks, text_bytes = chains.chat_block_hashes(body, None, config.block_chars, key)
        prompt_tokens = int(text_bytes / bytes_per_token)
    else:
        data, boundaries = prompt_bytes_and_boundaries(route, body)
        if route == "/generate" and isinstance(body.get("input_ids"), list):
            prompt_tokens = len(data) // BYTES_PER_TOKEN  # token ids, 4 bytes each
        else:
            prompt_tokens = int(len(data) / bytes_per_token)
            text_bytes = len(data)
        if exact is not None:
            blocks = ()
        elif chains is not None:
            blocks = chains.block_hashes(data, namespace(body), config.block_chars, key, boundaries)
        else:
            blocks = text_block_hashes(data, namespace(body), config.block_chars)
    summary = RequestSummary(
        route=route,
        session_key=key,
        prompt_tokens=prompt_tokens,
        model=model if isinstance(model, str) else None,
        prefix_blocks=blocks,
        streamed=body.get("stream") is True,
    )
    return summary, text_bytes
