"""The simulated replica's inference endpoints: ``/generate``, ``/v1/chat/completions`` and
``/v1/completions``, whole or streamed. Bodies are parsed by ``sim_requests``, answers shaped by
``sim_responses``; a handler that exits before its request finished aborts it in the model.
On a disaggregated (PD) replica a request is admitted through ``sim_disagg``'s bootstrap rules
first."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
from aiohttp import web

from . import sim_responses as out
from .sim_disagg import BootstrapError, bootstrap_fields, fetch_room
from .sim_replica import SimError, SimReplica, SimReq
from .sim_requests import Submission, parse_chat, parse_completions, parse_generate, read_json


def _include_usage(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options") or {}
    return bool(isinstance(opts, dict) and opts.get("include_usage"))


class InferenceHandlers:
    def __init__(self, sim: SimReplica) -> None:
        self.sim = sim
        self._http: aiohttp.ClientSession | None = None  # decode side: the bootstrap client

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def _submit(self, s: Submission, body: dict[str, Any]) -> SimReq:
        sim = self.sim
        room: int | None = None
        transferred_cached: int | None = None
        if sim.disagg.enabled:
            try:
                host, port, room = bootstrap_fields(body, sim.disagg)
            except ValueError as exc:
                raise SimError(str(exc)) from exc
        rank = sim.choose_rank(body.get("routed_dp_rank"), room)
        if room is not None and sim.disagg.mode == "decode":
            transferred_cached = await self._receive_kv(host, port, room)
            room = None
        return sim.submit(
            prompt_text=s.prompt_text,
            input_ids=s.input_ids,
            max_new_tokens=s.max_new_tokens,
            ignore_eos=s.ignore_eos,
            rid=s.rid,
            namespace=sim.namespace(body),
            stream=bool(body.get("stream")),
            room=room,
            transferred_cached=transferred_cached,
            rank=rank,
        )

    async def _receive_kv(self, host: str, port: int, room: int) -> int:
        """Decode side: wait for the prefill half, then for the KV transfer; returns the
        prefill side's cached tokens."""
        sim = self.sim
        if self._http is None:
            self._http = aiohttp.ClientSession()
        try:
            result = await fetch_room(self._http, host, port, room, sim.disagg.bootstrap_timeout_s)
        except BootstrapError as exc:
            raise SimError(str(exc), status=500) from exc
        transfer = sim.disagg.transfer_seconds(result.prompt_tokens, sim.profile.kv_bytes_per_token)
        await asyncio.sleep(transfer / sim.time_scale)
        return result.cached_tokens

    def _usage(self, st: SimReq, completion_tokens: int | None = None) -> dict[str, Any]:
        return out.usage(st, self.sim.enable_cache_report, completion_tokens)

    # ---- /generate --------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        sim = self.sim
        try:
            body = await read_json(request)
            st = await self._submit(parse_generate(body), body)
        except SimError as exc:
            return out.native_error(str(exc), exc.status)
        try:
            if body.get("stream"):
                resp = await out.start_stream(request)
                sent_final = False
                async for n in sim.progress(st):
                    sent_final = st.finished is not None and n >= st.output_len
                    await resp.write(out.sse(out.generate_obj(sim, st, None if sent_final else n)))
                if not sent_final:
                    await resp.write(out.sse(out.generate_obj(sim, st, None)))
                await resp.write(out.SSE_DONE)
                await resp.write_eof()
                return resp
            await sim.wait(st)
            return out.json_response(out.generate_obj(sim, st, None))
        finally:
            sim.release(st)

    # ---- OpenAI -----------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        sim = self.sim
        try:
            body = await read_json(request)
            st = await self._submit(parse_chat(body), body)
        except SimError as exc:
            return out.openai_error(str(exc), exc.status)
        model = body.get("model") or sim.served_model_name
        created = int(time.time())
        try:
            if body.get("stream"):
                return await self._chat_stream(request, st, body, model, created)
            await sim.wait(st)
            n = out.output_tokens(st)
            return out.json_response(out.chat_completion(st, model, created, n, self._usage(st, n)))
        finally:
            sim.release(st)

    async def _chat_stream(
        self, request: web.Request, st: SimReq, body: dict[str, Any], model: str, created: int
    ) -> web.StreamResponse:
        resp = await out.start_stream(request)
        last = 0
        first = True
        async for n in self.sim.progress(st):
            if first:
                await resp.write(out.chat_chunk(st, model, created, {"role": "assistant", "content": ""}))
                first = False
            await resp.write(out.chat_chunk(st, model, created, {"content": st.output_chars(last, n)}))
            last = n
        finish, matched = out.openai_finish(st)
        await resp.write(out.chat_chunk(st, model, created, {}, finish, matched))
        if _include_usage(body):
            await resp.write(out.chat_usage_chunk(st, model, created, self._usage(st, last)))
        await resp.write(out.SSE_DONE)
        await resp.write_eof()
        return resp

    async def completions(self, request: web.Request) -> web.StreamResponse:
        sim = self.sim
        try:
            body = await read_json(request)
            st = await self._submit(parse_completions(body), body)
        except SimError as exc:
            return out.openai_error(str(exc), exc.status)
        model = body.get("model") or sim.served_model_name
        created = int(time.time())
        try:
            if body.get("stream"):
                resp = await out.start_stream(request)
                last = 0
                async for n in sim.progress(st):
                    text = st.output_chars(last, n)
                    await resp.write(out.sse(out.text_completion(st, model, created, text, None, None, None)))
                    last = n
                finish, matched = out.openai_finish(st)
                await resp.write(out.sse(out.text_completion(st, model, created, "", finish, matched, None)))
                if _include_usage(body):
                    u = out.text_completion(st, model, created, "", None, None, self._usage(st, last))
                    u["choices"] = []
                    await resp.write(out.sse(u))
                await resp.write(out.SSE_DONE)
                await resp.write_eof()
                return resp
            await sim.wait(st)
            finish, matched = out.openai_finish(st)
            n = out.output_tokens(st)
            text = st.output_chars(0, n)
            return out.json_response(out.text_completion(st, model, created, text, finish, matched, self._usage(st, n)))
        finally:
            sim.release(st)
