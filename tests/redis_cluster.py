"""A real 3-node Redis Cluster on 127.0.0.1 for tests (the same server binary as
tests/redis_server.py): each node gets a third of the slots, then they meet."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import redis

from kvrouter.loadtest.process_group import free_port

from .redis_server import server_binary

SLOTS = 16384


class RedisCluster:
    def __init__(self, workdir: Path, nodes: int = 3) -> None:
        self.workdir = workdir
        self.ports = [free_port() for _ in range(nodes)]
        self.bus_ports = [free_port() for _ in range(nodes)]  # node to node (CLUSTER MEET)
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> None:
        for port, bus in zip(self.ports, self.bus_ports):
            home = self.workdir / f"node-{port}"
            home.mkdir()
            args = [server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                    "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                    "--cluster-port", str(bus), "--cluster-node-timeout", "5000",
                    "--save", "", "--appendonly", "no", "--dir", str(home)]
            self.procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        clients = [self._client(port) for port in self.ports]
        try:
            share = SLOTS // len(clients)
            for i, client in enumerate(clients):
                last = SLOTS - 1 if i == len(clients) - 1 else (i + 1) * share - 1
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * share, last)
            for port, bus in zip(self.ports[1:], self.bus_ports[1:]):
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port, bus)
            deadline = time.monotonic() + 20
            while not all(self._ready(c) for c in clients):
                if time.monotonic() > deadline:
                    raise RuntimeError("redis cluster did not reach cluster_state:ok")
                time.sleep(0.05)
        finally:
            for client in clients:
                client.close()

    def _ready(self, client: redis.Redis) -> bool:
        info = client.execute_command("CLUSTER", "INFO").decode()
        return "cluster_state:ok" in info and f"cluster_known_nodes:{len(self.ports)}" in info

    @staticmethod
    def _client(port: int) -> redis.Redis:
        deadline = time.monotonic() + 10
        while True:
            client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)
            try:
                client.ping()
                return client
            except redis.ConnectionError:
                client.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait(5)
        self.procs.clear()
