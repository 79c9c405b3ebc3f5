"""Prefill/decode disaggregation for the simulated replica (SGLang's PD protocol, simulated).

SGLang (``python/sglang/srt/disaggregation/``) runs a request on two servers at once: the
router sends the same body, with ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``
added, to a prefill server and a decode server. The prefill server computes the prompt's KV
(using and filling its radix cache) and ships it to the decode server, which finds the prefill
side through the bootstrap server the prefill server runs on ``--disaggregation-bootstrap-port``
and pairs the two halves by room. A server started in either mode refuses a request without the
three fields (400).

Simulated here:

* prefill side: the request runs as a one-token generation (the prefill forward samples the
  first token; decoding happens elsewhere). Its radix cache is the one that holds the session's
  prefix. :class:`RoomBoard` records each room's outcome, and a small HTTP server on the
  bootstrap port answers ``GET /sim/rooms/{room}`` (long-poll) with it.
* decode side: :func:`receive_kv` asks ``bootstrap_host:bootstrap_port`` for the room, waiting
  until the prefill half is done (bounded by the bootstrap timeout), then waits the KV transfer
  time (prompt KV bytes / link bandwidth, in model seconds) before the request joins its
  scheduler with no prefill compute. The usage it reports carries the prefill side's
  ``cached_tokens``.
* a prefill server also refuses a ``bootstrap_port`` that is not its own (in SGLang the decode
  half would hang until its bootstrap timeout; the simulator says so at once).

A failure to pair (no bootstrap server, timeout, the prefill half aborted) answers 500, as an
aborted transfer does in SGLang.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
MODES = ("null", "prefill", "decode")
DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
DEFAULT_BOOTSTRAP_TIMEOUT_S = 300.0  # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT default
DEFAULT_TRANSFER_GBPS = 50.0  # one 400 Gb/s RDMA NIC, GB/s
MAX_ROOMS = 4096  # finished rooms kept for a late decode half


class BootstrapError(Exception):
    """The decode half could not get its KV from the prefill half."""


@dataclass(frozen=True)
class RoomResult:
    prompt_tokens: int
    cached_tokens: int
    failed: str | None = None
    dp_rank: int = 0  # the prefill server's DP rank that holds the KV
    dp_size: int = 1


@dataclass(frozen=True)
class Disaggregation:
    """A replica's PD role: ``mode`` is ``null`` (colocated), ``prefill`` or ``decode``."""

    mode: str = "null"
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    bootstrap_timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S
    transfer_gbps: float = DEFAULT_TRANSFER_GBPS

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"disaggregation mode must be one of {MODES}, got {self.mode!r}")
        if self.transfer_gbps <= 0 or self.bootstrap_timeout_s <= 0:
            raise ValueError("transfer bandwidth and bootstrap timeout must be positive")

    @property
    def enabled(self) -> bool:
        return self.mode != "null"

    def transfer_seconds(self, prompt_tokens: int, kv_bytes_per_token: float) -> float:
        """Model seconds to move a prompt's KV from the prefill to the decode server."""
        return prompt_tokens * kv_bytes_per_token / (self.transfer_gbps * 1e9)


def bootstrap_fields(body: dict[str, Any], disagg: Disaggregation) -> tuple[str, int, int]:
    """(host, port, room) of a request to a PD server; ValueError (a 400) when they are
    missing or malformed, or when a prefill server is named by another bootstrap port."""
    if body.get("bootstrap_room") is None:  # SGLang's words (an abort with status 400)
        raise ValueError("Invalid request: Disaggregated request received without bootstrap room id.")
    missing = [f for f in BOOTSTRAP_FIELDS if body.get(f) is None]
    if missing:
        raise ValueError(
            f"{', '.join(missing)} required in {disagg.mode.upper()} mode: send requests to a "
            "disaggregated server through a router that pairs prefill and decode"
        )
    host, port, room = (body[f] for f in BOOTSTRAP_FIELDS)
    if not isinstance(host, str) or not host:
        raise ValueError("bootstrap_host must be a non-empty string")
    for name, value in (("bootstrap_port", port), ("bootstrap_room", room)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer")
    if room >= 2**63:
        raise ValueError("bootstrap_room must be below 2**63")
    if disagg.mode == "prefill" and port != disagg.bootstrap_port:
        raise ValueError(
            f"bootstrap_port {port} is not this prefill server's bootstrap port "
            f"({disagg.bootstrap_port})"
        )
    return host, port, room


class RoomBoard:
    """The prefill side's rooms: who is waiting for which, and how each ended."""

    def __init__(self) -> None:
        self._rooms: OrderedDict[int, asyncio.Future[RoomResult]] = OrderedDict()

    def _future(self, room: int) -> asyncio.Future[RoomResult]:
        fut = self._rooms.get(room)
        if fut is None:
            fut = self._rooms[room] = asyncio.get_running_loop().create_future()
            while len(self._rooms) > MAX_ROOMS:
                old_room, old = next(iter(self._rooms.items()))
                if not old.done():
                    break  # a room still prefilling is never dropped
                del self._rooms[old_room]
        return fut

    def __contains__(self, room: int) -> bool:
        """Someone asked about ``room`` or it ended (and was not yet forgotten)."""
        return room in self._rooms

    def settle(self, room: int, result: RoomResult) -> None:
        with contextlib.suppress(RuntimeError):  # no running loop: nothing can be waiting
            fut = self._future(room)
            if not fut.done():
                fut.set_result(result)

    async def wait(self, room: int, timeout: float) -> RoomResult | None:
        """The room's result, or None if it did not end within ``timeout`` wall seconds."""
        fut = self._future(room)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            return None


LONG_POLL_S = 10.0  # one bootstrap request waits at most this long; the client asks again


def bootstrap_app(board: RoomBoard) -> web.Application:
    """The prefill server's bootstrap server: ``/health`` and the room long-poll."""

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def room(request: web.Request) -> web.Response:
        try:
            room_id = int(request.match_info["room"])
            wait = min(float(request.query.get("wait", LONG_POLL_S)), LONG_POLL_S)
        except ValueError:
            return web.json_response({"status": "invalid"}, status=400)
        result = await board.wait(room_id, max(wait, 0.0))
        if result is None:
            return web.json_response({"status": "pending"})
        return web.json_response(
            {
                "status": "failed" if result.failed else "ready",
                "prompt_tokens": result.prompt_tokens,
                "cached_tokens": result.cached_tokens,
                "dp_rank": result.dp_rank,
                "dp_size": result.dp_size,
                "message": result.failed,
            }
        )

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/sim/rooms/{room}", room)
    return app


async def fetch_room(
    session: aiohttp.ClientSession, host: str, port: int, room: int, timeout_s: float
) -> RoomResult:
    """Wait (wall seconds) for the prefill half of ``room``; BootstrapError if it fails."""
    deadline = time.monotonic() + timeout_s
    url = f"http://{host}:{port}/sim/rooms/{room}"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BootstrapError(f"KV transfer for room {room} timed out waiting for its prefill half")
        try:
            async with session.get(
                url, params={"wait": f"{min(left, LONG_POLL_S):.3f}"},
                timeout=aiohttp.ClientTimeout(total=min(left, LONG_POLL_S) + 5.0),
            ) as resp:
                data = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise BootstrapError(
                f"bootstrap server {host}:{port} unreachable for room {room}: {exc!r}"
            ) from exc
        status = data.get("status")
        if status == "ready":
            result = RoomResult(int(data["prompt_tokens"]), int(data["cached_tokens"]),
                                dp_rank=int(data["dp_rank"]), dp_size=int(data["dp_size"]))
            # SGLang's decode side looks for the KV on prefill rank room % dp_size
            # (follow_bootstrap_room): a prefill half run on another rank is never found.
            if room % result.dp_size != result.dp_rank:
                raise BootstrapError(
                    f"room {room} looks for its KV on prefill DP rank {room % result.dp_size}, "
                    f"but the prefill half ran on rank {result.dp_rank}"
                )
            return result
        if status == "failed":
            raise BootstrapError(f"prefill half of room {room} failed: {data.get('message')}")
        if status != "pending":
            raise BootstrapError(f"bootstrap server answered {data!r} for room {room}")
