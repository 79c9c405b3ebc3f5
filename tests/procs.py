"""Real processes for fault tests: `kvrouter serve` and `kvrouter sim-replica` on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kvrouter.loadtest.process_group import free_port


class Proc:
    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        full_env = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    async def wait(self, timeout: float) -> int:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, lambda: self.proc.wait(timeout))

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        if not self._log.closed:
            self._log.close()


async def wait_http(url: str, path: str = "/health", timeout: float = 20.0, status: int = 200) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    async with aiohttp.ClientSession() as client:
        while asyncio.get_running_loop().time() < deadline:
            try:
                async with client.get(url + path, timeout=aiohttp.ClientTimeout(total=1)) as resp:
                    if resp.status == status:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.05)
    raise AssertionError(f"{url}{path} did not answer {status} within {timeout}s")


def start_router_proc(
    tmp_path: Path, config: dict[str, Any], env: dict[str, str] | None = None, name: str = "router"
) -> tuple[Proc, str, Path]:
    """`kvrouter serve --config` on a free port; returns (process, base URL, config path)."""
    config = {**config}
    port = free_port()
    config["server"] = {"host": "127.0.0.1", **config.get("server", {}), "port": port}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = Proc([sys.executable, "-m", "kvrouter.cli", "serve", "--config", str(path)],
                tmp_path / f"{name}.log", env)
    return proc, f"http://127.0.0.1:{port}", path


def start_sim_proc(
    tmp_path: Path, port: int | None = None, time_scale: float = 10.0, seed: int = 0, name: str = "sim"
) -> tuple[Proc, str]:
    port = port or free_port()
    proc = Proc([sys.executable, "-m", "kvrouter.cli", "sim-replica", "--port", str(port),
                 "--profile", "tiny", "--time-scale", str(time_scale), "--seed", str(seed)],
                tmp_path / f"{name}-{port}.log")
    return proc, f"http://127.0.0.1:{port}"


async def running_reqs(url: str) -> int:
    """num_running_reqs + num_waiting_reqs of a (simulated) replica, from /v1/loads."""
    async with aiohttp.ClientSession() as client:
        async with client.get(url + "/v1/loads", timeout=aiohttp.ClientTimeout(total=2)) as resp:
            data = await resp.json()
    entries = data if isinstance(data, list) else data.get("loads", data.get("data", [data]))
    return sum(e["num_running_reqs"] + e["num_waiting_reqs"] for e in entries)


async def eventually(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return True
        await asyncio.sleep(interval)
    return False
