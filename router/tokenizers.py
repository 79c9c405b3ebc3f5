"""Token ids of a request, for the exact KV index: pluggable, because only the deployment knows
its model's chat template and tokenizer.

A tokenizer plug-in is any function `(route, body) -> list[int] | None` returning the token ids
the engine will prefill for that request (None when it cannot tell), named in the config as
`kv_events.tokenizer: module:function`. With Hugging Face, for example:

    tok = AutoTokenizer.from_pretrained("moonshotai/Kimi-K2-Instruct")
    def token_ids(route, body):
        if route == "/v1/chat/completions":
            return tok.apply_chat_template(body["messages"], tools=body.get("tools"),
                                           add_generation_prompt=True, tokenize=True)
        return input_ids(route, body)

It runs on the event loop for every request, so it must be fast (no I/O).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

Tokenizer = Callable[[str, dict[str, Any]], "list[int] | None"]


def input_ids(route: str, body: dict[str, Any]) -> list[int] | None:
    """The default: token ids only when the client sent them (`/generate` `input_ids`)."""
    ids = body.get("input_ids") if route == "/generate" else None
    if isinstance(ids, list) and ids and all(type(t) is int and 0 <= t < 2**32 for t in ids):
        return ids
    return None


def load_tokenizer(path: str) -> Tokenizer:
    """Import `module:function`; ValueError (naming the path) if that fails."""
    module_name, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import tokenizer {path!r}: {err}") from None
    if not callable(fn):
        raise ValueError(f"tokenizer {path!r} is not callable")
    return fn
