"""Where a streamed request's added time to first byte goes inside the router, at C=1.

Starts the SGLang-shaped upstream (benchmarks/upstream.py) and `kvrouter serve` with timestamps
taken at the points of a request's critical path, then sends `--requests` streamed chat
requests one at a time (aiohttp client, keep-alive) and prints the median of each segment:

    head parsed -> body complete -> summary done -> decision made -> upstream write issued
    -> upstream head read -> handler resumed -> upstream first chunk read
    -> first client write issued

The timestamps come from wrappers this script installs around the router's functions in the
router's own process before it starts (the router's code has no timing hook: nothing costs
anything in a normal run). `--prompt-kb N` makes every request's prompt N KB of text no
earlier request had (a new conversation, or the turn after a compaction), instead of the small
fixed one. With `--strace`, a second batch runs under `strace -c -f` attached
to each router (kvrouter without the wrappers, and every `--external` router) and prints the
system calls per request of each.

    python benchmarks/critical_path.py [--requests 300] [--strace] [--prompt-kb 360] \
        [--external 'vllm-router=vllm-router --host 127.0.0.1 --port {port} --worker-urls {worker_urls} --policy round_robin --prometheus-port 29111']
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# The segments, in order: (mark that starts it, mark that ends it).
MARKS = ("head_parsed", "body_complete", "summary_done", "decision_made", "upstream_write",
         "upstream_head", "handler_resumed", "upstream_first_chunk", "client_first_write")


# -- inside the router's process ---------------------------------------------------------------------
# The router functions the marks wrap, "module:Class.attribute" under kvrouter.router, found by
# name when the router starts: a renamed one stops the run with its name (the base marks) or is
# listed in the results as not installed (the finer marks), never silently left out.
BASE_HOOKS = (  # (mark, target, "before" or "after" the call); the first four are wrapped by hand
    ("head_parsed", "data_connection:Connection.on_headers_complete", "before"),
    ("client_first_write", "data_connection:Connection.connection_made", "after"),
    ("upstream_write", "upstream_http:_Connection.connection_made", "after"),
    ("handler_resumed", "relay:Relay._relay", "before"),
    ("body_complete", "data_connection:Connection.on_message_complete", "after"),
    ("summary_done", "handlers:Handlers._summarize_now", "after"),
    ("decision_made", "engine:RoutingEngine.place", "after"),
    ("upstream_head", "upstream_http:_Connection.on_headers_complete", "after"),
    ("upstream_first_chunk", "upstream_response:UpstreamResponse._feed", "before"),  # first only
)
DETAIL_HOOKS = (  # --detail: finer marks inside the segments
    ("d:dispatch", "data_server:DataServer.dispatch", "before"),
    ("d:client_data_done", "data_connection:Connection.buffer_updated", "after"),
    ("d:handle_inference", "handlers:Handlers.handle_inference", "before"),
    ("d:body_parsed", "body_prefixes:BodyPrefixes.loads", "after"),
    ("d:forward", "relay:Relay.forward", "before"),
    ("d:route_enter", "placement:RequestRoute.__aenter__", "before"),
    ("d:decided", "engine:RoutingEngine.decide", "after"),
    ("d:placement_init", "placement:Placement.__init__", "before"),
    ("d:attempts", "relay:Relay._attempts", "before"),
    ("d:pool_send", "upstream_http:UpstreamPool.send", "before"),
    ("d:serialized", "upstream_http:_serialize", "after"),
    ("d:stream_response", "data_http:StreamResponse.__init__", "before"),
    ("d:relay_body", "relay:Relay._relay_body", "before"),
    ("d:first_byte_start", "relay:Relay._first_byte", "before"),
    ("d:first_byte_end", "relay:Relay._first_byte", "after"),
    ("d:stream_write", "data_http:StreamResponse.write", "before"),
)


def resolve(target: str) -> tuple[Any, str, Any]:
    """(owner, attribute, its current value or None) of a "module:Class.attribute" target."""
    import importlib

    module, _, path = target.partition(":")
    owner: Any = importlib.import_module(f"kvrouter.router.{module}")
    *classes, attr = path.split(".")
    for name in classes:
        owner = getattr(owner, name, None)
        if owner is None:
            return None, attr, None
    return owner, attr, getattr(owner, attr, None)


def missing_hooks(hooks: tuple[tuple[str, str, str], ...]) -> list[str]:
    """The targets of `hooks` this router does not have."""
    return [target for _, target, _ in hooks if resolve(target)[2] is None]


def _install_marks(out_path: str, detail: bool) -> None:
    """Wrap the router's functions so that each request's marks are recorded (C=1: one request
    at a time, so the marks of one request follow each other), written to `out_path` at exit
    with the finer marks this router has no target for."""
    import atexit

    from kvrouter.router import data_connection, relay, upstream_http

    gone = missing_hooks(BASE_HOOKS)
    if gone:
        raise SystemExit(f"critical_path.py: the router has no {', '.join(gone)}: update BASE_HOOKS")
    now = time.perf_counter_ns
    events: list[tuple[str, int]] = []
    state = {"client_written": True, "chunk_seen": True}

    def mark(name: str) -> None:
        events.append((name, now()))

    def after(name: str, target: str) -> None:
        cls, attr, original = resolve(target)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            mark(name)
            return result

        setattr(cls, attr, wrapped)

    def before(name: str, target: str, *, first_only: str | None = None) -> None:
        cls, attr, original = resolve(target)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if first_only is None or not state[first_only]:
                if first_only is not None:
                    state[first_only] = True
                mark(name)
            return original(*args, **kwargs)

        setattr(cls, attr, wrapped)

    def head_parsed(original: Any) -> Any:
        def wrapped(self: Any) -> Any:
            state["client_written"] = state["chunk_seen"] = False
            mark("head_parsed")
            return original(self)
        return wrapped

    conn_cls = data_connection.Connection
    conn_cls.on_headers_complete = head_parsed(conn_cls.on_headers_complete)

    class Transport:
        """A transport whose first write of each request is marked."""

        def __init__(self, inner: Any, name: str, flag: str | None) -> None:
            self._inner, self._name, self._flag = inner, name, flag

        def write(self, data: Any) -> None:
            self._mark()
            self._inner.write(data)

        def writelines(self, data: Any) -> None:
            self._mark()
            self._inner.writelines(data)

        def _mark(self) -> None:
            if self._flag is None:
                mark(self._name)
            elif not state[self._flag]:
                state[self._flag] = True
                mark(self._name)

        def __getattr__(self, attr: str) -> Any:
            return getattr(self._inner, attr)

    def wrap_transport(cls: Any, name: str, flag: str | None) -> None:
        original = cls.connection_made

        def wrapped(self: Any, transport: Any) -> None:
            original(self, transport)
            self.transport = Transport(self.transport, name, flag)

        cls.connection_made = wrapped

    wrap_transport(conn_cls, "client_first_write", "client_written")
    wrap_transport(upstream_http._Connection, "upstream_write", None)
    original_relay = relay.Relay._relay

    async def resumed(self: Any, *args: Any, **kwargs: Any) -> Any:
        mark("handler_resumed")
        return await original_relay(self, *args, **kwargs)

    relay.Relay._relay = resumed  # type: ignore[method-assign]
    for name, target, when in BASE_HOOKS[4:]:
        if when == "after":
            after(name, target)
        else:
            before(name, target, first_only="chunk_seen" if name == "upstream_first_chunk" else None)
    missing = missing_hooks(DETAIL_HOOKS) if detail else []
    if detail:  # finer marks: where each segment's time goes (each wrapper costs ~0.5 us)
        for name, target, when in DETAIL_HOOKS:
            if target not in missing:
                (after if when == "after" else before)(name, target)

    def dump() -> None:
        Path(out_path).write_text(json.dumps({"events": events, "not_installed": missing}))

    atexit.register(dump)


def _serve_marked(out_path: str, detail: bool, argv: list[str]) -> int:
    _install_marks(out_path, detail)
    from kvrouter.cli import main

    return main(argv)


# -- the driver --------------------------------------------------------------------------------------
def segments(events: list[tuple[str, int]], skip: int) -> dict[str, Any]:
    """Per request (from one head_parsed to the next), the microseconds between consecutive
    marks, in the order they happened; medians over the requests after the first `skip`."""
    requests: list[dict[str, int]] = []
    for name, t in events:
        if name == "head_parsed":
            requests.append({})
        if requests and name not in requests[-1]:
            requests[-1][name] = t
    rows = [r for r in requests[skip:] if all(m in r for m in MARKS)]
    order: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        seq = sorted(r, key=lambda m: r[m])
        for a, b in zip(seq, seq[1:]):
            order.setdefault((a, b), []).append((r[b] - r[a]) / 1000)
    total = [(r["client_first_write"] - r["upstream_first_chunk"] + r["upstream_write"] - r["body_complete"]) / 1000
             for r in rows]
    return {
        "requests": len(rows),
        "segments_us": {f"{a} -> {b}": {"n": len(v), "p50": statistics.median(v)}
                        for (a, b), v in sorted(order.items(), key=lambda kv: -len(kv[1]))},
        "router_cpu_path_us_p50": statistics.median(total) if total else None,
    }


async def _batch(url: str, n: int, prompt_kb: float = 0) -> list[float]:
    """TTFB of `n` streamed requests, one at a time; with `prompt_kb`, each request's prompt is
    that many KB of text no earlier request had (a new conversation's first turn, or one after
    a compaction: nothing to reuse, every byte parsed and hashed)."""
    import random

    import aiohttp
    import dp_scenarios as sc

    rng = random.Random(0)
    ttfb = []
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            messages = ([{"role": "user", "content": sc.code_text(rng, int(prompt_kb * 1000))}]
                        if prompt_kb else sc.MESSAGES)
            first, _total = await sc._aiohttp_stream(session, url, 20, messages)
            ttfb.append(first * 1000)
    return ttfb


def _strace(pid: int, url: str, n: int, prompt_kb: float = 0) -> dict[str, float]:
    """System calls per request of process `pid` (and its threads) over n streamed requests."""
    out = tempfile.NamedTemporaryFile(suffix=".strace", delete=False).name
    tracer = subprocess.Popen(["strace", "-c", "-f", "-qq", "-o", out, "-p", str(pid)],
                              stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached to every thread
    asyncio.run(_batch(url, n, prompt_kb))
    tracer.send_signal(signal.SIGINT)
    tracer.wait(30)
    calls: dict[str, float] = {}
    for line in Path(out).read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
            calls[parts[-1]] = int(parts[3]) / n
    os.unlink(out)
    return dict(sorted(calls.items(), key=lambda kv: -kv[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--strace", action="store_true", help="also count system calls per request")
    parser.add_argument("--external", action="append", default=[], metavar="NAME=COMMAND")
    parser.add_argument("--detail", action="store_true", help="finer marks inside the segments")
    parser.add_argument("--prompt-kb", type=float, default=0,
                        help="each request a new prompt of this many KB (default: the small fixed one)")
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--serve-marked", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.serve_marked:
        return _serve_marked(args.serve_marked, args.detail, rest)
    import dataplane as dp
    from kvrouter.loadtest.process_group import free_port

    result: dict[str, Any] = {"loadavg_at_start": os.getloadavg()}
    up_port = free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    marks_path = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    with contextlib.ExitStack() as stack:
        stack.enter_context(dp.process([sys.executable, str(HERE / "upstream.py"), str(up_port)],
                                       up_port, "upstream"))
        port = free_port()
        marked = [sys.executable, __file__, "--serve-marked", marks_path,
                  *(["--detail"] if args.detail else []), "serve", "--replica",
                  upstream, "--port", str(port)]
        with dp.process(marked, port, "kvrouter-marked"):
            ttfb = asyncio.run(_batch(f"http://127.0.0.1:{port}", args.requests + 20, args.prompt_kb))
        result["marked_ttfb_ms_p50"] = statistics.median(ttfb[20:])
        marks = json.loads(Path(marks_path).read_text())
        result["critical_path"] = segments(marks["events"], 20)
        result["marks_not_installed"] = marks["not_installed"]  # (--detail: not in this router)
        os.unlink(marks_path)
        if args.strace:
            if shutil.which("strace") is None:
                parser.error("--strace needs strace")
            routers = {}
            port = free_port()
            routers["kvrouter"] = (stack.enter_context(dp.process(dp.kvrouter_cmd(upstream, port), port, "kvrouter")),
                                   f"http://127.0.0.1:{port}")
            for spec in args.external:
                name, _, template = spec.partition("=")
                port = free_port()
                cmd = [a.format(port=port, worker_urls=upstream, python=sys.executable)
                       for a in shlex.split(template)]
                routers[name] = (stack.enter_context(dp.process(cmd, port, name)), f"http://127.0.0.1:{port}")
            result["syscalls_per_request"] = {}
            for name, (proc, url) in routers.items():
                asyncio.run(_batch(url, 20, args.prompt_kb))  # warm
                result["syscalls_per_request"][name] = _strace(proc.pid, url, args.requests, args.prompt_kb)
    result["loadavg_at_end"] = os.getloadavg()
    path = result["critical_path"]
    print(f"{path['requests']} requests; TTFB p50 through the marked router {result['marked_ttfb_ms_p50']:.2f} ms;"
          f" router's own critical path (body complete -> upstream write, first chunk -> client write) "
          f"p50 {path['router_cpu_path_us_p50']:.0f} us")
    for seg, v in path["segments_us"].items():
        print(f"  {seg:50} p50 {v['p50']:8.1f} us  (n={v['n']})")
    if result["marks_not_installed"]:
        print("marks not installed (no such function in this router): " + ", ".join(result["marks_not_installed"]))
    for name, calls in result.get("syscalls_per_request", {}).items():
        print(f"{name}: system calls per request: total {sum(calls.values()):.1f}; " + ", ".join(
            f"{k} {v:.2f}" for k, v in calls.items() if v >= 0.05))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
