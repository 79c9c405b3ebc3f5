"""Implementations of ``kvrouter loadtest``, ``kvrouter compare`` and ``kvrouter demo``.

The argument parsers live in :mod:`kvrouter.cli` (``_add_loadtest``, ``_add_compare``,
``_add_demo``); each command here takes the parsed namespace and returns an exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .compare import run_compare
from .compare_config import CompareConfig, RunData, parse_external
from .compare_report import failures_table, markdown_table, write_outputs
from .demo_settings import DEMO_POLICIES, DEMO_PROFILE
from .demo_summary import demo_report, summarize_rounds, verdict
from .fit import limits_for_profile, limits_from_metrics, refusal
from .process_group import CompareError
from .report import RequestRecord
from .traces import trace_sessions
from .workload_config import WorkloadConfigError, load_workload


def _err(msg: str) -> None:
    print(f"kvrouter: {msg}", file=sys.stderr)


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so every ``finally`` (subprocess cleanup) runs."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


# ----------------------------------------------------------------------------------------------
# kvrouter loadtest
# ----------------------------------------------------------------------------------------------


# Simulated replicas (and Kimi K2.6) serve 256K of context; longer trace requests are dropped.
TRACE_MAX_CONTEXT_TOKENS = 262_144


def _metrics_limits(urls: list[str]) -> Any:
    """The first replica's per-request limits from its /metrics page (None if unreadable)."""
    import urllib.request

    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                text = resp.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            continue
        limits = limits_from_metrics(text, f"replica {url}")
        if limits is not None:
            return limits
    return None


def cmd_loadtest(args: argparse.Namespace) -> int:
    given = sum(x is not None for x in (args.users, args.arrival_rate, args.trace))
    if given != 1:
        _err("loadtest: give exactly one of --users, --arrival-rate and --trace")
        return 2
    arrivals = None
    if args.trace is not None:
        try:
            arrivals = trace_sessions(args.trace, max_context_tokens=TRACE_MAX_CONTEXT_TOKENS)
        except (OSError, ValueError) as exc:
            _err(f"loadtest: --trace {args.trace}: {exc}")
            return 2
    try:
        workload = load_workload(args.workload)
    except WorkloadConfigError as exc:
        _err(str(exc))
        return 2
    if arrivals is None and args.replica_metrics:
        limits = _metrics_limits(args.replica_metrics)
        why = refusal(workload, limits, args.seed) if limits is not None else None
        if why:
            _err(f"loadtest: {why}")
            return 2
    headers: dict[str, str] = {}
    for item in args.header:
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            _err(f"loadtest: --header {item!r}: want 'NAME: VALUE'")
            return 2
        headers[name.strip()] = value.strip()
    from .driver import run_load

    records: list[RequestRecord] = []
    t0 = time.monotonic()
    with _sigterm_as_interrupt():
        report = asyncio.run(
            run_load(
                args.target, workload, args.users, args.duration, seed=args.seed, time_scale=args.time_scale,
                replica_metrics_urls=args.replica_metrics or (), arrival_rate=args.arrival_rate,
                contender=args.contender, model=args.model, drain_timeout_s=args.drain_timeout,
                records_out=records, ramp_s=args.ramp, warm_start=args.warm_start, warmup_s=args.warmup,
                arrivals=arrivals, headers=headers,
            )
        )
    if args.trace is not None:
        report["workload"]["trace"] = args.trace
    result = report["results"][args.contender]
    run = RunData(args.contender, args.users or 0, result, time.monotonic() - t0)
    print(markdown_table([run]))
    if failures_table([run]):
        print("\nfailed requests by reason:\n" + failures_table([run]))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"results: {path}")
    return 0 if result["requests_ok"] > 0 else 1


# ----------------------------------------------------------------------------------------------
# kvrouter compare / demo
# ----------------------------------------------------------------------------------------------


def _compare_command(cfg: CompareConfig, out_dir: Path | None, json_path: Path | None) -> str:
    """The canonical ``kvrouter compare`` command line for ``cfg`` (every effective parameter)."""
    argv = [
        "kvrouter", "compare", "--replicas", str(cfg.replicas), "--profile", cfg.profile,
        "--workload", cfg.workload, "--policies", ",".join(cfg.policies),
    ]
    for c in cfg.externals:
        argv += ["--external", f"{c.name}={c.template}"]
    argv += [
        "--users", ",".join(str(u) for u in cfg.users), "--duration", f"{cfg.duration_s:g}",
        "--seed", str(cfg.seed), "--time-scale", f"{cfg.time_scale:g}",
    ]
    if cfg.ramp_s:
        argv += ["--ramp", f"{cfg.ramp_s:g}"]
    if cfg.warm_start:
        argv += ["--warm-start"]
    if cfg.warmup_s:
        argv += ["--warmup", f"{cfg.warmup_s:g}"]
    if cfg.drain_timeout_s != 30.0:
        argv += ["--drain-timeout", f"{cfg.drain_timeout_s:g}"]
    if json_path is not None:
        argv += ["--json", str(json_path)]
    if out_dir is not None:
        argv += ["--out-dir", str(out_dir)]
    return shlex.join(argv)


def _run_and_report(
    cfg: CompareConfig, out_dir: Path | None, json_path: Path | None
) -> tuple[int, list[Path]]:
    t0 = time.monotonic()
    try:
        with _sigterm_as_interrupt():
            report, runs = run_compare(cfg)
    except CompareError as exc:
        _err(f"compare failed: {exc}")
        return 1, []
    except KeyboardInterrupt:
        _err("compare interrupted; all replicas and routers stopped")
        return 130, []
    written = write_outputs(cfg, report, runs, out_dir, json_path)
    print()
    print(markdown_table(runs))
    print()
    if failures_table(runs):
        print("failed requests by reason:\n" + failures_table(runs) + "\n")
    for path in written:
        print(f"wrote {path}")
    if out_dir is not None and not any(p.suffix == ".png" for p in written):
        print("charts skipped: matplotlib is not installed (pip install 'kvrouter[charts]')")
    print(f"total wall time {time.monotonic() - t0:.0f} s")
    failed_everything = any(r.result["requests_ok"] == 0 for r in runs)
    return (1 if failed_everything else 0), written


def cmd_compare(args: argparse.Namespace) -> int:
    try:
        externals = [parse_external(s) for s in args.external or ()]
        load_workload(args.workload)
        cfg = CompareConfig(
            replicas=args.replicas, profile=args.profile, workload=args.workload,
            policies=args.policies, externals=externals, users=args.users, duration_s=args.duration,
            seed=args.seed, time_scale=args.time_scale, drain_timeout_s=args.drain_timeout, ramp_s=args.ramp,
            warm_start=args.warm_start, warmup_s=args.warmup,
        )
        cfg.contenders()
        why = refusal(load_workload(cfg.workload), limits_for_profile(cfg.profile), cfg.seed)
    except (OSError, ValueError, WorkloadConfigError) as exc:
        _err(f"compare: {exc}")
        return 2
    if why:
        _err(f"compare: {why}")
        return 2
    out_dir = Path(args.out_dir) if args.out_dir else None
    json_path = Path(args.json) if args.json else None
    cfg.command = _compare_command(cfg, out_dir, json_path)
    return _run_and_report(cfg, out_dir, json_path)[0]




def _demo_config(args: argparse.Namespace, seed: int) -> CompareConfig:
    return CompareConfig(
        replicas=args.replicas, profile=DEMO_PROFILE, workload="coding-agent", policies=DEMO_POLICIES,
        users=[args.users], duration_s=args.duration, seed=seed, time_scale=args.time_scale,
        drain_timeout_s=30.0, ramp_s=args.ramp, warm_start=True, warmup_s=args.warmup,
    )


def cmd_demo(args: argparse.Namespace) -> int:
    """`--rounds` comparisons with seeds SEED, SEED+1, ...: each round's report, JSON and charts in
    OUT_DIR/round-SEED/; the summary (means, ranges, rounds won, the verdict in words) in
    OUT_DIR/report.md and OUT_DIR/summary.json."""
    out_dir = Path(args.out_dir)
    if args.rounds < 1:
        _err("demo: --rounds must be >= 1")
        return 2
    seeds = [args.seed + i for i in range(args.rounds)]
    command = shlex.join([
        "kvrouter", "demo", "--out-dir", str(out_dir), "--replicas", str(args.replicas), "--users", str(args.users),
        "--rounds", str(args.rounds), "--duration", f"{args.duration:g}", "--time-scale", f"{args.time_scale:g}",
        "--ramp", f"{args.ramp:g}", "--warmup", f"{args.warmup:g}", "--seed", str(args.seed),
    ])
    why = refusal(load_workload("coding-agent"), limits_for_profile(DEMO_PROFILE), args.seed)
    if why:
        _err(f"demo: {why}")
        return 2
    model_min = args.duration * args.time_scale / 60
    estimate_min = args.rounds * (len(DEMO_POLICIES) * (args.duration + 6) + 5) / 60
    print(
        f"kvrouter demo: {args.replicas} simulated {DEMO_PROFILE} replicas (KV for ~2.7 sessions of 100k "
        f"tokens each), {args.users} coding-agent users (sessions starting mid-life, so contexts are "
        f"~100k tokens at once), policies {', '.join(DEMO_POLICIES)}; {args.rounds} rounds with seeds "
        f"{', '.join(map(str, seeds))}. Each policy gets {args.duration:g} s of wall time per round = "
        f"{model_min:.1f} model minutes (time scale {args.time_scale:g}), the first {args.warmup:g} model "
        f"seconds not measured. About {estimate_min:.1f} minutes in all.",
        flush=True,
    )
    rounds: list[dict[str, dict[str, Any]]] = []
    for seed in seeds:
        cfg = _demo_config(args, seed)
        round_dir = out_dir / f"round-{seed}"
        cfg.command = f"{command}\n# this round is the same as: {_compare_command(cfg, round_dir, None)}"
        print(f"\nround with seed {seed}", flush=True)
        code, _ = _run_and_report(cfg, round_dir, None)
        if code != 0:
            return code
        rounds.append(json.loads((round_dir / "results.json").read_text())["results"])
    summary = summarize_rounds(rounds, DEMO_POLICIES)
    words = verdict(summary, DEMO_POLICIES[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(
        json.dumps({"command": command, "seeds": seeds, **summary, "verdict": words}, indent=2) + "\n")
    body = demo_report(command, seeds, summary, words)
    (out_dir / "report.md").write_text(body)
    print("\n" + body)
    print(f"report: {(out_dir / 'report.md').resolve()} (each round's table and charts in round-SEED/)")
    return 0
