"""The simulated replica's request bodies: parsed and validated as SGLang does, before the model
sees them. Anything SGLang would reject raises :class:`SimError` (the handlers answer 400)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from .sim_prompt import render_chat
from .sim_replica import SimError

GENERATE_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang SamplingParams default
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI / SGLang CompletionRequest default


@dataclass(frozen=True, slots=True)
class Submission:
    """A valid request, as `SimReplica.submit` takes it (the namespace comes from the body)."""

    prompt_text: str | None
    input_ids: list[int] | None
    max_new_tokens: int | None
    ignore_eos: bool
    rid: str | None


async def read_json(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise SimError(f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise SimError("The request body must be a JSON object.")
    return body


def int_field(body: dict[str, Any], *names: str) -> int | None:
    """The first of `names` present in `body`, which must be an integer."""
    for name in names:
        v = body.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise SimError(f"{name} must be an integer, got {v!r}")
        return v
    return None


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _rid(body: dict[str, Any]) -> str | None:
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise SimError("rid must be a string.")
    return rid


def parse_generate(body: dict[str, Any]) -> Submission:
    """SGLang's native ``/generate``: one ``text`` or ``input_ids`` prompt, ``sampling_params``."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list) or (isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list)):
        raise SimError("Batch requests are not supported by the simulated replica.")
    if text is None and input_ids is None:
        raise SimError("Either text, input_ids or input_embeds should be provided.")
    if text is not None and not isinstance(text, str):
        raise SimError("text must be a string.")
    if input_ids is not None and not _is_token_ids(input_ids):
        raise SimError("input_ids must be a list of integers.")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise SimError("sampling_params must be an object.")
    max_new = int_field(sp, "max_new_tokens")
    if max_new is None:
        max_new = GENERATE_DEFAULT_MAX_NEW_TOKENS
    rid = _rid(body)
    return Submission(text if input_ids is None else None, input_ids, max_new,
                      bool(sp.get("ignore_eos", False)), rid)


def _openai_common(body: dict[str, Any]) -> tuple[int | None, bool, str | None]:
    n = body.get("n")
    if n not in (None, 1):
        raise SimError("n > 1 is not supported by the simulated replica.")
    max_tokens = int_field(body, "max_completion_tokens", "max_tokens")
    return max_tokens, bool(body.get("ignore_eos", False)), _rid(body)


def parse_chat(body: dict[str, Any]) -> Submission:
    """``/v1/chat/completions``: the messages rendered with the replica's chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise SimError("messages must be a non-empty list of message objects.")
    max_tokens, ignore_eos, rid = _openai_common(body)
    return Submission(render_chat(messages, body.get("tools")), None, max_tokens, ignore_eos, rid)


def parse_completions(body: dict[str, Any]) -> Submission:
    """``/v1/completions``: one prompt, as a string or token ids (a one-element list of either)."""
    prompt = body.get("prompt")
    text: str | None = None
    ids: list[int] | None = None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and prompt and _is_token_ids(prompt):
        ids = prompt
    else:
        raise SimError("prompt must be a string or a list of token ids (one prompt).")
    max_tokens, ignore_eos, rid = _openai_common(body)
    if max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    return Submission(text, ids, max_tokens, ignore_eos, rid)
