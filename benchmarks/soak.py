"""Soak: mixed streaming load through a real router process to simulated replicas, with faults.

    python benchmarks/soak.py --duration 600 --json soak.json --markdown soak.md

Starts `--replicas` `kvrouter sim-replica` processes and one `kvrouter serve` (admin API on), then
runs `--concurrency` closed-loop clients for `--duration` seconds: streaming chats, non-streaming
chats and clients that leave mid-stream. Every `--fault-every` seconds one fault is injected, in
rotation: a replica SIGKILLed and restarted on its port; a replica removed and re-added through
the admin API; a replica drained through the admin API and re-added; a replica SIGSTOPped (accepts,
never answers) for a few seconds; with `--redis` (Redis affinity, a local Redis-protocol server),
also Redis SIGSTOPped for 2 s, longer than the store's op timeout. Router RSS and open fds are sampled from /proc every
`--sample-every` seconds. Accounting is exact: every request sent is classified once as ok, clean
error (OpenAI-shaped error status, or SSE error event + [DONE]), left on purpose by the client,
broken (truncated/reset without a clean error) or hung (no end within --request-timeout);
`lost = broken + hung` must be 0. At the end the router is SIGTERMed (exit code reported) and every
surviving replica's running count must be back to 0, and with `--redis` no in-flight count may
be left in Redis (a leaked count makes a session look busier to every router).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kvrouter.loadtest.process_group import free_port

ADMIN_TOKEN = "soak-admin-token"


def proc_sample(pid: int) -> tuple[int, int]:
    """(RSS in KiB, open file descriptors) of a process, from /proc."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


class Replica:
    def __init__(self, workdir: Path, seed: int, time_scale: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.seed, self.time_scale, self.workdir = seed, time_scale, workdir
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.workdir / f"sim-{self.port}.log", "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvrouter.cli", "sim-replica", "--port", str(self.port),
             "--profile", "tiny", "--time-scale", str(self.time_scale), "--seed", str(self.seed)],
            stdout=log, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)


async def wait_http(client: aiohttp.ClientSession, url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with client.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                if r.status == 200:
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} not up after {timeout}s")


class Soak:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.rng = random.Random(args.seed)
        self.outcomes: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.sent = 0
        self.samples: list[dict[str, Any]] = []
        self.faults: list[dict[str, Any]] = []
        self.replicas = [Replica(workdir, i, args.time_scale) for i in range(args.replicas)]
        self.stopping = False
        self.redis: Any = None

    # -- one request ---------------------------------------------------------------------------
    async def one(self, client: aiohttp.ClientSession, worker: int, n: int) -> str:
        roll = self.rng.random()
        stream = roll < 0.8
        leave = roll < 0.1
        body = {"model": "tiny", "stream": stream, "ignore_eos": True,
                "max_tokens": self.rng.randint(10, 150),
                "messages": [{"role": "user", "content": f"session {worker} turn {n} " + "code " * self.rng.randint(20, 400)}]}
        headers = {"x-session-id": f"w{worker}-s{n // 5}"}
        self.kinds["leave" if leave else ("stream" if stream else "unary")] += 1
        try:
            async with asyncio.timeout(self.args.request_timeout):
                async with client.post(self.url + "/v1/chat/completions", json=body, headers=headers) as resp:
                    if resp.status != 200:
                        data = await resp.read()
                        try:
                            return "clean_error" if "error" in json.loads(data) else "broken"
                        except ValueError:
                            return "broken"
                    if leave:
                        await resp.content.readuntil(b"\n\n")
                        resp.close()
                        return "left"
                    data = await resp.read()
                    if not stream:
                        return "ok" if json.loads(data).get("choices") else "broken"
                    if not data.endswith(b"data: [DONE]\n\n") or data.count(b"data: [DONE]") != 1:
                        return "broken"
                    return "clean_error" if b'"upstream_error"' in data else "ok"
        except TimeoutError:
            return "hung"
        except (aiohttp.ClientError, ValueError):
            return "broken"

    async def worker(self, client: aiohttp.ClientSession, w: int) -> None:
        n = 0
        while not self.stopping:
            self.sent += 1
            outcome = await self.one(client, w, n)
            self.outcomes[outcome] += 1
            n += 1
            await asyncio.sleep(self.rng.uniform(0, 0.05))

    # -- faults ---------------------------------------------------------------------------------
    async def admin(self, client: aiohttp.ClientSession, method: str, path: str, **kw: Any) -> int:
        async with client.request(method, self.admin_url + path,
                                  headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, **kw) as r:
            await r.read()
            return r.status

    async def fault(self, client: aiohttp.ClientSession, i: int) -> None:
        rep = self.replicas[i % len(self.replicas)]
        kinds = ("sigkill", "remove_readd", "drain_readd", "sigstop") + (("redis_stall",) if self.redis else ())
        kind = kinds[i % len(kinds)]
        started = time.monotonic() - self.t0
        if kind == "redis_stall":
            self.redis.pause()
            await asyncio.sleep(2)
            self.redis.resume()
        elif kind == "sigkill":
            rep.kill()
            await asyncio.sleep(5)
            rep.start()
            await wait_http(client, rep.url + "/health")
        elif kind == "remove_readd":
            await self.admin(client, "DELETE", "/admin/replicas", params={"url": rep.url})
            await asyncio.sleep(5)
            await self.admin(client, "POST", "/admin/replicas", json={"url": rep.url})
        elif kind == "drain_readd":
            await self.admin(client, "POST", "/admin/replicas/drain", json={"url": rep.url})
            for _ in range(60):
                async with client.get(self.admin_url + "/admin/replicas",
                                      headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
                    urls = [x["url"] for x in (await r.json())["replicas"]]
                if rep.url not in urls:
                    break
                await asyncio.sleep(0.5)
            await self.admin(client, "POST", "/admin/replicas", json={"url": rep.url})
        else:
            rep.signal(signal.SIGSTOP)
            await asyncio.sleep(3)
            rep.signal(signal.SIGCONT)
        self.faults.append({"t_s": round(started, 1), "fault": kind,
                            "replica": None if kind == "redis_stall" else rep.url})

    async def faults_loop(self, client: aiohttp.ClientSession) -> None:
        i = 0
        while not self.stopping:
            await asyncio.sleep(self.args.fault_every)
            if self.stopping:
                break
            await self.fault(client, i)
            i += 1

    async def sampler(self) -> None:
        while True:
            rss, fds = proc_sample(self.router.pid)
            self.samples.append({"t_s": round(time.monotonic() - self.t0), "rss_kib": rss, "fds": fds,
                                 "sent": self.sent, **dict(self.outcomes)})
            if self.stopping:
                return
            await asyncio.sleep(self.args.sample_every)

    async def affinity_errors(self, client: aiohttp.ClientSession) -> dict[str, float]:
        """kvrouter_affinity_store_errors_total by operation, from the router's /metrics."""
        async with client.get(self.url + "/metrics") as resp:
            text = await resp.text()
        errors: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("kvrouter_affinity_store_errors_total{"):
                op = line.split('op="', 1)[1].split('"', 1)[0]
                errors[op] = errors.get(op, 0) + float(line.rsplit(" ", 1)[1])
        return errors

    async def redis_counts(self) -> dict[str, Any]:
        """In-flight counts left in Redis once nothing is in flight (after a heartbeat, which sets
        right the sessions a failed call left uncertain)."""
        import redis.asyncio as aioredis

        await asyncio.sleep(2.5)  # > lease_s / 3: one more heartbeat
        r = aioredis.Redis.from_url(self.redis.url)
        try:
            total = sessions = nonzero = 0
            async for key in r.scan_iter(match="{kvrouter:b*}s:*", count=1000):
                sessions += 1
                counts = [int(v) for f, v in (await r.hgetall(key)).items() if f.startswith(b"r:")]
                total += sum(counts)
                nonzero += any(counts)
            return {"sessions": sessions, "sessions_with_counts": nonzero, "total_count": total}
        finally:
            await r.aclose()

    # -- run --------------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        a = self.args
        for r in self.replicas:
            r.start()
        port, admin_port = free_port(), free_port()
        self.url, self.admin_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
        config = {
            "server": {"host": "127.0.0.1", "port": port, "shutdown_grace_s": 30},
            "replicas": [r.url for r in self.replicas],
            "policy": {"name": "coding-agent"},
            "signals": {"interval_s": 0.25, "timeout_s": 0.5, "failure_threshold": 2},
            "upstream": {"total_timeout_s": 20, "connect_timeout_s": 1.0},
            "admin": {"port": admin_port},
        }
        if a.redis:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
            from tests.redis_server import RedisProcess

            self.redis = RedisProcess(self.workdir)
            self.redis.start()
            config["affinity"] = {"store": "redis", "redis_url": self.redis.url, "lease_s": 3.0}
        cfg = self.workdir / "router.yaml"
        cfg.write_text(yaml.safe_dump(config))
        router_log = open(self.workdir / "router.log", "w")
        self.router = subprocess.Popen(
            [sys.executable, "-m", "kvrouter.cli", "serve", "--config", str(cfg)],
            stdout=router_log, stderr=subprocess.STDOUT, env={**os.environ, "KVROUTER_ADMIN_TOKEN": ADMIN_TOKEN})
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as client:
            for r in self.replicas:
                await wait_http(client, r.url + "/health")
            await wait_http(client, self.url + "/ready")
            self.t0 = time.monotonic()
            sampler = asyncio.create_task(self.sampler())
            faults = asyncio.create_task(self.faults_loop(client))
            workers = [asyncio.create_task(self.worker(client, w)) for w in range(a.concurrency)]
            await asyncio.sleep(a.duration)
            self.stopping = True
            await asyncio.gather(*workers)
            faults.cancel()
            try:
                await faults
            except asyncio.CancelledError:
                pass
            for r in self.replicas:  # whatever the last fault left stopped or dead comes back
                r.signal(signal.SIGCONT)
                if r.proc is None or r.proc.poll() is not None:
                    r.start()
            await asyncio.sleep(2.0)  # let router-side aborts reach the replicas
            running = {}
            for r in self.replicas:
                try:
                    async with client.get(r.url + "/v1/loads") as resp:
                        e = (await resp.json())["loads"][0]
                        running[r.url] = e["num_running_reqs"] + e["num_waiting_reqs"]
                except aiohttp.ClientError:
                    running[r.url] = None
            await sampler
            redis_counts = await self.redis_counts() if self.redis else None
            if redis_counts is not None:  # how many of the store's calls failed (and were settled)
                redis_counts["failed_calls"] = await self.affinity_errors(client)
        elapsed = time.monotonic() - self.t0
        self.router.send_signal(signal.SIGTERM)
        code = self.router.wait(60)
        for r in self.replicas:
            r.kill()
        if self.redis:
            self.redis.kill()
        lost = self.outcomes["broken"] + self.outcomes["hung"]
        accounted = sum(self.outcomes.values())
        return {
            "duration_s": round(elapsed, 1), "concurrency": a.concurrency, "replicas": a.replicas,
            "sent": self.sent, "outcomes": dict(self.outcomes), "kinds": dict(self.kinds),
            "accounted": accounted, "balanced": accounted == self.sent, "lost": lost,
            "router_exit_code": code, "replica_running_after": running,
            "redis_counts_after": redis_counts,
            "faults": self.faults, "samples": self.samples,
        }


def markdown(report: dict[str, Any]) -> str:
    s = report["samples"]
    o = report["outcomes"]
    rss = [x["rss_kib"] / 1024 for x in s]
    fds = [x["fds"] for x in s]
    warm = [x for x in s if x["t_s"] >= 60] or s
    first_rss, last_rss = warm[0]["rss_kib"] / 1024, s[-1]["rss_kib"] / 1024
    lines = [
        f"Duration {report['duration_s']} s, {report['concurrency']} concurrent clients, "
        f"{report['replicas']} simulated replicas, {len(report['faults'])} faults injected "
        f"({', '.join(sorted(Counter(f['fault'] for f in report['faults'])))}).",
        "",
        "| sent | ok | clean errors | left mid-stream (on purpose) | broken | hung | lost |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {report['sent']} | {o.get('ok', 0)} | {o.get('clean_error', 0)} | {o.get('left', 0)} | "
        f"{o.get('broken', 0)} | {o.get('hung', 0)} | **{report['lost']}** |",
        "",
        f"Accounting balanced (sent = sum of outcomes): **{report['balanced']}**. Router exit code "
        f"after SIGTERM: **{report['router_exit_code']}**. Replica running+waiting after the run: "
        f"{list(report['replica_running_after'].values())}.",
        "",
    ]
    if report.get("redis_counts_after") is not None:
        c = report["redis_counts_after"]
        lines += [f"Redis affinity: {c['sessions']} sessions in Redis at the end; in-flight counts left "
                  f"there with nothing in flight: **{c['total_count']}** "
                  f"({c['sessions_with_counts']} sessions). Store calls that failed during the run "
                  f"(timed out or refused), by operation: {c.get('failed_calls')}.", ""]
    lines += [
        f"Router RSS: min {min(rss):.1f} MiB, max {max(rss):.1f} MiB; after warm-up (t>=60 s) "
        f"{first_rss:.1f} -> {last_rss:.1f} MiB at the end. Open fds: min {min(fds)}, max {max(fds)}, "
        f"median {statistics.median(fds):.0f}, last {fds[-1]}.",
        "",
        "| t (s) | RSS (MiB) | open fds | sent so far | ok | clean errors | left | broken | hung |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in s:
        lines.append(f"| {x['t_s']} | {x['rss_kib'] / 1024:.1f} | {x['fds']} | {x['sent']} | {x.get('ok', 0)} | "
                     f"{x.get('clean_error', 0)} | {x.get('left', 0)} | {x.get('broken', 0)} | {x.get('hung', 0)} |")
    lines += ["", "Faults: " + "; ".join(f"{f['t_s']} s {f['fault']}" for f in report["faults"])]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="wall seconds of load")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--time-scale", type=float, default=0.3, help="the simulated replicas' --time-scale")
    p.add_argument("--fault-every", type=float, default=20.0)
    p.add_argument("--sample-every", type=float, default=15.0)
    p.add_argument("--request-timeout", type=float, default=60.0, help="a request not ended by then is 'hung'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--redis", action="store_true", help="Redis affinity, and Redis stalls among the faults")
    p.add_argument("--json", help="write the full report here")
    p.add_argument("--markdown", help="write the markdown summary here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvrouter-soak-") as tmp:
        soak = Soak(args, Path(tmp))
        try:
            report = asyncio.run(soak.run())
        finally:
            for r in soak.replicas:
                r.kill()
            router = getattr(soak, "router", None)
            if router is not None and router.poll() is None:
                router.kill()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    md = markdown(report)
    if args.markdown:
        Path(args.markdown).write_text(md)
    print(md)
    ok = report["lost"] == 0 and report["balanced"] and report["router_exit_code"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
