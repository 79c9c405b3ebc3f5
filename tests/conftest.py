from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from kvrouter.loadtest.process_group import free_port
from kvrouter.router.app import Router
from kvrouter.router.config import parse_config
from kvrouter.router.serve import start_site

StartApp = Callable[[web.Application], Awaitable[str]]


@pytest.fixture
async def start_app() -> AsyncIterator[StartApp]:
    """Serve an aiohttp app on 127.0.0.1 (free port); returns its base URL."""
    runners: list[web.AppRunner] = []

    async def _start(app: web.Application) -> str:
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    yield _start
    for runner in reversed(runners):
        await runner.cleanup()


@pytest.fixture
async def start_router() -> AsyncIterator[Callable[..., Awaitable[tuple[Router, str]]]]:
    """Start a Router on 127.0.0.1 in front of the given replica URLs."""
    runners: list[web.AppRunner] = []

    async def _start(replicas: list[str], **overrides: Any) -> tuple[Router, str]:
        data: dict[str, Any] = {"replicas": replicas, "server": {"host": "127.0.0.1", "port": 0}}
        for key, value in overrides.items():
            data[key] = value
        router = Router(parse_config(data))
        runner, port = await start_site(router, "127.0.0.1", 0)
        runners.append(runner)
        return router, f"http://127.0.0.1:{port}"

    yield _start
    for runner in reversed(runners):
        await runner.cleanup()


@pytest.fixture
def closed_port_url() -> str:
    """A loopback URL on which nothing listens (connection refused)."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
def redis_server(tmp_path):
    from .redis_server import RedisProcess

    server = RedisProcess(tmp_path)
    server.start()
    yield server
    server.kill()


@pytest.fixture
def redis_auth(tmp_path):
    """A Redis that requires AUTH with `redis_server.TEST_PASSWORD`."""
    from .redis_server import TEST_PASSWORD, RedisProcess

    server = RedisProcess(tmp_path, password=TEST_PASSWORD)
    server.start()
    yield server
    server.kill()


# -- fault matrix: tests marked `fault_matrix` record, through the `fault_record` ledger
# (tests/fault_ledger.py), every request their clients sent with what came back and the replicas' own
# counts. A test whose ledger shows a lost request fails. docs/reliability-faults.json and the table
# in docs/reliability.md are rendered from them (KVROUTER_FAULT_MATRIX=out.json pytest -m
# fault_matrix; python benchmarks/fault_matrix.py).
_FAULT_ROWS: list[dict[str, Any]] = []


@pytest.fixture
def fault_record(request):
    from .fault_ledger import FaultRecord

    record = FaultRecord()
    request.node._fault_record = record
    return record


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "fault_matrix(fault, clients_saw): a row of the fault matrix in docs/reliability.md"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    marker = item.get_closest_marker("fault_matrix")
    if marker is None or report.when != "call":
        return
    record = getattr(item, "_fault_record", None)
    row = record.row() if record is not None else {"client": None, "replicas": None, "disagreements": [],
                                                   "lost": None, "notes": ""}
    if report.passed and record is not None and (record.lost or not record.requests):
        report.outcome = "failed"
        report.longrepr = (f"fault matrix: {record.lost} requests lost" if record.requests else
                           "fault matrix: the test recorded no request") + (
            f"; {row['client']['nothing_reasons']}; {row['disagreements']}")
    _FAULT_ROWS.append({
        "test": f"tests/{item.module.__name__.rsplit('.', 1)[-1]}.py::{item.name}",
        "fault": marker.kwargs.get("fault", ""),
        "clients_saw": marker.kwargs.get("clients_saw", ""),
        **row,
        "outcome": report.outcome,
    })


def pytest_sessionfinish(session, exitstatus) -> None:
    import json
    import os

    out = os.environ.get("KVROUTER_FAULT_MATRIX")
    if out and _FAULT_ROWS:
        with open(out, "w") as f:
            json.dump(sorted(_FAULT_ROWS, key=lambda r: r["test"]), f, indent=1)
            f.write("\n")
