"""SIGHUP reload on a real router process: applied without dropping requests; invalid ones refused."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from .fakes import FakeUpstream
from .fault_ledger import fake_counts, read_outcome
from kvrouter.loadtest.process_group import free_port

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def wait_ready(url: str) -> None:
    async with aiohttp.ClientSession() as client:
        for _ in range(200):
            try:
                async with client.get(url + "/ready") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError("router did not become ready")


@pytest.mark.fault_matrix(
    fault="SIGHUP with an invalid config",
    clients_saw="old config kept, requests keep succeeding; the refusal is logged naming the key",
)
async def test_sighup_reload_adds_replica_and_refuses_invalid_config(start_app, tmp_path: Path, fault_record):
    hold = asyncio.Event()
    a = FakeUpstream(name="a", chunks=4, hold_after_first=hold)
    b = FakeUpstream(name="b")
    url_a, url_b = await start_app(a.app()), await start_app(b.app())
    port = free_port()
    config = tmp_path / "router.yaml"
    config.write_text(f"replicas: [{url_a}]\npolicy: {{name: round_robin}}\n"
                      f"server: {{host: 127.0.0.1, port: {port}}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "kvrouter.cli", "serve", "--config", str(config)],
                            stderr=subprocess.PIPE, text=True)
    router = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(router)
        async with aiohttp.ClientSession() as client:
            inflight_req = fault_record.send("in flight across the reload")
            inflight = await client.post(router + "/v1/chat/completions", json=CHAT)
            first = await asyncio.wait_for(inflight.content.readuntil(b"\n\n"), 5)  # stream in progress
            config.write_text(config.read_text().replace(f"[{url_a}]", f"[{url_a}, {url_b}]"))
            proc.send_signal(signal.SIGHUP)
            seen = set()
            for _ in range(100):
                async with client.post(router + "/v1/chat/completions", json={**CHAT, "stream": False}) as r:
                    assert (await fault_record.observe(r)).kind == "complete"
                    seen.add(r.headers["x-upstream"])
                if "b" in seen:
                    break
                await asyncio.sleep(0.02)
            assert "b" in seen
            hold.set()
            # the in-flight stream was not dropped
            assert inflight_req.got(await read_outcome(inflight, first, timeout=5)).kind == "complete"

            config.write_text("replicas: [not a url]\n")
            proc.send_signal(signal.SIGHUP)
            await asyncio.sleep(0.3)
            async with client.post(router + "/v1/chat/completions", json={**CHAT, "stream": False}) as r:
                assert (await fault_record.observe(r)).kind == "complete"  # still serving with the old config
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0
    assert "reload refused" in err and "replicas.0" in err
    assert "config reloaded: +" in err
    fault_record.replica(fake_counts("a", a))
    fault_record.replica(fake_counts("b", b))
