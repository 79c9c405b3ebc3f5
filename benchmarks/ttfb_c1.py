"""Streaming time to first byte at C=1, small prompt, as benchmarks/dataplane.py's scenario (a)
measures it (the same three clients: aiohttp, async httpx, the OpenAI SDK), with each sample kept:
per round every target is asked once, one after the other (each round starting one target
later), so a router's sample can be paired with the direct one of the same round (the median of those differences moves less on a busy
machine than the difference of two medians; both are printed).

    python benchmarks/ttfb_c1.py [--requests 150] [--repeats 3] [--first-event-ms 0] \\
        [--kvrouter NAME=PYTHONPATH ...] [--external NAME=COMMAND ...] [--json out.json]

`--first-event-ms`: the upstream pauses this long between its headers and its first event, as a
replica's prefill does. `--kvrouter NAME=DIR` adds another kvrouter whose package is imported
from DIR (a checkout of another commit laid out as the installed package), to compare two
commits in one run. `--external` as in dataplane.py ({port}, {worker_urls}, {python}).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import dataplane as dp  # noqa: E402
import dp_scenarios as sc  # noqa: E402
from portable import portable_command  # noqa: E402
from kvrouter.loadtest.process_group import free_port  # noqa: E402

CHUNKS = 20


async def rounds(targets: dict[str, str], n: int, clients: list[str]) -> dict[str, dict[str, list[float]]]:
    """TTFB in ms per client and target, `n` rounds after 5 dropped warm-up rounds."""
    import aiohttp
    import httpx
    import openai

    session = aiohttp.ClientSession()
    hx = httpx.AsyncClient(timeout=30)
    oa = {t: openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=30)
          for t, url in targets.items()}
    runners: dict[str, Any] = {
        "aiohttp": lambda t, url: sc._aiohttp_stream(session, url, CHUNKS),
        "httpx": lambda t, url: sc._httpx_stream(hx, url, CHUNKS),
        "openai": lambda t, url: asyncio.to_thread(sc._openai_stream, oa[t], CHUNKS),
    }
    out: dict[str, dict[str, list[float]]] = {c: {t: [] for t in targets} for c in clients}
    try:
        order = list(targets.items())
        for i in range(n + 5):
            # Each round starts one target later: each is asked after each of the others equally
            # often (the one before it may still be tidying up its last request).
            turn = order[i % len(order):] + order[:i % len(order)]
            for c in clients:
                for t, url in turn:
                    first, _ = await runners[c](t, url)
                    if i >= 5:
                        out[c][t].append(first * 1e3)
    finally:
        await session.close()
        await hx.aclose()
        for client in oa.values():
            client.close()
    return out


def added(samples: dict[str, list[float]], target: str) -> tuple[float, float]:
    """(p50 minus direct's p50, median of the per-round differences), ms."""
    direct = samples["direct"]
    mine = samples[target]
    return (statistics.median(mine) - statistics.median(direct),
            statistics.median(a - b for a, b in zip(mine, direct)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=150, help="rounds per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", default="aiohttp,httpx,openai")
    parser.add_argument("--first-event-ms", type=float, default=0.0)
    parser.add_argument("--kvrouter", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--external", action="append", default=[], metavar="NAME=COMMAND")
    parser.add_argument("--json", help="write the samples and summaries here")
    args = parser.parse_args()
    clients = [c for c in args.clients.split(",") if c]
    up_port = free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    with contextlib.ExitStack() as stack:
        stack.enter_context(dp.process(
            [sys.executable, str(HERE / "upstream.py"), str(up_port), "--server", "uvicorn",
             "--first-event-ms", str(args.first_event_ms)], up_port, "upstream"))
        targets = {"direct": upstream}
        port = free_port()
        stack.enter_context(dp.process(dp.kvrouter_cmd(upstream, port), port, "kvrouter"))
        targets["kvrouter"] = f"http://127.0.0.1:{port}"
        for spec in args.kvrouter:
            name, _, path = spec.partition("=")
            port = free_port()
            env = {**os.environ, "PYTHONPATH": path}
            stack.enter_context(dp.process(dp.kvrouter_cmd(upstream, port), port, name, env=env))
            targets[name] = f"http://127.0.0.1:{port}"
        for spec in args.external:
            name, _, template = spec.partition("=")
            port = free_port()
            cmd = [a.format(port=port, worker_urls=upstream, python=sys.executable)
                   for a in shlex.split(template)]
            stack.enter_context(dp.process(cmd, port, name))
            targets[name] = f"http://127.0.0.1:{port}"
        others = [t for t in targets if t != "direct"]
        result: dict[str, Any] = {"command": portable_command(sys.argv), "machine": dp.machine(),
                                  "when": time.strftime("%Y-%m-%d %H:%M:%S"), "repeats": []}
        print("TTFB added over direct, ms: p50 difference / median of per-round differences")
        for r in range(args.repeats):
            samples = asyncio.run(rounds(targets, args.requests, clients))
            summary = {c: {"direct_p50_ms": statistics.median(samples[c]["direct"]),
                           **{t: dict(zip(("added_p50_ms", "paired_median_ms"), added(samples[c], t)))
                              for t in others}} for c in clients}
            result["repeats"].append({"samples_ms": samples, "summary": summary,
                                      "loadavg_after": os.getloadavg()[0]})
            for c in clients:
                print(f"  repeat {r}  {c:8} direct {summary[c]['direct_p50_ms']:.3f}  " + "  ".join(
                    f"{t} {summary[c][t]['added_p50_ms']:+.3f}/{summary[c][t]['paired_median_ms']:+.3f}"
                    for t in others), flush=True)
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
