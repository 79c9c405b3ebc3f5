"""The live sweep (benchmarks/live_sweep.py) end to end, its verdicts, and the minimal replica it uses.

The sweep runs as a real subprocess: real replica processes, a kvrouter policy and a fake external
router (another `kvrouter serve`), two short Claude Code sessions, one point.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import openai
import pytest

from .benchmark_modules import load_benchmark

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "loadtest" / "data" / "traces"


def test_tiny_sweep_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [
        sys.executable, str(ROOT / "benchmarks" / "live_sweep.py"),
        "--traces", str(TRACES / "trace_0684.json"), str(TRACES / "trace_0403.json"),
        "--max-requests", "2", "--replicas", "2", "--kinds", "mini", "--capacities", "2",
        "--chars-per-token", "1.5", "--policies", "consistent_hash", "--time-scale", "50",
        "--external", "fake={python} -m kvrouter.cli serve {worker_url_flags} --port {port} --policy round_robin",
        "--variant", "ch_leaf=consistent_hash learning.eviction_order=leaf_first",
        "--out-dir", str(out), "--records-dir", str(out / "records"),
    ]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((out / "results.json").read_text())
    assert data["trace"]["sessions"] == 2 and data["trace"]["requests"] == 4
    assert 0 < data["trace"]["reuse_bound"] < 1
    [point] = data["points"]
    assert point["kind"] == "mini" and point["chars_per_token"] == 1.5
    assert data["baselines"] == ["ch_leaf"] and data["peers"] == ["fake"]
    # a kvrouter contender's index predictions against the reports, from its decision log
    prediction = data["points"][0]["results"]["ch_leaf"]["cache_prediction"]
    assert prediction["requests"] == 4 and "cache_prediction" not in data["points"][0]["results"]["fake"]
    # a variant is a kvrouter contender: its decision log is kept with the records
    assert (out / "records" / "mini-cap2-cpt1.5-ch_leaf.decisions.jsonl").stat().st_size > 0
    for name in ("consistent_hash", "ch_leaf", "fake"):
        r = point["results"][name]
        assert r["requests_ok"] == 4 and r["requests_failed"] == 0
        assert 0 < r["cache_hit_rate"] < 1  # turn 2 of each session hits its turn 1
        # who spent the CPU during the replay: the router, each replica, the driver
        cpu = r["cpu_s"]
        assert set(cpu) == {"router", "replicas", "driver", "wait"} and len(cpu["replicas"]) == 2
        assert all(x >= 0 for x in (cpu["router"], cpu["driver"], *cpu["replicas"]))
        wait = cpu["wait"]  # and how long each waited for a CPU
        assert set(wait) == {"router", "replicas", "driver"} and len(wait["replicas"]) == 2
        assert all(x >= 0 for x in (wait["router"], wait["driver"], *wait["replicas"]))
    assert point["verdict"]["best_peer_hit"] == round(point["results"]["fake"]["cache_hit_rate"], 4)
    # judged against the bound of its replicas' own tokens and pages, which no contender exceeds
    assert 0 < point["reuse_bound"] < 1 and point["verdict"]["reuse_bound"] == point["reuse_bound"]
    assert all(r["cache_hit_rate"] <= point["reuse_bound"] + 1e-4 for r in point["results"].values())
    assert "/" not in data["command"].split()[1] or not data["command"].split()[1].startswith("/")
    # the commit measured is saved with the results
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=7", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert data["code"]["commit"] == head and isinstance(data["code"]["uncommitted_changes"], bool)
    report = (out / "report.md").read_text()
    assert "| mini / " in report and " sessions / 1.5 cpt |" in report and "fake" in report
    # --records-dir: every request per contender, and the decision log of the kvrouter one
    stem = "mini-cap2-cpt1.5-consistent_hash"
    rows = [json.loads(line) for line in (out / "records" / f"{stem}.requests.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["ok"] and r["ttft_s"] > 0 for r in rows)
    assert {r["replica"] for r in rows} <= {"replica0", "replica1"}
    assert [r["start_s"] for r in rows] == sorted(r["start_s"] for r in rows)
    decisions = (out / "records" / f"{stem}.decisions.jsonl").read_text().splitlines()
    assert len(decisions) == 1 + 4 and all(json.loads(d)["status"] == 200 for d in decisions[1:])
    # each request joined to its decision-log line: the router's share of its time to first token
    assert {r["request_id"] for r in rows} == {json.loads(d)["id"] for d in decisions[1:]}
    split = point["results"]["consistent_hash"]["router_split"]
    assert split["requests"] == 4 and split["routed_ms_p50"] >= 0
    assert isinstance(split["added_ms_p50"], float) and isinstance(split["added_ms_mean"], float)
    assert "router_split" not in point["results"]["fake"]  # an external router keeps no decision log


def test_verdict_takes_the_lower_hit_target_and_the_best_peer_p95() -> None:
    verdict = load_benchmark("live_sweep_report").verdict
    point = {"results": {
        "me": {"cache_hit_rate": 0.90, "ttft_p95_s": 0.7, "requests_failed": 0},
        "peer_a": {"cache_hit_rate": 0.85, "ttft_p95_s": 1.0},
        "peer_b": {"cache_hit_rate": 0.80, "ttft_p95_s": 0.9},
    }}
    v = verdict(point, "me", ["peer_a", "peer_b"], bound=0.95)
    assert v["hit_target"] == 0.87 and v["ttft_p95_target_s"] == 0.72 and v["met"]
    v = verdict(point, "me", ["peer_a", "peer_b"], bound=0.86)  # 99% of the bound is lower
    assert v["hit_target"] == round(0.99 * 0.86, 4) and v["hit_met"]
    # the best peer within 1% of the bound: TTFT only has to be no worse than its p95
    v = verdict(point, "me", ["peer_a"], bound=0.855)
    assert v["ttft_p95_target_s"] == 1.0
    point["results"]["me"]["requests_failed"] = 1
    assert not verdict(point, "me", ["peer_a"], bound=0.95)["met"]
    assert verdict(point, "me", [], bound=0.95) is None


async def test_mini_replica_caches_prefix_pages_and_evicts_least_recent(start_app) -> None:
    mini = load_benchmark("mini_replica")
    args = mini.parse_args(["--port", "1", "--max-total-tokens", "480", "--page-tokens", "16",
                            "--time-scale", "1000", "--chars-per-token", "2"])
    url = await start_app(mini.build_app(args))
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none")

    async def cached(prompt: str) -> tuple[int, int]:
        r = await client.completions.create(model="mini", prompt=prompt, max_tokens=4)
        return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens

    a, b = "a" * 400, "b" * 400  # 200 tokens each at 2 chars per token
    try:
        assert await cached(a) == (200, 0)
        assert await cached(a + "x" * 40) == (220, 192)  # 12 whole pages of 16 tokens
        assert await cached(b) == (200, 0)
        assert await cached(b) == (200, 192)
        assert await cached("c" * 400) == (200, 0)  # 30 pages of room: a's pages go first
        assert await cached(a) == (200, 0)
        chunks = [c async for c in await client.chat.completions.create(
            model="mini", messages=[{"role": "user", "content": b}], max_tokens=5, stream=True,
            stream_options={"include_usage": True})]
        assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.prompt_tokens > 200
        async with aiohttp.ClientSession() as http:  # a prompt that can never fit: a clear 400
            async with http.post(url + "/v1/completions", json={"prompt": "d" * 2000, "max_tokens": 4}) as resp:
                assert resp.status == 400 and "do not fit" in (await resp.json())["message"]
    finally:
        await client.close()


def test_mini_replica_pinned_count_follows_pins_through_admits_releases_and_evictions() -> None:
    # /metrics reads the pinned page count on every scrape: kept as pins change, it must agree
    # with counting the pinned pages.
    import random

    cache = load_benchmark("mini_replica").PageCache(capacity_pages=60)
    rng = random.Random(1)
    held: list[tuple[list[bytes], int]] = []
    for step in range(400):
        if held and (rng.random() < 0.45 or len(held) > 4):
            cache.release(*held.pop(rng.randrange(len(held))))
        else:
            start = rng.randrange(30)
            keys = [bytes([start, i]) for i in range(rng.randint(1, 12))]  # shared prefixes pin twice
            reserve = rng.randint(0, 3)
            if cache.try_admit(keys, reserve):
                held.append((keys, reserve))
        assert cache.pinned() == sum(1 for c in cache.pages.values() if c > 0) + cache.reserved, step
    for keys, reserve in held:
        cache.release(keys, reserve)
    assert cache.pinned() == 0
    cache.flush()
    assert cache.pinned() == 0 and not cache.pages


async def test_mini_replica_request_in_its_prefill_counts_as_running_and_blocks_a_flush(start_app) -> None:
    # A flush during a prefill would drop the pages the request holds (its pins no longer
    # counted in token_usage) although the replica is busy.
    mini = load_benchmark("mini_replica")
    args = mini.parse_args(["--port", "1", "--max-total-tokens", "4800", "--page-tokens", "16",
                            "--time-scale", "1", "--chars-per-token", "2", "--prefill-base-s", "2"])
    app = mini.build_app(args)
    url = await start_app(app)
    engine = app[mini.ENGINE]
    async with aiohttp.ClientSession() as http:
        pending = asyncio.ensure_future(http.post(url + "/v1/completions", json={"prompt": "a" * 400, "max_tokens": 4}))
        deadline = asyncio.get_running_loop().time() + 10
        while engine.waiting or engine.cache.pinned() == 0:  # admitted: its prefill pass runs
            assert asyncio.get_running_loop().time() < deadline and not pending.done()
            await asyncio.sleep(0.01)
        pinned = engine.cache.pinned()
        async with http.get(url + "/metrics") as resp:
            assert 'sglang:num_running_reqs{model_name="mini"} 1' in await resp.text()
        async with http.post(url + "/flush_cache") as resp:
            assert resp.status == 400
        assert engine.cache.pinned() == pinned and engine.cache.pages
        async with await pending as resp:  # then it completes
            assert resp.status == 200


def test_restarted_session_is_fresh_and_caps_pauses() -> None:
    from kvrouter.loadtest.trace_claude_code import claude_code_arrivals

    [(_, session)] = claude_code_arrivals([TRACES / "trace_0650.json"], max_requests=12)
    assert max(r.think_time_s for _, r in session.planned()) > 60
    first = session.next_requests(None)
    capped = session.restarted(max_think_s=30.0)
    assert [r.think_time_s for _, r in capped.planned()] == [
        min(r.think_time_s, 30.0) for _, r in session.planned()
    ]
    assert capped.next_requests(None)[0].segments == first[0].segments  # starts from the first request
    assert [r.segments for _, r in capped.planned()] == [r.segments for _, r in session.planned()]


def test_every_prompt_is_rendered_before_the_first_contender_runs() -> None:
    # Segments' text is made on first use; the first contender must not pay for it in its TTFT.
    sweep = load_benchmark("live_sweep")
    args = sweep.parse_args(["--traces", str(TRACES / "trace_0684.json"), "--max-requests", "3"])
    arrivals = sweep.load_trace(args)
    segments = [seg for _, s in arrivals for _, r in s.planned() for seg in r.segments]
    assert segments and all(seg._text is None for seg in segments)
    assert sweep.render_prompts(arrivals) > 0
    assert all(seg._text is not None for seg in segments)
    replayed = arrivals[0][1].restarted().next_requests(None)[0]  # a contender's copy of the replay
    assert all(seg._text is not None for seg in replayed.segments)



def test_the_driver_s_cpu_wait_counts_the_driver_alone_not_the_router_and_replicas_it_started(monkeypatch):
    """The router and replicas are the driver's child processes: their waits are reported apart,
    so the driver's own must not include them (its CPU seconds, from os.times(), do not)."""
    accounting = load_benchmark("replay_accounting")
    asked: list[int] = []
    real_tree = accounting._tree

    def tree(pid: int) -> list[int]:
        asked.append(pid)
        return real_tree(pid)

    monkeypatch.setattr(accounting, "_tree", tree)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        split = accounting.cpu_split(child.pid, [])
    finally:
        child.kill()
        child.wait()
    assert os.getpid() not in asked and asked == [child.pid]
    assert split["wait"]["driver"] >= 0


@pytest.mark.parametrize("argv, message", [
    (["--variant", "v=coding-agent learning.eviction_order=sometimes"], "eviction_order"),
    (["--variant", "v=coding-agent no_such_section.x=1"], "no_such_section"),
    (["--variant", "coding-agent=coding-agent learning.calibrate=false"], "must differ"),
])
def test_a_bad_variant_is_refused_before_anything_starts(argv: list[str], message: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_benchmark("live_sweep").parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_variant_may_set_its_policys_params() -> None:
    args = load_benchmark("live_sweep").parse_args(["--variant", "ch8=consistent_hash policy.params.vnodes=8"])
    [variant] = args.variants
    assert variant.policy == "consistent_hash" and variant.settings == (("policy.params.vnodes", 8),)


def test_cache_prediction_sums_the_decision_logs_predictions_and_reports(tmp_path: Path) -> None:
    log = tmp_path / "d.jsonl"
    rows = [{"format": "kvrouter-decision-log/1"},
            # the router sized the prompt at 1000 tokens, the replica at 2000: predictions scale
            {"prompt_tokens": 1000, "predicted_cached": 500, "reported_prompt_tokens": 2000, "reported_cached": 600},
            {"prompt_tokens": 1000, "predicted_cached": 0, "reported_prompt_tokens": 1000, "reported_cached": 0},
            {"prompt_tokens": 1000, "predicted_cached": 100}]  # no report: left out
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    accounting = load_benchmark("replay_accounting")
    cache_prediction, decision_rows = accounting.cache_prediction, accounting.decision_rows
    assert cache_prediction(decision_rows(log)) == {"requests": 2, "predicted_hit_rate": round(1000 / 3000, 4),
                                     "reported_hit_rate": 0.2, "over_predicted": round(400 / 3000, 4)}
    assert cache_prediction(decision_rows(tmp_path / "none.jsonl")) is None
