"""Replaying the router's decision log as a trace (loadtest/trace_decision_log.py): sessions,
sizes, timing and prefix sharing rebuilt from what the log holds, and the simulator running it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from kvrouter.loadtest.cluster_sim import ClusterSimulator, SimConfig
from kvrouter.loadtest.trace_decision_log import DEFAULT_OUTPUT_TOKENS
from kvrouter.loadtest.traces import trace_sessions
from kvrouter.loadtest.traffic_profile import profile_traffic, render_table
from kvrouter.loadtest.workload_config import load_workload
from kvrouter.router.decision_log import LOG_FORMAT, prefix_marks, short_hash

BLOCK = 64  # tokens per block in these logs


def chain(*parts: tuple[str, int]) -> tuple[int, ...]:
    """Chained block hashes of a prompt made of (content name, blocks) parts, like the router's:
    a block's hash depends on every block before it."""
    out, h = [], 17
    for name, n in parts:
        for i in range(n):
            h = hash((h, name, i)) & 0xFFFFFFFFFFFF
            out.append(h)
    return tuple(out)


def line(t: float, session: str | None, blocks: tuple[int, ...], *, out: int | None = 40,
         duration: float = 2.0) -> dict[str, Any]:
    row: dict[str, Any] = {"t": t, "session": short_hash(session) if session else None,
                           "prompt_tokens": len(blocks) * BLOCK + 10, "blocks": len(blocks),
                           "prefix": prefix_marks(blocks), "status": 200, "duration_s": duration}
    if out is not None:
        row["output_tokens"] = out
    return row


def write_log(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in [{"format": LOG_FORMAT}, *rows]))
    return path


SYSTEM = ("system", 8)
A1 = chain(SYSTEM, ("a-turn1", 5))
A2 = chain(SYSTEM, ("a-turn1", 5), ("a-turn2", 20))  # extends A1
B1 = chain(SYSTEM, ("b-turn1", 30))  # another session, same system prompt


@pytest.fixture
def log_path(tmp_path: Path) -> Path:
    rows = [line(1000.0, "a", A1), line(1001.0, "b", B1, out=None), line(1000.0 + 2.0 + 3.5, "a", A2),
            line(1010.0, None, chain(("solo", 3)))]
    return write_log(tmp_path / "decisions.jsonl.1", rows)  # a rotated file's name


def test_sessions_sizes_and_timing(log_path: Path) -> None:
    arrivals = trace_sessions(log_path)
    assert [(start, s.session_id) for start, s in arrivals] == [
        (0.0, f"dl-{short_hash('a')}"), (1.0, f"dl-{short_hash('b')}"), (10.0, "dl-r3")]
    a, b, solo = (s.planned() for _, s in arrivals)
    assert [r.prompt_tokens for _, r in a] == [len(A1) * BLOCK + 10, len(A2) * BLOCK + 10]
    assert [r.max_tokens for _, r in a] == [40, 40] and b[0][1].max_tokens == DEFAULT_OUTPUT_TOKENS
    assert a[1][1].think_time_s == pytest.approx(3.5)  # the gap after turn 1 ended
    assert a[1][0] == pytest.approx(5.5) and len(solo) == 1


def test_prefix_sharing_within_and_across_sessions(log_path: Path) -> None:
    arrivals = trace_sessions(log_path)
    (_, a1), (_, a2) = arrivals[0][1].planned()
    (_, b1), = arrivals[1][1].planned()
    # the second turn extends the first: every whole block of turn 1 is reused
    assert a2.reused_tokens == len(A1) * BLOCK and not a2.compacted
    # another session shares the system prompt's blocks, found at the power-of-two marks (8)
    keys = lambda r: [s.key for s in r.segments]  # noqa: E731
    shared = next(i for i, (x, y) in enumerate(zip(keys(a1), keys(b1))) if x != y)
    assert shared == 8


def test_a_bad_log_is_refused_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"format": LOG_FORMAT}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"d.jsonl:2"):
        trace_sessions(path)


def test_simulator_replays_a_decision_log(log_path: Path, tmp_path: Path) -> None:
    config = SimConfig(replicas=2, profile="kimi-k2.6-b200-tp4", duration_s=60.0, warmup_s=0.0,
                       drain_s=60.0)
    sim = ClusterSimulator(config, "coding-agent", load_workload("tiny"), arrivals=trace_sessions(log_path))
    result = sim.run()
    assert result["requests_ok"] == 4 and result["requests_failed"] == 0
    assert result["cache_hit_rate"] > 0  # the second turn and the shared system prompt hit
    out = tmp_path / "sim.json"
    subprocess.run([sys.executable, "-m", "kvrouter.cli", "simulate", "--replicas", "2",
                    "--duration", "60", "--warmup", "0", "--trace", str(log_path), "--json", str(out)],
                   check=True, capture_output=True, timeout=120)
    assert json.loads(out.read_text())["workload"]["source"] == str(log_path)


# -- profile-traffic -----------------------------------------------------------------------------
def test_profile_traffic_buckets_the_log(log_path: Path) -> None:
    dists = {d.name: d for d in profile_traffic(log_path)}
    assert dists["input length"].counts() == [2, 2, 0, 0, 0, 0, 0]  # 842, 2442, 2122, 202 tokens
    assert sorted(dists["output length"].values) == [40, 40, 40]  # b reported none: left out
    # a1 and solo share nothing, b1 the system prompt (8 of 38 blocks), a2 all of a1 (13 of 33)
    assert [round(v, 3) for v in dists["prefix overlap"].values] == [0.0, round(8 / 38, 3), round(13 / 33, 3), 0.0]
    # a at 1000-1002, b at 1001-1003, a again at 1005.5, solo at 1010
    assert dists["session concurrency"].values == (1.0, 2.0, 1.0, 1.0)
    assert dists["inter-arrival"].values == (1.0, 4.5, 4.5)
    table = render_table(list(dists.values()))
    assert "### prefix overlap (share of prompt; n=4" in table and "| 1k-4k | 2 | 50.0% |" in table


def test_profile_traffic_command_prints_the_table_and_draws_the_chart(log_path: Path, tmp_path: Path) -> None:
    chart, data = tmp_path / "profile.png", tmp_path / "profile.json"
    done = subprocess.run([sys.executable, "-m", "kvrouter.cli", "profile-traffic", str(log_path),
                           "--chart", str(chart), "--json", str(data)],
                          check=True, capture_output=True, text=True, timeout=120)
    assert "### inter-arrival" in done.stdout
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(data.read_text())["session concurrency"]["buckets"]["2-4"] == 1
