"""Response bodies of the simulated replica, shaped as SGLang's: OpenAI objects and chunks,
native ``/generate`` objects, error bodies and server-sent events."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from . import timing, tokenizer

if TYPE_CHECKING:
    from .sim_replica import SimReplica, SimReq

EOS_TOKEN_ID = 163586  # what `matched_stop` reports for a natural stop
WEIGHT_VERSION = "default"  # ServerArgs.weight_version's default
SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


def native_error(message: str, status: int = 400) -> web.Response:
    """SGLang's ``_create_error_response``: ``{"error": {"message": ...}}``."""
    return json_response({"error": {"message": message}}, status)


def openai_error(message: str, status: int = 400, type_: str = "Bad Request", param: str | None = None) -> web.Response:
    """SGLang's OpenAI ``ErrorResponse``."""
    return json_response(
        {"object": "error", "message": message, "type": type_, "param": param, "code": status},
        status,
    )


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def start_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await resp.prepare(request)
    return resp


def output_tokens(st: SimReq) -> int:
    """Output tokens a final (non-streamed) answer carries: all of them, or those emitted before
    an abort."""
    return st.output_len if st.finished is not None else st.emitted


# -- OpenAI ----------------------------------------------------------------------------------------
def usage(st: SimReq, enable_cache_report: bool, completion_tokens: int | None = None) -> dict[str, Any]:
    ct = st.output_len if completion_tokens is None else completion_tokens
    return {  # protocol.UsageInfo, field for field (reasoning_tokens is top level there)
        "prompt_tokens": st.prompt_len,
        "total_tokens": st.prompt_len + ct,
        "completion_tokens": ct,
        "prompt_tokens_details": (
            {"cached_tokens": st.cached_tokens} if enable_cache_report else None
        ),
        "reasoning_tokens": 0,
    }


def openai_finish(st: SimReq) -> tuple[str, Any]:
    """(finish_reason, matched_stop)."""
    if st.aborted is not None:
        return "abort", None
    if st.finish_kind == "stop":
        return "stop", EOS_TOKEN_ID
    return "length", None


def chat_completion(st: SimReq, model: str, created: int, n: int, usage_obj: dict[str, Any]) -> dict[str, Any]:
    """The whole ``chat.completion`` after `n` output tokens."""
    finish, matched = openai_finish(st)
    return {
        "id": st.rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": st.output_chars(0, n),
                    "reasoning_content": None,
                    "tool_calls": None,
                },
                "logprobs": None,
                "finish_reason": finish,
                "matched_stop": matched,
            }
        ],
        "usage": usage_obj,
    }


def chat_chunk(st: SimReq, model: str, created: int, delta: dict[str, Any],
               finish: str | None = None, matched: Any = None) -> bytes:
    """One ``chat.completion.chunk`` event; fields the delta leaves out are null."""
    full = {"role": None, "content": None, "reasoning_content": None, "tool_calls": None}
    full.update(delta)
    return sse(
        {
            "id": st.rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [
                {"index": 0, "delta": full, "logprobs": None,
                 "finish_reason": finish, "matched_stop": matched}
            ],
            "usage": None,
        }
    )


def chat_usage_chunk(st: SimReq, model: str, created: int, usage_obj: dict[str, Any]) -> bytes:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    return sse({
        "id": st.rid, "object": "chat.completion.chunk", "created": created,
        "model": model, "choices": [], "usage": usage_obj,
    })


def text_completion(st: SimReq, model: str, created: int, text: str, finish: str | None,
                    matched: Any, usage_obj: Any) -> dict[str, Any]:
    """A ``text_completion`` object (whole answer or one streamed chunk)."""
    return {
        "id": st.rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None,
                     "finish_reason": finish, "matched_stop": matched}],
        "usage": usage_obj,
    }


# -- native /generate ------------------------------------------------------------------------------
def native_finish(st: SimReq) -> dict[str, Any] | None:
    if st.aborted is not None:
        return {"type": "abort", "message": st.aborted, "status_code": None, "err_type": None}
    if st.finished is None:
        return None
    if st.finish_kind == "stop":
        return {"type": "stop", "matched": EOS_TOKEN_ID}
    return {"type": "length", "length": st.output_len}


def retractions(sim: SimReplica, st: SimReq) -> int:
    """The request's retraction count so far (TokenizerManager: meta_info total_retractions)."""
    if st.finished is not None:
        return st.finished.retractions
    return sim.models[st.rank].retractions_of(st.rid)


def generate_obj(sim: SimReplica, st: SimReq, n: int | None) -> dict[str, Any]:
    """The /generate object after n output tokens; n=None: final (finished or aborted)."""
    final = n is None
    if final:
        n = output_tokens(st)
    text = st.output_chars(0, n)
    # TokenizerManager._handle_batch_output: these keys always; e2e_latency and the speculative
    # figures only once the request has a finish reason.
    meta: dict[str, Any] = {
        "id": st.rid,
        "finish_reason": native_finish(st) if final else None,
        "prompt_tokens": st.prompt_len,
        "weight_version": WEIGHT_VERSION,
        "total_retractions": retractions(sim, st),
        "completion_tokens": n,
        "cached_tokens": st.cached_tokens,
    }
    if final:
        p = sim.profile
        if p.spec_verify_tokens > 1:
            meta.update(spec_meta(p, n))
        end = st.finished.time if st.finished is not None else sim.now()
        meta["e2e_latency"] = end - st.submit_time
    return {"text": text, "output_ids": tokenizer.encode(text, chars_per_token=sim.chars_per_token), "meta_info": meta}


def spec_meta(p: Any, completion_tokens: int) -> dict[str, Any]:
    """_calculate_spec_decoding_metrics: verify passes after the prefill's token, the drafts
    they accepted, and length = completion tokens per verify pass."""
    verify_ct = timing.steps_to_reach(p, 1, completion_tokens)
    meta: dict[str, Any] = {"spec_accept_rate": 0.0, "spec_accept_length": 0, "spec_verify_ct": verify_ct}
    drafts = verify_ct * (p.spec_verify_tokens - 1)
    if verify_ct > 0 and drafts > 0:
        accepted = max(0, completion_tokens - 1 - verify_ct)
        meta.update({
            "spec_accept_rate": accepted / drafts,
            "spec_accept_length": completion_tokens / verify_ct,
            "spec_accept_token_num": accepted,
            "spec_draft_token_num": drafts,
        })
    return meta
