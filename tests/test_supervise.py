"""Supervised background loops: a fault injected into each kind of loop (signal poller,
housekeeping, KV-event subscriber, discovery source) is logged, counted in
kvrouter_background_restarts_total{task}, and the loop comes back; shutdown is not a crash."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from kvrouter.loadtest.sim_kv_publisher import SimKVPublisher
from kvrouter.loadtest.sim_server import build_app
from kvrouter.sglang_protocol import kv_events as kve
from kvrouter.metrics.router_metrics import RouterMetrics
from kvrouter.router import discovery as discovery_module
from kvrouter.router import poller as poller_module
from kvrouter.router.config import KVEventsConfig
from kvrouter.router.kv_index_exact import ExactKVIndex
from kvrouter.router.kv_events_subscriber import KVEventSubscriber
from kvrouter.router.supervise import Backoff, supervise

PS = 16


async def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def restarts(metrics: RouterMetrics, task: str) -> float:
    return metrics.background_restarts.labels(task)._value.get()


def fails_once(fn, error: Exception = RuntimeError("injected fault")):
    """`fn`, except that its first call raises `error`."""
    calls = itertools.count()

    def wrapper(*args, **kwargs):
        if next(calls) == 0:
            raise error
        return fn(*args, **kwargs)

    return wrapper


# -- the supervisor itself ---------------------------------------------------------------------
def test_backoff_grows_is_capped_and_jittered():
    b = Backoff(initial_s=0.1, max_s=2.0)
    rng = random.Random(7)
    for failures, step in ((0, 0.1), (1, 0.2), (3, 0.8), (5, 2.0), (60, 2.0)):
        delays = {b.delay(failures, rng) for _ in range(20)}
        assert all(step / 2 <= d <= step for d in delays), (failures, delays)
        assert len(delays) > 1  # jittered


async def test_crash_is_logged_counted_backed_off_and_reset_after_healthy_run(caplog):
    metrics = RouterMetrics()
    now = [0.0]
    runs: list[float] = []
    done = asyncio.Event()

    async def flaky() -> None:
        runs.append(now[0])
        if len(runs) == 3:
            now[0] += 100.0  # this run was healthy for a long while before it crashed
        if len(runs) == 5:
            done.set()
            return
        raise ValueError(f"crash {len(runs)}")

    delays: list[float] = []

    class Rng:
        def uniform(self, a: float, b: float) -> float:
            return b

    backoff = Backoff(initial_s=0.001, max_s=1.0, healthy_after_s=50.0)
    real_delay = backoff.delay

    class Recording(Backoff):
        def delay(self, failures, rng=None):  # type: ignore[override]
            delays.append(failures)
            return real_delay(failures, Rng())

    rec = Recording(backoff.initial_s, backoff.max_s, backoff.healthy_after_s)
    with caplog.at_level(logging.ERROR, "kvrouter.supervise"):
        await asyncio.wait_for(
            supervise("demo", flaky, metrics=metrics, backoff=rec, clock=lambda: now[0]), 5
        )
    assert done.is_set() and len(runs) == 5
    assert restarts(metrics, "demo") == 4
    assert delays == [0, 1, 0, 1]  # the long third run reset the backoff
    crashes = [r for r in caplog.records if "background task demo crashed" in r.getMessage()]
    assert len(crashes) == 4 and all(r.exc_info for r in crashes)  # one traceback per crash


@pytest.mark.parametrize("where", ["running", "backing_off"])
async def test_cancellation_is_shutdown_not_a_crash(where):
    metrics = RouterMetrics()
    started = asyncio.Event()
    crashed = asyncio.Event()

    async def loop() -> None:
        started.set()
        if where == "backing_off":
            crashed.set()
            raise RuntimeError("once")
        await asyncio.Event().wait()

    task = asyncio.create_task(
        supervise("demo", loop, metrics=metrics, backoff=Backoff(initial_s=60.0, max_s=60.0))
    )
    await started.wait()
    if where == "backing_off":
        await wait_for(lambda: restarts(metrics, "demo") == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert restarts(metrics, "demo") == (1 if where == "backing_off" else 0)


# -- each loop of the router -------------------------------------------------------------------
async def test_poller_comes_back_after_a_parse_crash(start_app, start_router, monkeypatch):
    url = await start_app(build_app("tiny", time_scale=200.0))
    monkeypatch.setattr(poller_module, "parse_metrics_text", fails_once(poller_module.parse_metrics_text))
    router, _ = await start_router([url], signals={"source": "metrics", "interval_s": 0.02})
    await wait_for(lambda: restarts(router.metrics, "signal-poller") == 1)
    await wait_for(lambda: url in router.poller.last_update)  # polling again after the crash
    assert router.registry.view(url).healthy


async def test_housekeeping_comes_back_after_a_crash(start_app, start_router, monkeypatch):
    url = await start_app(build_app("tiny", time_scale=200.0))
    router, _ = await start_router([url])
    calls: list[int] = []
    settle = router.engine.settle_fresh

    def counting_settle() -> None:
        calls.append(1)
        settle()

    monkeypatch.setattr(router.engine, "settle_fresh", fails_once(counting_settle))
    await wait_for(lambda: restarts(router.metrics, "housekeeping") == 1)
    await wait_for(lambda: len(calls) >= 1)  # a later round ran to settle_fresh again


async def test_discovery_source_comes_back_after_a_crash(start_app, start_router, monkeypatch,
                                                         tmp_path: Path):
    static = await start_app(build_app("tiny", time_scale=200.0, seed=1))
    found = await start_app(build_app("tiny", time_scale=200.0, seed=2))
    listing = tmp_path / "replicas.yaml"
    listing.write_text(f"- {found}\n")
    monkeypatch.setattr(discovery_module, "parse_replica_list",
                        fails_once(discovery_module.parse_replica_list))
    router, _ = await start_router([static], discovery={"file": {"path": str(listing),
                                                                 "interval_s": 0.02}})
    await wait_for(lambda: restarts(router.metrics, "discovery-file") == 1)
    await wait_for(lambda: found in router.registry)  # the restarted source published the file
    assert router.metrics.discovery_errors.labels("file")._value.get() == 0  # a crash, not an error


async def test_subscriber_comes_back_and_refills_from_replay(monkeypatch):
    pub = SimKVPublisher(PS, endpoint="tcp://127.0.0.1:*", topic="kv-events",
                         replay_endpoint="tcp://127.0.0.1:*")
    pub.start()
    replica = "http://127.0.0.1:1"
    idx, metrics = ExactKVIndex(PS), RouterMetrics()
    config = KVEventsConfig(endpoints={replica: {"endpoint": pub.endpoint,
                                                 "replay_endpoint": pub.replay_endpoint}})
    sub = KVEventSubscriber(idx, config, metrics)
    blocks = itertools.count(1)
    published: list[int] = []

    def publish() -> None:
        block = next(blocks)
        published.append(block)
        pub.pending.append(kve.BlockStored([block], None, [0] * PS, PS, None, kve.MEDIUM_GPU))
        pub.flush()

    # The subscriber's SUB socket read fails once, once it has applied a few batches.
    armed = asyncio.Event()
    recv = zmq.asyncio.Socket.recv_multipart

    def faulty_recv(self, *args, **kwargs):
        if self.type == zmq.SUB and armed.is_set():
            armed.clear()
            raise zmq.ZMQError(zmq.EFSM, "injected socket fault")
        return recv(self, *args, **kwargs)

    monkeypatch.setattr(zmq.asyncio.Socket, "recv_multipart", faulty_recv)
    forgotten: list[str] = []
    forget = idx.forget
    monkeypatch.setattr(idx, "forget", lambda r: (forgotten.append(r), forget(r)))
    try:
        sub.start([replica])
        while idx.cached_tokens(replica) < 3 * PS:  # until the subscription is live
            publish()
            await asyncio.sleep(0.01)
        known = list(published)
        armed.set()
        publish()  # wakes the SUB read, which now fails
        await wait_for(lambda: restarts(metrics, "kv-events") == 1)
        assert forgotten == [replica]  # its index was dropped with the crash...
        # ...and refilled from the replay socket, with nothing new published meanwhile.
        await wait_for(lambda: all(idx.match([b]) == {replica: PS} for b in published))
        assert set(known) < set(published)
        assert sub._tasks[replica].done() is False
        # Live events flow again on the new subscription.
        publish()
        await wait_for(lambda: idx.match([published[-1]]) == {replica: PS})
    finally:
        await sub.close()
        await pub.close()
