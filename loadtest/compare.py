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

Outputs (:func:`write_outputs`): ``report.md`` (the table), ``results.json`` (the schema-1
results contract; with more than one users level the contenders are named ``NAME@uN`` and a
``sweep`` section lists each contender's levels) and three PNG charts when matplotlib is installed
(``pip install 'kvrouter[charts]'``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from .driver import StderrProgress, run_load
from .report import SCHEMA_VERSION, RequestRecord
from .workload import WorkloadConfig, load_workload

__all__ = [
    "CompareError",
    "Contender",
    "CompareConfig",
    "RunData",
    "parse_external",
    "expand_template",
    "contender_key",
    "run_compare",
    "markdown_table",
    "write_outputs",
    "CHART_FILES",
]

CHART_FILES = ("interactivity_vs_throughput.png", "ttft_distribution.png", "replica_load_over_time.png")

Say = Callable[[str], None]


class CompareError(RuntimeError):
    """A comparison could not run (a process did not start, a replica never got ready, ...)."""


# ----------------------------------------------------------------------------------------------
# contenders
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Contender:
    """A policy of our router (``template`` None) or an external router command template."""

    name: str
    policy: str | None = None
    template: str | None = None

    @property
    def kind(self) -> str:
        return "policy" if self.template is None else "external"


def parse_external(spec: str) -> Contender:
    """``NAME=COMMAND TEMPLATE`` (split at the first ``=``)."""
    name, sep, template = spec.partition("=")
    name, template = name.strip(), template.strip()
    if not sep or not name or not template:
        raise ValueError(f"--external {spec!r}: expected NAME=COMMAND TEMPLATE")
    if "@" in name or "/" in name:
        raise ValueError(f"--external {spec!r}: NAME must not contain '@' or '/'")
    if "{port}" not in template:
        raise ValueError(f"--external {spec!r}: the template must use {{port}}")
    return Contender(name=name, template=template)


def expand_template(template: str, port: int, worker_urls: Sequence[str]) -> list[str]:
    """The argv of an external contender. Placeholders are replaced as plain text *before*
    :func:`shlex.split`, so an unquoted ``{worker_urls}`` becomes one argument per URL and a quoted
    one a single argument; other braces (JSON, say) are left alone."""
    values = {
        "{port}": str(port),
        "{worker_urls}": " ".join(worker_urls),
        "{worker_url_flags}": " ".join(f"--replica {u}" for u in worker_urls),
        "{python}": shlex.quote(sys.executable),
    }
    text = template
    for key, value in values.items():
        text = text.replace(key, value)
    argv = shlex.split(text)
    if not argv:
        raise ValueError(f"external template {template!r} expands to nothing")
    return argv


def contender_key(name: str, users: int, sweep: bool) -> str:
    return f"{name}@u{users}" if sweep else name


# ----------------------------------------------------------------------------------------------
# processes
# ----------------------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class _Proc:
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
        self.procs: list[_Proc] = []

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> _Proc:
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
        proc = _Proc(name, list(argv), popen, log_path)
        self.procs.append(proc)
        return proc

    @staticmethod
    def _signal(proc: _Proc, sig: int) -> None:
        if proc.popen.poll() is not None:
            return
        try:
            os.killpg(proc.popen.pid, sig)  # start_new_session: pgid == pid
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                proc.popen.send_signal(sig)

    def stop(self, procs: Sequence[_Proc], grace_s: float = 5.0) -> None:
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


async def _wait_ready(
    http: aiohttp.ClientSession,
    proc: _Proc,
    base_url: str,
    path: str,
    timeout_s: float,
    accept: Callable[[int], bool],
) -> None:
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


# ----------------------------------------------------------------------------------------------
# the comparison
# ----------------------------------------------------------------------------------------------


@dataclass
class CompareConfig:
    replicas: int = 8
    profile: str = "kimi-k2.6-b200-tp4"
    workload: str = "coding-agent"
    policies: Sequence[str] = ("coding-agent", "consistent_hash", "round_robin", "prefix_aware")
    externals: Sequence[Contender] = ()
    users: Sequence[int] = (8,)
    duration_s: float = 60.0
    seed: int = 0
    time_scale: float = 1.0
    drain_timeout_s: float = 30.0
    ramp_s: float = 0.0  # model seconds over which the users start
    warm_start: bool = False  # first sessions start mid-life (steady-state contexts, cold caches)
    warmup_s: float = 0.0  # model seconds left out of the results
    metrics_interval_s: float = 0.5
    ready_timeout_s: float = 60.0
    command: str | None = None  # the command line, for the report

    def contenders(self) -> list[Contender]:
        out = [Contender(name=p, policy=p) for p in self.policies] + list(self.externals)
        names = [c.name for c in out]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"contender names must be unique: {', '.join(dupes)}")
        if not out:
            raise ValueError("nothing to compare: give --policies and/or --external")
        return out


@dataclass
class RunData:
    """One contender at one users level: the contract result plus the raw data behind the charts."""

    contender: str
    users: int
    result: dict[str, Any]
    wall_s: float
    records: list[RequestRecord] = field(default_factory=list)
    load_samples: list[tuple[float, list[float]]] = field(default_factory=list)
    warmup_s: float = 0.0  # records and samples before this (model s) are not in ``result``


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


def _router_config_file(path: Path, policy: str, port: int, urls: Sequence[str]) -> None:
    data = {
        "server": {"host": "127.0.0.1", "port": port, "replica_header": True},
        "replicas": list(urls),
        "policy": {"name": policy, "params": {}},
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))


async def _start_replicas(
    cfg: CompareConfig, group: ProcessGroup, http: aiohttp.ClientSession, say: Say
) -> list[str]:
    urls: list[str] = []
    procs: list[_Proc] = []
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
        *(_wait_ready(http, p, u, "/health", cfg.ready_timeout_s, lambda s: s == 200) for p, u in zip(procs, urls))
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
) -> tuple[_Proc, str]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    if c.template is None:
        conf = tmp / f"router-{c.name}.yaml"
        _router_config_file(conf, c.policy or c.name, port, urls)
        argv = [sys.executable, "-m", "kvrouter.cli", "serve", "--config", str(conf),
                "--policy", c.policy or c.name]
        proc = group.start(c.name, argv)
        await _wait_ready(http, proc, base, "/ready", cfg.ready_timeout_s, lambda s: s == 200)
    else:
        proc = group.start(c.name, expand_template(c.template, port, urls))
        await _wait_ready(http, proc, base, "/health", cfg.ready_timeout_s, lambda s: s < 500)
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


def build_compare_report(
    cfg: CompareConfig,
    workload: WorkloadConfig,
    contenders: Sequence[Contender],
    runs: Sequence[RunData],
    wall_s: float,
) -> dict[str, Any]:
    sweep = len(cfg.users) > 1
    results: dict[str, Any] = {}
    by_contender: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        results[contender_key(r.contender, r.users, sweep)] = r.result
        by_contender.setdefault(r.contender, []).append({"users": r.users, **r.result})
    report: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "workload": {
            **workload.model_dump(mode="json"),
            "seed": cfg.seed,
            "users": list(cfg.users) if sweep else cfg.users[0],
            "arrival_rate": None,
            "duration_s": cfg.duration_s,
            "time_scale": cfg.time_scale,
            "ramp_s": cfg.ramp_s,
            "warm_start": cfg.warm_start,
            "warmup_s": cfg.warmup_s,
            "replicas": cfg.replicas,
            "profile": cfg.profile,
            "contenders": {
                c.name: ({"policy": c.policy} if c.template is None else {"external": c.template})
                for c in contenders
            },
            "wall_s": round(wall_s, 1),
        },
        "results": results,
    }
    if sweep:
        report["sweep"] = by_contender
    return report


# ----------------------------------------------------------------------------------------------
# table
# ----------------------------------------------------------------------------------------------


def _f(v: Any, digits: int = 2, pct: bool = False) -> str:
    if v is None:
        return "-"
    if pct:
        return f"{100 * v:.1f}%"
    if isinstance(v, float) and abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}"


def markdown_table(runs: Sequence[RunData]) -> str:
    head = (
        "| contender | users | ok | failed | TTFT p50 (s) | TTFT p95 (s) | cache hit | out tok/s/user "
        "| tok/min/replica | e2e p95 (s) | load max/mean | load CV | sessions/replica |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        x = r.result
        spr = x.get("sessions_per_replica") or []
        lines.append(
            f"| {r.contender} | {r.users or '-'} | {x['requests_ok']} | {x['requests_failed']} "
            f"| {_f(x['ttft_p50_s'], 3)} | {_f(x['ttft_p95_s'], 3)} | {_f(x['cache_hit_rate'], pct=True)} "
            f"| {_f(x['output_tps_per_user'], 1)} | {_f(x['tokens_per_min_per_replica'], 0)} "
            f"| {_f(x['e2e_p95_s'], 2)} | {_f(x['load_max_over_mean'], 2)} | {_f(x['load_cv'], 2)} "
            f"| {'/'.join(str(s) for s in spr) if spr else '-'} |"
        )
    return "\n".join(lines)


def failures_table(runs: Sequence[RunData]) -> str:
    """Failed requests of every run by reason (HTTP status, message); "" when none failed."""
    rows = [(r, f) for r in runs for f in r.result.get("failures") or ()]
    if not rows:
        return ""
    lines = ["| contender | users | status | reason | requests |", "|---|---|---|---|---:|"]
    for r, f in rows:
        message = str(f["message"]).replace("|", "\\|")
        lines.append(f"| {r.contender} | {r.users or '-'} | {f['status'] or '-'} | {message} | {f['count']} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# charts
# ----------------------------------------------------------------------------------------------


def _pyplot() -> Any:
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, pil_kwargs={"optimize": True})  # small PNGs: they are checked in
    plt.close(fig)


def _names(runs: Sequence[RunData]) -> list[str]:
    return list(dict.fromkeys(r.contender for r in runs))


def _colors(names: Sequence[str]) -> dict[str, Any]:
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
    return {n: palette[i % len(palette)] for i, n in enumerate(names)}


def chart_interactivity(runs: Sequence[RunData], path: Path) -> None:
    plt = _pyplot()
    names = _names(runs)
    colors = _colors(names)
    fig, ax = plt.subplots(figsize=(6, 4), dpi=80)
    for name in names:
        pts = sorted(
            (r.users, r.result["output_tps_per_user"], r.result["tokens_per_min_per_replica"])
            for r in runs
            if r.contender == name
            and r.result["output_tps_per_user"] is not None
            and r.result["tokens_per_min_per_replica"] is not None
        )
        if not pts:
            continue
        xs = [p[1] for p in pts]
        ys = [p[2] for p in pts]
        ax.plot(xs, ys, "o-", color=colors[name], label=name, markersize=4, linewidth=1.2)
        for users, x, y in pts:
            ax.annotate(f"u{users}", (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7,
                        color=colors[name])
    ax.set_xlabel("output tokens/s per user (median)")
    ax.set_ylabel("tokens/min per replica")
    ax.set_title("Interactivity vs throughput (labels: concurrent users)", fontsize=9)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    _save(plt, fig, path)


def chart_ttft(runs: Sequence[RunData], path: Path) -> None:
    """Grouped box plot: one group per users level, one box per contender (whiskers p5-p95)."""
    plt = _pyplot()
    names = _names(runs)
    colors = _colors(names)
    levels = sorted({r.users for r in runs})
    fig, ax = plt.subplots(figsize=(6, 4), dpi=80)
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        data, pos = [], []
        for i, users in enumerate(levels):
            ttft = [
                rec.ttft_s for r in runs if r.contender == name and r.users == users
                for rec in r.records if rec.ok and rec.ttft_s is not None and rec.start_s >= r.warmup_s
            ]
            if ttft:
                data.append([max(t, 1e-4) for t in ttft])
                pos.append(i - 0.4 + width * (j + 0.5))
        if not data:
            continue
        bp = ax.boxplot(data, positions=pos, widths=width * 0.85, whis=(5, 95), showfliers=False,
                        patch_artist=True, manage_ticks=False)
        for box in bp["boxes"]:
            box.set(facecolor=colors[name], alpha=0.55, edgecolor=colors[name])
        for part in ("whiskers", "caps", "medians"):
            for line in bp[part]:
                line.set(color=colors[name] if part != "medians" else "black", linewidth=1)
        ax.plot([], [], "s", color=colors[name], alpha=0.6, label=name)
    ax.set_xticks(range(len(levels)))
    ax.set_xticklabels([f"{u} users" for u in levels])
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (model s, log)")
    ax.set_title("TTFT per request (box p25-p75, whiskers p5-p95)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    _save(plt, fig, path)


def chart_replica_load(runs: Sequence[RunData], path: Path) -> None:
    """Running requests per replica over time, one panel per contender (highest users level)."""
    plt = _pyplot()
    names = _names(runs)
    top = max(r.users for r in runs)
    chosen = [next(r for r in runs if r.contender == n and r.users == top) for n in names]
    fig, axes = plt.subplots(len(chosen), 1, figsize=(6, 4), dpi=80, sharex=True, sharey=True, squeeze=False)
    for ax, r in zip(axes[:, 0], chosen):
        if r.load_samples:
            t = [s[0] / 60.0 for s in r.load_samples]
            n_rep = len(r.load_samples[0][1])
            for k in range(n_rep):
                ax.plot(t, [s[1][k] for s in r.load_samples], linewidth=0.9, drawstyle="steps-post", antialiased=False)
        if r.warmup_s > 0:
            ax.axvspan(0, r.warmup_s / 60.0, color="0.9", linewidth=0)
        ax.set_ylabel(r.contender, fontsize=7, rotation=0, ha="right", va="center")
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("model time (min)")
    shaded = " (grey: warm-up, not measured)" if any(r.warmup_s for r in chosen) else ""
    fig.suptitle(f"Running requests per replica, {top} users{shaded}", fontsize=9)
    _save(plt, fig, path)


def write_charts(runs: Sequence[RunData], out_dir: Path) -> list[Path]:
    """The three PNGs; [] when matplotlib is missing."""
    try:
        _pyplot()
    except ImportError:
        return []
    paths = [out_dir / f for f in CHART_FILES]
    chart_interactivity(runs, paths[0])
    chart_ttft(runs, paths[1])
    chart_replica_load(runs, paths[2])
    return paths


# ----------------------------------------------------------------------------------------------
# outputs
# ----------------------------------------------------------------------------------------------


def report_markdown(cfg: CompareConfig, report: dict[str, Any], runs: Sequence[RunData], charts: bool) -> str:
    w = report["workload"]
    walls = [r.wall_s for r in runs]
    lines = ["# Router comparison", ""]
    if cfg.command:
        lines += ["```", cfg.command, "```", ""]
    lines += [
        f"{cfg.replicas} simulated replicas (`{cfg.profile}`), workload `{w['name']}` (seed {cfg.seed}), "
        f"closed-loop users {', '.join(str(u) for u in cfg.users)}, {cfg.duration_s:g} s of wall time per "
        f"run at time scale {cfg.time_scale:g} (~{cfg.duration_s * cfg.time_scale / 60:.1f} model minutes), "
        + (f"users starting evenly over the first {cfg.ramp_s:g} model seconds, " if cfg.ramp_s else "")
        + ("each user's first session starting mid-life (warm start: steady-state context sizes, cold "
           "caches), " if cfg.warm_start else "")
        + (f"the first {cfg.warmup_s:g} model seconds not measured, " if cfg.warmup_s else "")
        + f"caches flushed before every run. Times are model seconds. Whole comparison: {w['wall_s']:.0f} s wall"
        + (f" (runs {min(walls):.0f}-{max(walls):.0f} s incl. drain)." if walls else "."),
        "",
        markdown_table(runs),
        "",
        "Columns: `ok`/`failed` requests; TTFT percentiles; `cache hit` = cached / prompt tokens; "
        "`out tok/s/user` = median per-request decode speed; `tok/min/replica` = prompt + output tokens "
        "per model minute per replica; `load max/mean` and `load CV` = imbalance of running requests "
        "across replicas (mean over samples); `sessions/replica` = distinct sessions each replica served.",
        "",
    ]
    failures = failures_table(runs)
    if failures:
        lines += ["Failed requests by reason (HTTP status or SSE error code, message with numbers as N):", "",
                  failures, ""]
    if charts:
        lines += [f"![{f[:-4]}]({f})" for f in CHART_FILES] + [""]
    else:
        lines += ["Charts skipped: matplotlib is not installed (`pip install 'kvrouter[charts]'`).", ""]
    return "\n".join(lines)


def write_outputs(
    cfg: CompareConfig,
    report: dict[str, Any],
    runs: Sequence[RunData],
    out_dir: Path | None,
    json_path: Path | None,
) -> list[Path]:
    written: list[Path] = []
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        written.append(json_path)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        charts = write_charts(runs, out_dir)
        written += charts
        md = out_dir / "report.md"
        md.write_text(report_markdown(cfg, report, runs, bool(charts)))
        written.append(md)
        if json_path is None:
            default_json = out_dir / "results.json"
            default_json.write_text(json.dumps(report, indent=2) + "\n")
            written.append(default_json)
    return written

