"""Live sweep: real Claude Code sessions replayed through real routers in front of live replicas.

For every point of (replica kind x KV capacity x chars per token), this starts ``--replicas``
fresh replica processes, then runs every contender in turn on them, side by side in the same run:
caches flushed, the contender started, the same trace sessions replayed through it
(:func:`kvrouter.loadtest.driver.run_load` with ``arrivals``), the contender stopped.

- Replica kinds: ``sim`` is ``kvrouter sim-replica`` (the project's SGLang model, ``--profile``
  with ``max_total_num_tokens`` set to the point's capacity); ``mini`` is
  ``benchmarks/mini_replica.py``, a deliberately different engine (plain LRU of pages, FCFS, its
  own timing), so a result does not rest on the project's own simulator.
- Capacities are given in sessions (``--capacities 4,2,0.7``): the median peak context of the
  replayed top-level sessions (prompt + output, trace tokens) times the factor, at least the largest
  request plus room for its output, then converted to the replica's tokens at the point's ratio
  (trace text is 4 bytes per trace token; a replica at ``X`` chars per token counts ``4 / X`` times
  as many tokens), so "room for two sessions" means the same at every ratio.
- Sessions: ``--traces`` (default set 1, ``benchmarks/traces``), or ``--session-sets 1,2,3``: every
  point replayed once per disjoint set of real sessions (:mod:`session_sets`), each set with its own
  capacities and reuse bound, written to ``OUT/set-N/`` as a single run is, with the mean and range
  per contender over the sets in ``OUT/report.md`` and ``OUT/summary.json``. ``--points`` runs a
  list of points instead of the whole grid.
- Contenders: kvrouter policies (``--policies``), kvrouter variants (``--variant 'NAME=POLICY
  KEY=VALUE ...'``: a policy with router config settings, e.g. ``learning.eviction_order=leaf_first``)
  and external routers (``--external 'NAME=TEMPLATE'``, placeholders as in ``kvrouter compare``:
  ``{port}``, ``{worker_urls}``, ``{worker_url_flags}``, ``{python}``, ``{free_port}``).
- Metrics per contender and point: the replicas' reported cache-hit rate (cached / prompt tokens
  from each response's usage, summed), TTFT p50/p95, ITL p50, failed requests, and the CPU seconds
  the router, each replica and the driver spent during the replay and the seconds each waited for
  a CPU (``cpu_s``, its ``wait`` the scheduler's run delay: on a shared host a contender's TTFT
  also pays for CPU the other processes take); with ``--records-dir``, for kvrouter contenders,
  ``router_split``: the time the router added to each request's TTFT (the client's TTFT minus the
  router's own, joined by request id to its decision log) and ``cache_prediction``: the cached
  tokens its KV index predicted against those the replicas reported; per point the trace's
  infinite-cache reuse bound; the verdict against the target is
  :mod:`live_sweep_report` (which also writes ``report.md`` and the chart).

Run (the command of docs/live-sweep): see docs/live-sweep/report.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from live_sweep_report import write_outputs, write_sets_outputs  # noqa: E402
from portable import code_version, portable_command  # noqa: E402
from replica_bound import replica_reuse_bound  # noqa: E402
from replay_accounting import cache_prediction, cpu_split, decision_rows, router_split  # noqa: E402
from session_sets import set_dir  # noqa: E402

from kvrouter.loadtest.compare import _flush, _start_contender  # noqa: E402
from kvrouter.loadtest.compare_config import CompareConfig, Contender, parse_external, parse_variant, with_settings  # noqa: E402
from kvrouter.router.config import ConfigError, parse_config  # noqa: E402
from kvrouter.loadtest.driver import run_load  # noqa: E402
from kvrouter.loadtest.report import RequestRecord  # noqa: E402
from kvrouter.loadtest.process_group import ProcessGroup, RunningProcess, free_port, wait_ready  # noqa: E402
from kvrouter.loadtest.trace_claude_code import claude_code_arrivals  # noqa: E402
from kvrouter.loadtest.trace_session import Arrivals  # noqa: E402
from kvrouter.loadtest.trace_stats import reuse_bound, trace_summary  # noqa: E402

TRACE_TOKEN_BYTES = 4  # the replayed text renders every trace token as 4 ASCII bytes
TRACE_PAGE_TOKENS = 64  # the traces' block size: the reuse bound's page
OUTPUT_ROOM_TOKENS = 2048  # a capacity must hold the largest request plus this (outputs are ~200 tokens)
CONTEXT_LENGTH = 4_000_000  # replicas accept any replayed prompt at any ratio
MINI = ROOT / "benchmarks" / "mini_replica.py"


@dataclass(frozen=True)
class Point:
    kind: str  # "sim" | "mini"
    capacity_sessions: float
    chars_per_token: float

    @property
    def label(self) -> str:
        return f"{self.kind} cap={self.capacity_sessions:g}s cpt={self.chars_per_token:g}"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _points(text: str) -> list[Point]:
    out = []
    for item in (x for x in text.split(",") if x.strip()):
        kind, capacity, cpt = item.split(":")
        if kind not in ("sim", "mini"):
            raise argparse.ArgumentTypeError(f"{item}: the kind is sim or mini")
        out.append(Point(kind, float(capacity), float(cpt)))
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Live sweep of routers over replayed Claude Code sessions")
    p.add_argument("--traces", nargs="+", default=None,
                   help="kv-cache-tester trace files or folders (default benchmarks/traces)")
    p.add_argument("--session-sets", type=_ints, default=None, metavar="N,N,...",
                   help="replay every point once per session set instead of --traces (1 is benchmarks/traces, "
                   "N benchmarks/traces/setN; see benchmarks/session_sets.py): each set its own replay, "
                   "capacities and reuse bound, in OUT/set-N/, the mean and range over sets in OUT/report.md")
    p.add_argument("--max-requests", type=int, default=12, help="first requests replayed per session")
    p.add_argument("--limit", type=int, help="top-level sessions replayed at most")
    p.add_argument("--stagger", type=float, default=5.0, help="model seconds between session starts")
    p.add_argument("--max-think", type=float, default=30.0,
                   help="model seconds a pause between two requests of a session lasts at most")
    p.add_argument("--max-context", type=int, default=100_000, help="drop trace requests longer than this")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--kinds", default="sim,mini", help="replica kinds: sim, mini")
    p.add_argument("--capacities", type=_floats, default=[4.0, 2.5, 1.0],
                   help="KV per replica, in median sessions (at least the largest request)")
    p.add_argument("--chars-per-token", type=_floats, default=[1.5, 4.0, 8.0])
    p.add_argument("--points", type=_points, default=None, metavar="KIND:CAPACITY:CPT,...",
                   help="run exactly these points (e.g. sim:2.5:4,mini:1:4) instead of the grid of "
                   "--kinds x --capacities x --chars-per-token")
    p.add_argument("--profile", default="kimi-k2.6-b200-tp4", help="sim replica profile")
    p.add_argument("--policies", default="coding-agent,prefix_aware,consistent_hash",
                   help="kvrouter policies (the first is the one judged)")
    p.add_argument("--external", action="append", default=[], metavar="'NAME=COMMAND TEMPLATE'")
    p.add_argument("--variant", action="append", default=[], metavar="'NAME=POLICY KEY=VALUE ...'",
                   help="kvrouter with a policy and router config settings (dotted keys, YAML "
                   "values), a baseline beside --policies: 'ca_leaf_first=coding-agent "
                   "learning.eviction_order=leaf_first'")
    p.add_argument("--time-scale", type=float, default=16.0, help="model seconds per wall second")
    p.add_argument("--run-timeout", type=float, default=300.0, help="wall seconds one replay may take")
    p.add_argument("--out-dir", default="live-sweep")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--records-dir", help="also keep every request (JSON lines per point and contender) "
                   "and, for kvrouter contenders, the router's decision log, in this folder")
    args = p.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    if not set(args.kinds) <= {"sim", "mini"}:
        p.error("--kinds: sim and/or mini")
    args.policies = [x for x in args.policies.split(",") if x]
    if args.session_sets is not None and args.traces is not None:
        p.error("--session-sets replaces --traces: give one of them")
    if args.traces is None:
        args.traces = [str(ROOT / "benchmarks" / "traces")]
    if args.session_sets is not None:
        if not args.session_sets or len(set(args.session_sets)) != len(args.session_sets):
            p.error("--session-sets: distinct set numbers, e.g. 1,2,3")
        missing = [n for n in args.session_sets if n < 1 or not set_dir(n).is_dir()]
        if missing:
            p.error(f"--session-sets: no such set: {', '.join(map(str, missing))}")
    try:
        args.externals = [parse_external(e) for e in args.external]
        args.variants = [parse_variant(v) for v in args.variant]
        for v in args.variants:  # a bad setting fails here, not once the replicas are up
            parse_config(with_settings({"replicas": ["http://127.0.0.1:1"],
                                        "policy": {"name": v.policy, "params": {}}}, v.settings))
    except (ValueError, ConfigError) as exc:
        p.error(str(exc))
    names = args.policies + [c.name for c in args.variants + args.externals]
    if len(set(names)) != len(names):
        p.error(f"contender names must differ: {', '.join(names)}")
    return args


def load_trace(args: argparse.Namespace) -> Arrivals:
    arrivals = claude_code_arrivals(
        [Path(t) for t in args.traces], stagger_s=args.stagger, limit=args.limit,
        max_requests=args.max_requests, max_context_tokens=args.max_context,
    )
    return [(at, s.restarted(args.max_think)) for at, s in arrivals]


def render_prompts(arrivals: Arrivals) -> int:
    """Generate the text of every replayed request once, before any contender runs; returns the
    characters generated. A segment's text is made on first use and kept, and every contender
    replays the same segments: without this the first contender (the judged policy) paid for
    making it (2.3 s of the driver's CPU over the 144 requests of the default replay, up to
    ~190 ms for one request on a loaded 2-core box, 16 times that in model time) and the others
    found it made. The driver renders during a request's think time, off its event loop and
    before its clock starts, but that CPU still competes with the replay's processes."""
    chars = 0
    for _, session in arrivals:
        for _, request in session.planned():
            for segment in request.segments:
                chars += len(segment.text())
    return chars


def session_sizes(arrivals: Arrivals) -> dict[str, float]:
    """Peak context (prompt + output, trace tokens) of the top-level sessions, and the largest request."""
    peaks, largest = [], 0
    for _, s in arrivals:
        sizes = [r.prompt_tokens + r.max_tokens for _, r in s.planned()]
        largest = max(largest, *sizes)
        if "/" not in s.session_id:  # sub-agents are not sessions of their own
            peaks.append(max(sizes))
    return {"median_peak_tokens": statistics.median(peaks), "largest_request_tokens": largest}


def capacity_tokens(sizes: dict[str, float], sessions: float, chars_per_token: float) -> int:
    trace_tokens = max(sessions * sizes["median_peak_tokens"], sizes["largest_request_tokens"] + OUTPUT_ROOM_TOKENS)
    return int(trace_tokens * TRACE_TOKEN_BYTES / chars_per_token)


def add_single_point_args(p: argparse.ArgumentParser) -> None:
    """The options of a benchmark that replays this sweep's trace at one point with one policy."""
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--capacity", type=float, default=4.0, help="KV per replica, in median sessions")
    p.add_argument("--chars-per-token", type=float, default=8.0)
    p.add_argument("--policy", default="coding-agent")


def single_point_replay(args: argparse.Namespace) -> tuple[Arrivals, int]:
    """This sweep's trace, profile, time scale and seed copied onto `args` (from the sweep's
    defaults), the arrivals with every prompt rendered, and the replicas' KV capacity in tokens."""
    sweep_args = parse_args([])
    for key in ("traces", "max_requests", "limit", "stagger", "max_think", "max_context", "profile",
                "time_scale", "run_timeout", "seed"):
        setattr(args, key, getattr(sweep_args, key))
    arrivals = load_trace(args)
    capacity = capacity_tokens(session_sizes(arrivals), args.capacity, args.chars_per_token)
    render_prompts(arrivals)
    return arrivals, capacity


def replica_argv(point: Point, port: int, capacity: int, args: argparse.Namespace, tmp: Path, i: int) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port), "--time-scale", f"{args.time_scale:g}",
              "--chars-per-token", f"{point.chars_per_token:g}"]
    if point.kind == "mini":
        return [sys.executable, str(MINI), *common, "--max-total-tokens", str(capacity)]
    profile = tmp / f"profile-{capacity}.yaml"
    # gpu_free_gib: null turns off the memory derivation check: the capacity is the point's, not the GPU's
    profile.write_text(yaml.safe_dump({"base": args.profile, "max_total_num_tokens": capacity, "gpu_free_gib": None,
                                       "description": f"{args.profile} with {capacity} KV tokens"}))
    return [sys.executable, "-m", "kvrouter.cli", "sim-replica", *common, "--profile", str(profile),
            "--context-length", str(CONTEXT_LENGTH), "--seed", str(args.seed + i)]


async def start_replicas(point: Point, capacity: int, args: argparse.Namespace, group: ProcessGroup,
                         http: aiohttp.ClientSession, tmp: Path) -> tuple[list[RunningProcess], list[str]]:
    procs, urls = [], []
    for i in range(args.replicas):
        port = free_port()
        procs.append(group.start(f"{point.kind}-replica{i}", replica_argv(point, port, capacity, args, tmp, i)))
        urls.append(f"http://127.0.0.1:{port}")
    await asyncio.gather(*(wait_ready(http, p, u, "/health", 60.0, lambda s: s == 200) for p, u in zip(procs, urls)))
    return procs, urls


def records_stem(point: Point, contender: str) -> str:
    """File name stem of one point's and contender's kept records (`--records-dir`)."""
    return f"{point.kind}-cap{point.capacity_sessions:g}-cpt{point.chars_per_token:g}-{contender}"


def write_records(path: Path, records: list[RequestRecord], replica_names: dict[str, str]) -> None:
    """One JSON line per request, in start order; replicas named replica0..N-1 (the URLs change
    every run)."""
    with path.open("wb") as f:
        for r in sorted(records, key=lambda r: r.start_s):
            row = dataclasses.asdict(r)
            if r.replica is not None:
                row["replica"] = replica_names.get(r.replica.rstrip("/"), r.replica)
            f.write(orjson.dumps(row) + b"\n")


async def replay_arrivals(base: str, arrivals: Arrivals, urls: list[str], args: argparse.Namespace,
                          contender: str, records_out: list[Any] | None = None) -> dict[str, Any]:
    """Replay `arrivals` (each session restarted) through the router at `base`, as every
    contender of a point is replayed; `run_load`'s report."""
    return await run_load(
        base, "coding-agent", None, args.run_timeout, seed=args.seed, time_scale=args.time_scale,
        replica_metrics_urls=urls, progress=lambda line: None, contender=contender,
        drain_timeout_s=30.0, arrivals=[(at, s.restarted()) for at, s in arrivals],
        records_out=records_out,
    )


async def run_contender(c: Contender, arrivals: Arrivals, urls: list[str], args: argparse.Namespace,
                        group: ProcessGroup, http: aiohttp.ClientSession, tmp: Path, label: str,
                        point: Point, replica_pids: list[int] | None = None) -> dict[str, Any]:
    await asyncio.gather(*(_flush(http, u) for u in urls))
    cfg = CompareConfig(replicas=len(urls), ready_timeout_s=60.0)
    keep = Path(args.records_dir) if args.records_dir else None
    observability = None
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        observability = {"decision_log": str(keep / f"{records_stem(point, c.name)}.decisions.jsonl")}
    proc, base = await _start_contender(c, urls, cfg, group, http, tmp, observability)
    records: list[RequestRecord] = []
    pids = replica_pids or []
    try:
        cpu_before = cpu_split(proc.popen.pid, pids)  # from ready: not the router's start-up
        t0 = time.monotonic()
        report = await replay_arrivals(base, arrivals, urls, args, c.name, records)
        wall = time.monotonic() - t0
        cpu = cpu_split(proc.popen.pid, pids, cpu_before)
    finally:
        group.stop([proc])
    split = prediction = None
    if keep is not None:
        names = {u.rstrip("/"): f"replica{i}" for i, u in enumerate(urls)}
        write_records(keep / f"{records_stem(point, c.name)}.requests.jsonl", records, names)
        decisions = decision_rows(keep / f"{records_stem(point, c.name)}.decisions.jsonl")
        split = router_split(records, decisions, args.time_scale)
        prediction = cache_prediction(decisions)
    result = report["results"][c.name]
    print(f"{label} {c.name}: hit {result['cache_hit_rate']}, ttft p95 {result['ttft_p95_s']}, "
          f"failed {result['requests_failed']}, {wall:.0f} s, CPU s router {cpu['router']}, "
          f"replicas {sum(cpu['replicas']):.2f}, driver {cpu['driver']}; waited for a CPU: router "
          f"{cpu['wait']['router']}, replicas {sum(cpu['wait']['replicas']):.2f}, driver {cpu['wait']['driver']}",
          file=sys.stderr, flush=True)
    if split is not None:
        print(f"{label} {c.name}: router-added time to first token, wall ms: p50 {split['added_ms_p50']}, "
              f"mean {split['added_ms_mean']} (handler to replica write p50 {split['routed_ms_p50']})",
              file=sys.stderr, flush=True)
    return {**result, "wall_s": round(wall, 1), "cpu_s": cpu, **({"router_split": split} if split else {}),
            **({"cache_prediction": prediction} if prediction else {})}


async def sweep(args: argparse.Namespace, arrivals: Arrivals, sizes: dict[str, float],
                group: ProcessGroup, tmp: Path) -> list[dict[str, Any]]:
    contenders = [Contender(name=p, policy=p) for p in args.policies] + args.variants + args.externals
    points = args.points or [
        Point(k, cap, cpt) for k in args.kinds for cap in args.capacities for cpt in args.chars_per_token
    ]
    # each replica kind's and ratio's bound, before any replay (not after a point's, to be lost)
    bounds = {(p.kind, p.chars_per_token): round(replica_reuse_bound(arrivals, p.kind, p.chars_per_token,
                                                                     args.profile), 4) for p in points}
    out = []
    async with aiohttp.ClientSession() as http:
        for n, point in enumerate(points, 1):
            capacity = capacity_tokens(sizes, point.capacity_sessions, point.chars_per_token)
            label = f"[{n}/{len(points)}] {point.label}"
            procs, urls = await start_replicas(point, capacity, args, group, http, tmp)
            try:
                results = {}
                for c in contenders:
                    results[c.name] = await run_contender(c, arrivals, urls, args, group, http, tmp, label, point,
                                                          [p.popen.pid for p in procs])
            finally:
                group.stop(procs)
            out.append({"kind": point.kind, "capacity_sessions": point.capacity_sessions,
                        "chars_per_token": point.chars_per_token, "capacity_tokens": capacity,
                        "capacity_median_sessions": round(
                            capacity * point.chars_per_token / TRACE_TOKEN_BYTES / sizes["median_peak_tokens"], 2),
                        "reuse_bound": bounds[point.kind, point.chars_per_token],
                        "results": results})
    return out


def sweep_traces(args: argparse.Namespace, traces: list[str]) -> dict[str, Any]:
    """Every point replayed on the sessions of `traces`: the data of one results.json (verdicts
    and the command are added by the caller)."""
    args = argparse.Namespace(**{**vars(args), "traces": traces})
    t0 = time.monotonic()
    code = code_version()  # the code every contender imports as it starts, read before the first
    arrivals = load_trace(args)
    if not arrivals:
        raise SystemExit(f"no sessions in {', '.join(traces)}")
    sizes = session_sizes(arrivals)
    bound = reuse_bound(arrivals, TRACE_PAGE_TOKENS)
    render_prompts(arrivals)
    with tempfile.TemporaryDirectory(prefix="kvrouter-live-sweep-") as tmpdir:
        group = ProcessGroup(Path(tmpdir))
        try:
            points = asyncio.run(sweep(args, arrivals, sizes, group, Path(tmpdir)))
        finally:
            group.close()
    return {
        "schema": 1,
        "command": "",
        "code": code,
        "wall_s": round(time.monotonic() - t0, 1),
        "judged": args.policies[0],
        "peers": [c.name for c in args.externals],
        "baselines": args.policies[1:] + [v.name for v in args.variants],
        "replicas": args.replicas,
        "time_scale": args.time_scale,
        "trace": {
            "files": sorted({Path(t).name for t in traces}),
            "max_requests_per_session": args.max_requests,
            "stagger_s": args.stagger,
            "max_think_s": args.max_think,
            "max_context_tokens": args.max_context,
            **trace_summary(arrivals),
            **sizes,
            "reuse_bound": round(bound, 4),
        },
        "points": points,
    }


def _save(data: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_outputs(data, out_dir)
    (out_dir / "results.json").write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = portable_command(["python", *sys.argv] if argv is None else ["python", "benchmarks/live_sweep.py", *argv])
    out_dir = Path(args.out_dir)
    if args.session_sets is None:
        data = sweep_traces(args, args.traces)
        data["command"] = command
        _save(data, out_dir)
        print(f"live sweep done in {data['wall_s']:.0f} s: {out_dir}/report.md", file=sys.stderr)
        return 0
    t0 = time.monotonic()
    sets = []
    for number in args.session_sets:
        print(f"session set {number}", file=sys.stderr, flush=True)
        data = sweep_traces(args, [str(set_dir(number))])
        data["command"] = command
        data["session_set"] = number
        _save(data, out_dir / f"set-{number}")
        sets.append(data)
    write_sets_outputs(sets, out_dir, command, round(time.monotonic() - t0, 1))
    print(f"live sweep of {len(sets)} session sets done in {time.monotonic() - t0:.0f} s: {out_dir}/report.md",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
