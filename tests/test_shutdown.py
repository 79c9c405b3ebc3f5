"""SIGTERM on a real `kvrouter serve` process with 100 streams in flight."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest

from .fakes import FakeUpstream
from .fault_ledger import FaultRecord, Outcome, Request, fake_counts, read_outcome
from .procs import eventually, start_router_proc, wait_http

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
STREAMS = 100


async def _open_streams(client: aiohttp.ClientSession, url: str, n: int, record: FaultRecord):
    reqs = [record.send(f"stream-{i}") for i in range(n)]
    responses = await asyncio.gather(*(client.post(url + "/v1/chat/completions", json=CHAT) for _ in range(n)))
    # every stream has its first event: all 100 are in flight at the router
    firsts = await asyncio.gather(*(asyncio.wait_for(r.content.readuntil(b"\n\n"), 20) for r in responses))
    return list(zip(reqs, responses, firsts))


async def _finish(stream: tuple[Request, aiohttp.ClientResponse, bytes]) -> Outcome:
    req, resp, first = stream
    return req.got(await read_outcome(resp, first))


def _cut_by_shutdown(outcome: Outcome) -> bool:
    return outcome.kind == "clean_error" and "router shutting down" in (outcome.message or "")


@pytest.mark.timeout(90)
@pytest.mark.fault_matrix(
    fault="Router SIGTERM with 100 streams in flight",
    clients_saw="/ready 503 at once; new requests 503 then connection refused; all 100 streams complete; exit 0",
)
async def test_sigterm_drains_100_streams_then_exits_0(start_app, tmp_path, fault_record):
    hold = asyncio.Event()
    upstream = FakeUpstream(chunks=6, hold_after_first=hold)
    replica = await start_app(upstream.app())
    proc, url, _ = start_router_proc(tmp_path, {
        "replicas": [replica], "policy": {"name": "round_robin"},
        "server": {"shutdown_grace_s": 30, "shutdown_delay_s": 1.5},
    })
    try:
        await wait_http(url, "/ready")
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client, \
                aiohttp.ClientSession() as probe:
            streams = await _open_streams(client, url, STREAMS, fault_record)
            proc.signal(signal.SIGTERM)
            ready_status = None
            for _ in range(100):  # the signal lands within milliseconds
                async with probe.get(url + "/ready", headers={"Connection": "close"}) as r:
                    ready_status = r.status
                    if r.status == 503:
                        assert (await r.json())["shutting_down"] is True
                        break
                await asyncio.sleep(0.01)
            assert ready_status == 503
            async with probe.post(url + "/v1/chat/completions", json=CHAT) as r:
                outcome = await fault_record.observe(r)
                assert (outcome.kind, outcome.status) == ("clean_error", 503) and outcome.retry_after  # no new work
                assert (await r.json())["error"]["type"] == "service_unavailable"
            refused = False
            for _ in range(200):  # after shutdown_delay_s the listener closes
                try:
                    async with probe.get(url + "/health", headers={"Connection": "close"}):
                        pass
                except aiohttp.ClientConnectorError:
                    refused = True
                    break
                await asyncio.sleep(0.05)
            assert refused, "router kept accepting connections after SIGTERM"
            assert proc.proc.poll() is None  # still draining the 100 streams
            hold.set()
            outcomes = await asyncio.gather(*(_finish(r) for r in streams))
        code = await proc.wait(30)
    finally:
        proc.stop()
    fault_record.replica(fake_counts("replica", upstream))
    assert [o.kind for o in outcomes] == ["complete"] * STREAMS, outcomes
    assert code == 0
    log = proc.log()
    assert "shutting down: not ready; 100 requests in flight" in log
    assert "shut down cleanly" in log and "requests cut" not in log


@pytest.mark.timeout(60)
@pytest.mark.fault_matrix(
    fault="Router SIGTERM, streams outlive the grace period",
    clients_saw="after shutdown_grace_s each stream ends with an SSE error event (503, router shutting down); exit 0",
)
async def test_sigterm_cuts_streams_after_grace_and_exits_0(start_app, tmp_path, fault_record):
    hold = asyncio.Event()  # never set: the streams would run forever
    upstream = FakeUpstream(chunks=6, hold_after_first=hold)
    replica = await start_app(upstream.app())
    proc, url, _ = start_router_proc(tmp_path, {
        "replicas": [replica], "server": {"shutdown_grace_s": 1.0},
    })
    try:
        await wait_http(url, "/ready")
        async with aiohttp.ClientSession() as client:
            streams = await _open_streams(client, url, 5, fault_record)
            proc.signal(signal.SIGTERM)
            outcomes = await asyncio.gather(*(_finish(r) for r in streams))
        code = await proc.wait(20)
        assert await eventually(lambda: upstream.running == 0)  # the replica saw every disconnect
    finally:
        hold.set()
        proc.stop()
    fault_record.replica(fake_counts("replica", upstream))
    # a cut stream says so, and never passes for a finished one
    assert all(_cut_by_shutdown(o) for o in outcomes), outcomes
    assert code == 0
    assert "requests cut" in proc.log()


@pytest.mark.timeout(60)
@pytest.mark.fault_matrix(
    fault="Router SIGTERM, requests still waiting for the replica's first byte when the grace period ends",
    clients_saw="503 OpenAI-shaped error (router shutting down) at the end of shutdown_grace_s; replica request aborted; exit 0",
)
async def test_sigterm_answers_requests_without_a_first_byte_503(start_app, tmp_path, fault_record):
    hold = asyncio.Event()  # a prefill that outlives the grace period
    upstream = FakeUpstream(hold_before_headers=hold)
    replica = await start_app(upstream.app())
    proc, url, _ = start_router_proc(tmp_path, {"replicas": [replica], "server": {"shutdown_grace_s": 1.0}})
    try:
        await wait_http(url, "/ready")
        async with aiohttp.ClientSession() as client:
            bodies = [{**CHAT, "stream": stream} for stream in (True, False, True, False)]
            pending = [asyncio.create_task(fault_record.request(client, url + "/v1/chat/completions", b))
                       for b in bodies]
            while len(upstream.requests) < len(bodies):
                await asyncio.sleep(0.02)
            proc.signal(signal.SIGTERM)
            answers = [await asyncio.wait_for(task, 20) for task in pending]
        code = await proc.wait(20)
        assert await eventually(lambda: upstream.running == 0)  # every replica request aborted
    finally:
        hold.set()
        proc.stop()
    fault_record.replica(fake_counts("replica", upstream))
    assert all(o.status == 503 and _cut_by_shutdown(o) for o in answers), answers
    assert code == 0


async def test_a_cut_that_coincides_with_a_client_disconnect_still_propagates():
    """Found in review: the cut check is made in the stream relay and again in forward(); a
    cancellation with a second source (the client left too) must not be swallowed by the second."""
    from kvrouter.router.app import Router
    from kvrouter.router.config import parse_config

    relay = Router(parse_config({"replicas": ["http://127.0.0.1:9"]})).relay
    started = asyncio.Event()

    async def handler() -> str:
        task = asyncio.current_task()
        relay._active.add(task)
        started.set()
        try:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if not relay._was_cut(task):  # the stream relay's check
                    raise
                return "cut"
        except asyncio.CancelledError:
            if not relay._was_cut(task):  # forward()'s check
                raise
            return "cut"
        return "done"

    alone = asyncio.create_task(handler())
    await started.wait()
    relay.cut_requests("shutting down")
    assert await alone == "cut"

    started.clear()
    both = asyncio.create_task(handler())
    await started.wait()
    relay.cut_requests("shutting down")
    both.cancel()  # the client went away at the same moment
    with pytest.raises(asyncio.CancelledError):
        await both
