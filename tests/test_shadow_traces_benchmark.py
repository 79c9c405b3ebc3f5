"""benchmarks/shadow_traces.py: every decision of a short replay of the committed traces is timed
without and with the shadow, and the JSON names its code, its rows and the shadow's rules."""

from __future__ import annotations

import json
from pathlib import Path

from .benchmark_modules import load_benchmark


def test_short_replay_times_every_decision_and_writes_the_rows(tmp_path: Path) -> None:
    bench = load_benchmark("shadow_traces")
    out = tmp_path / "shadow.json"
    assert bench.main(["--pairs", "consistent-hash:coding-agent", "--copies", "1", "--duration-s", "120",
                       "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["replicas"] == 100 and saved["gc_paused_while_timed"] is True
    assert saved["command"].startswith("python benchmarks/shadow_traces.py --pairs consistent-hash:coding-agent")
    assert saved["code"] is not None
    (row,) = saved["rows"]
    assert (row["primary"], row["shadow"]) == ("consistent-hash", "coding-agent")
    assert row["decisions"] > 0
    rules = row["by_shadow_rule"]
    assert sum(r["decisions"] for r in rules.values()) == row["decisions"]
    assert "affinity" in rules  # returning turns go home
    assert all(r["notes_without_shadow_mean_us"] > 0 for r in rules.values())
