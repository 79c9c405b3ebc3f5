"""`kvrouter serve --workers N`: N processes on one port (SO_REUSEPORT) sharing affinity via Redis."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import aiohttp
import yaml

from .fakes import FakeUpstream
from .procs import Proc, wait_http
from kvrouter.loadtest.process_group import free_port


async def _until_both_workers_serve(url: str, timeout: float = 30.0) -> None:
    """Fresh connections until both workers have answered one (the second may still be starting
    on a loaded machine), so the test's traffic can reach both."""
    seen: set[str] = set()
    deadline = asyncio.get_running_loop().time() + timeout
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as client:
        while seen != {"0", "1"}:
            assert asyncio.get_running_loop().time() < deadline, f"only workers {seen} answered"
            async with client.post(url + "/v1/chat/completions",
                                   json={"model": "m", "messages": [{"role": "user", "content": "warm-up"}]}) as resp:
                assert resp.status == 200, await resp.text()
                seen.add(resp.headers["x-kvrouter-worker"])
            await asyncio.sleep(0.02)


async def test_two_workers_share_a_port_and_agree_on_session_homes(tmp_path, start_app, redis_server):
    replicas = [await start_app(FakeUpstream(name=f"r{i}").app()) for i in range(4)]
    port = free_port()
    config = {
        "server": {"host": "127.0.0.1", "port": port, "replica_header": True, "shutdown_grace_s": 2},
        "replicas": replicas,
        "signals": {"source": "health"},
        "affinity": {"store": "redis", "redis_url": redis_server.url, "key_prefix": "workers-test:"},
    }
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = Proc([sys.executable, "-m", "kvrouter.cli", "serve", "--config", str(path), "--workers", "2"],
                tmp_path / "router.log")
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_http(url, "/ready")
        await _until_both_workers_serve(url)  # /ready answers as soon as one of them is up
        homes: dict[str, set[str]] = {}
        workers: dict[str, set[str]] = {}
        # Fresh connections, so the kernel spreads them over both workers; each session's requests
        # land on either worker and must still reach one replica.
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as client:
            for turn in range(6):
                for s in range(12):
                    session = f"session-{s}"
                    async with client.post(
                        url + "/v1/chat/completions", headers={"x-session-id": session},
                        json={"model": "m", "messages": [{"role": "user", "content": f"{session} turn {turn}"}]},
                    ) as resp:
                        assert resp.status == 200, await resp.text()
                        homes.setdefault(session, set()).add(resp.headers["x-kvrouter-replica"])
                        workers.setdefault(session, set()).add(resp.headers["x-kvrouter-worker"])
        assert set().union(*workers.values()) == {"0", "1"}, "both workers should have served"
        assert sum(len(w) == 2 for w in workers.values()) >= 1, "some session crossed workers"
        assert all(len(h) == 1 for h in homes.values()), homes
        assert len(set().union(*homes.values())) > 1, "sessions spread over replicas"
    finally:
        proc.signal(signal.SIGTERM)
        assert await proc.wait(30) == 0, proc.log()
        proc.stop()
        log = proc.log()
    assert "worker 0" in log and "worker 1" in log


def test_workers_refused_with_the_memory_store():
    out = subprocess.run(
        [sys.executable, "-m", "kvrouter.cli", "serve", "--replica", "http://127.0.0.1:9", "--workers", "2"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--workers 2 needs affinity.store: redis" in lines[0], out.stderr
