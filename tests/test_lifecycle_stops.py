"""Stopping the router: every part stops even when another part's stop fails, and a start that
fails stops what had already started."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvrouter.router.app import Router
from kvrouter.router.config import parse_config
from kvrouter.router.data_server import DataServer
from kvrouter.router.serve import start_site


def _server(*lifecycles) -> DataServer:
    return DataServer({}, [], list(lifecycles), max_body_bytes=1000, header_timeout_s=5, shutdown_grace_s=0.1)


def _recorded(name: str, stopped: list[str]):
    """A lifecycle that notes its stop in `stopped`."""
    async def lifecycle(server: object) -> AsyncIterator[None]:
        yield
        stopped.append(name)
    return lifecycle


async def test_every_lifecycle_stops_though_one_stop_fails() -> None:
    stopped: list[str] = []

    async def second(server: object) -> AsyncIterator[None]:
        yield
        stopped.append("second")
        raise RuntimeError("second failed to stop")

    server = _server(_recorded("first", stopped), second)
    await server.start("127.0.0.1", 0)
    with pytest.raises(RuntimeError, match="second failed to stop"):
        await server.cleanup()
    assert stopped == ["second", "first"]  # in reverse, the first one stopped all the same


async def test_a_lifecycle_that_fails_to_start_stops_those_started_before_it() -> None:
    stopped: list[str] = []

    async def broken(server: object) -> AsyncIterator[None]:
        raise OSError("cannot start")
        yield  # pragma: no cover

    server = _server(_recorded("first", stopped), broken)
    with pytest.raises(OSError, match="cannot start"):
        await server.start("127.0.0.1", 0)
    assert stopped == ["first"] and server._server is None


async def test_a_port_already_taken_stops_the_lifecycles_that_started() -> None:
    import socket

    stopped: list[str] = []
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        server = _server(_recorded("first", stopped))
        with pytest.raises(OSError):
            await server.start("127.0.0.1", taken.getsockname()[1])
        assert stopped == ["first"]
    finally:
        taken.close()


async def test_the_router_stops_its_relay_and_poller_when_its_affinity_store_fails_to_close(
        closed_port_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    router = Router(parse_config({"replicas": [closed_port_url], "server": {"host": "127.0.0.1", "port": 0}}))
    calls: list[str] = []

    def spy(owner: object, name: str, label: str, fail: bool = False) -> None:
        original = getattr(type(owner), name)

        async def wrapped(self, *args, **kwargs):
            calls.append(label)
            await original(self, *args, **kwargs)
            if fail:
                raise ConnectionError("store gone")

        monkeypatch.setattr(type(owner), name, wrapped)  # before the start registers the stops

    spy(router.affinity, "close", "affinity", fail=True)
    spy(router.relay, "close", "relay")
    spy(router.poller, "aclose", "poller")
    server, _ = await start_site(router, "127.0.0.1", 0)
    with pytest.raises(ConnectionError, match="store gone"):
        await server.cleanup()
    assert calls == ["affinity", "relay", "poller"]  # the order of a clean stop, none skipped
