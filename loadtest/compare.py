"""Side-by-side comparison of routers on one fleet of simulated SGLang replicas.

``kvrouter compare`` (and ``kvrouter demo``) start ``replicas`` simulated replicas once, as
subprocesses (``python -m kvrouter.cli sim-replica``, free ports on 127.0.0.1, ready when
``/health`` answers). Then, for every users level and every contender:

1. ``POST /flush_cache`` on every replica (retried while a replica answers 400 because requests
   of the previous run are still finishing), so every run starts from cold caches;
2. start the contender on a free port and wait until it answers:
   - a policy ``NAME`` is our router: ``python -m kvrouter.cli serve --config TMP.yaml --policy
     NAME`` with ``server.replica_header: true`` in the file, so the driver can count sessions per
     replica; ready when ``/ready`` answers 200;
   - an external contender is a command template (``NAME=TEMPLATE``) with ``{port}``,
     ``{worker_urls}`` (replica URLs, space-separated), ``{worker_url_flags}`` (``--replica URL``
     per replica) and ``{python}`` (this interpreter) substituted, split with :func:`shlex.split`
     and run without a shell; ready when its port accepts connections and ``/health`` answers
     anything but 5xx (a 404 counts: not every router has ``/health``);
3. run the identical seeded workload through it with :func:`kvrouter.loadtest.driver.run_load`,
   sampling every replica's ``/metrics`` for the load figures;
4. stop it (its whole process group).

Every subprocess runs in its own process group and is killed in a ``finally`` (SIGTERM, then
SIGKILL after a grace period), whatever ends the comparison: the end, an exception or Ctrl-C.
Subprocess output goes to log files in a temporary directory; the tail is printed if one fails.

Contenders and settings are :mod:`kvrouter.loadtest.compare_config`; processes
:mod:`kvrouter.loadtest.process_group`. Outputs (:func:`kvrouter.loadtest.compare_report.write_outputs`):
``report.md`` (the table), ``results.json`` (the schema-1 results contract; with more than one users
level the contenders are named ``NAME@uN`` and a ``sweep`` section lists each contender's levels)
and three PNG charts (:mod:`kvrouter.loadtest.compare_charts`) when matplotlib is installed
(``pip install 'kvrouter[charts]'``).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from .compare_config import CompareConfig, Contender, RunData, expand_template, with_settings
from .compare_report import build_compare_report
from .driver import run_load
from .process_group import CompareError, ProcessGroup, RunningProcess, free_port, wait_ready
from .progress import StderrProgress
from .report import RequestRecord
from .workload_config import load_workload

__all__ = ["run_compare"]

Say = Callable[[str], None]


async def _flush(http: aiohttp.ClientSession, url: str, timeout_s: float = 60.0) -> None:
    """POST /flush_cache; SGLang refuses (400) while requests are running or waiting: retry."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        try:
            async with http.post(url + "/flush_cache", timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
                last = f"HTTP {resp.status}: {(await resp.text())[:100]!r}"
                if resp.status == 200:
                    return
                if resp.status != 400:
                    raise CompareError(f"{url}/flush_cache: {last}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise CompareError(f"{url}/flush_cache still refused after {timeout_s:.0f} s ({last})")
        await asyncio.sleep(0.2)


class _PrefixedProgress(StderrProgress):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def __call__(self, line: str) -> None:
        super().__call__(f"{self.prefix} {line}")

    def finish(self, line: str) -> None:
        super().finish(f"{self.prefix} {line}")


def _say_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _router_config_file(path: Path, policy: str, port: int, urls: Sequence[str],
                        observability: dict[str, Any] | None = None,
                        settings: Sequence[tuple[str, Any]] = ()) -> None:
    data: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port, "replica_header": True},
        "replicas": list(urls),
        "policy": {"name": policy, "params": {}},
    }
    if observability:
        data["observability"] = observability
    path.write_text(yaml.safe_dump(with_settings(data, settings), sort_keys=False))


async def _start_replicas(
    cfg: CompareConfig, group: ProcessGroup, http: aiohttp.ClientSession, say: Say
) -> list[str]:
    urls: list[str] = []
    procs: list[RunningProcess] = []
    for i in range(cfg.replicas):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [
            sys.executable, "-m", "kvrouter.cli", "sim-replica", "--host", "127.0.0.1",
            "--port", str(port), "--profile", cfg.profile, "--time-scale", f"{cfg.time_scale:g}",
            "--seed", str(cfg.seed + i),
        ]
        procs.append(group.start(f"replica{i}", argv))
        urls.append(url)
    say(f"[compare] starting {cfg.replicas} simulated replicas (profile {cfg.profile}, "
        f"time scale {cfg.time_scale:g})")
    await asyncio.gather(
        *(wait_ready(http, p, u, "/health", cfg.ready_timeout_s, lambda s: s == 200) for p, u in zip(procs, urls))
    )
    say(f"[compare] replicas ready: {' '.join(urls)}")
    return urls


async def _start_contender(
    c: Contender,
    urls: Sequence[str],
    cfg: CompareConfig,
    group: ProcessGroup,
    http: aiohttp.ClientSession,
    tmp: Path,
    observability: dict[str, Any] | None = None,
) -> tuple[RunningProcess, str]:
    """Start one contender; `observability` (router config section) applies to kvrouter ones."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    if c.template is None:
        conf = tmp / f"router-{c.name}.yaml"
        _router_config_file(conf, c.policy or c.name, port, urls, observability, c.settings)
        # The policy is the config file's (a --policy flag would drop a variant's params).
        argv = [sys.executable, "-m", "kvrouter.cli", "serve", "--config", str(conf)]
        proc = group.start(c.name, argv)
        await wait_ready(http, proc, base, "/ready", cfg.ready_timeout_s, lambda s: s == 200)
    else:
        proc = group.start(c.name, expand_template(c.template, port, urls))
        await wait_ready(http, proc, base, "/health", cfg.ready_timeout_s, lambda s: s < 500)
    return proc, base


async def _compare(cfg: CompareConfig, group: ProcessGroup, tmp: Path, say: Say) -> list[RunData]:
    contenders = cfg.contenders()
    workload = load_workload(cfg.workload)
    runs: list[RunData] = []
    total = len(contenders) * len(cfg.users)
    async with aiohttp.ClientSession() as http:
        urls = await _start_replicas(cfg, group, http, say)
        n = 0
        for users in cfg.users:
            for c in contenders:
                n += 1
                label = f"[{n}/{total}] {c.name} users={users}"
                await asyncio.gather(*(_flush(http, u) for u in urls))
                say(f"{label}: caches flushed, starting {c.kind} contender")
                proc, base = await _start_contender(c, urls, cfg, group, http, tmp)
                try:
                    records: list[RequestRecord] = []
                    samples: list[tuple[float, list[float]]] = []
                    t0 = time.monotonic()
                    report = await run_load(
                        base, workload, users, cfg.duration_s, seed=cfg.seed, time_scale=cfg.time_scale,
                        replica_metrics_urls=urls, progress=_PrefixedProgress(label), contender=c.name,
                        drain_timeout_s=cfg.drain_timeout_s, metrics_interval_s=cfg.metrics_interval_s,
                        records_out=records, load_samples_out=samples, ramp_s=cfg.ramp_s,
                        warm_start=cfg.warm_start, warmup_s=cfg.warmup_s,
                    )
                    wall = time.monotonic() - t0
                finally:
                    group.stop([proc])
                runs.append(
                    RunData(c.name, users, report["results"][c.name], wall, records, samples, cfg.warmup_s)
                )
    return runs


def run_compare(cfg: CompareConfig, say: Say = _say_stderr) -> tuple[dict[str, Any], list[RunData]]:
    """Run the whole comparison; returns the JSON report and the per-run data (for the charts).

    Blocking (runs its own event loop). Every subprocess is gone when this returns or raises.
    """
    contenders = cfg.contenders()  # validate before starting anything
    if not cfg.users or any(u < 1 for u in cfg.users):
        raise ValueError("users levels must be >= 1")
    workload = load_workload(cfg.workload)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvrouter-compare-") as tmpdir:
        tmp = Path(tmpdir)
        group = ProcessGroup(tmp)
        try:
            runs = asyncio.run(_compare(cfg, group, tmp, say))
        finally:
            group.close()
    report = build_compare_report(cfg, workload, contenders, runs, time.monotonic() - t0)
    return report, runs
