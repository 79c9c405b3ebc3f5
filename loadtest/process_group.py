"""Local subprocesses for ``kvrouter compare``: free ports, process groups, readiness.

Every subprocess runs in its own process group (session) and :meth:`ProcessGroup.close` kills
them all (SIGTERM, then SIGKILL after a grace period). Output goes to a log file per process,
whose tail is shown when one fails to start.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

__all__ = ["CompareError", "free_port", "ProcessGroup", "wait_ready"]


class CompareError(RuntimeError):
    """A comparison could not run (a process did not start, a replica never got ready, ...)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (bound then released: another process may take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class RunningProcess:
    """One started subprocess and the log file its stdout and stderr go to."""

    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    log_path: Path

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class ProcessGroup:
    """Subprocesses started in their own sessions (process groups), all killed by :meth:`close`."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[RunningProcess] = []

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> RunningProcess:
        log_path = self.log_dir / f"{name.replace('/', '_')}-{len(self.procs)}.log"
        with open(log_path, "wb") as log:
            try:
                popen = subprocess.Popen(
                    list(argv),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=env,
                )
            except OSError as exc:
                raise CompareError(f"{name}: cannot start {shlex.join(argv)}: {exc}") from exc
        proc = RunningProcess(name, list(argv), popen, log_path)
        self.procs.append(proc)
        return proc

    @staticmethod
    def _signal(proc: RunningProcess, sig: int) -> None:
        if proc.popen.poll() is not None:
            return
        try:
            os.killpg(proc.popen.pid, sig)  # start_new_session: pgid == pid
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                proc.popen.send_signal(sig)

    def stop(self, procs: Sequence[RunningProcess], grace_s: float = 5.0) -> None:
        """SIGTERM each process group, SIGKILL whatever is left after ``grace_s``."""
        for p in procs:
            self._signal(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            # the group, even when the leader is gone (a template's children may linger)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.popen.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(2.0)
        for p in procs:
            if p in self.procs:
                self.procs.remove(p)

    def close(self) -> None:
        self.stop(list(self.procs))


async def wait_ready(
    http: aiohttp.ClientSession,
    proc: RunningProcess,
    base_url: str,
    path: str,
    timeout_s: float,
    accept: Callable[[int], bool],
) -> None:
    """Poll ``base_url + path`` until ``accept(status)``; :class:`CompareError` with the log's tail
    when ``proc`` exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        code = proc.popen.poll()
        if code is not None:
            raise CompareError(
                f"{proc.name} exited with code {code} before it was ready: {shlex.join(proc.argv)}\n"
                f"--- last lines of {proc.log_path} ---\n{proc.tail()}"
            )
        try:
            async with http.get(base_url + path, timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                await resp.read()
                if accept(resp.status):
                    return
                last = f"HTTP {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            last = type(exc).__name__
        await asyncio.sleep(0.1)
    raise CompareError(
        f"{proc.name} not ready after {timeout_s:.0f} s ({base_url}{path}: {last})\n"
        f"--- last lines of {proc.log_path} ---\n{proc.tail()}"
    )
