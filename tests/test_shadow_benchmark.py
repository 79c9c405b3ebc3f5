"""benchmarks/shadow.py: a small synthetic run writes its rows with the command and code behind them."""

from __future__ import annotations

import json
from pathlib import Path

from .benchmark_modules import load_benchmark


def test_small_run_writes_rows_command_and_code(tmp_path: Path, monkeypatch) -> None:
    bench = load_benchmark("shadow")
    monkeypatch.chdir(tmp_path)
    assert bench.main(["--replicas", "8", "--pairs", "coding-agent:consistent-hash", "--decisions", "40",
                       "--repeats", "1", "--json", "out.json"]) == 0
    saved = json.loads((tmp_path / "out.json").read_text())
    # Every option spelled out; a path outside the repository keeps only its name.
    assert saved["command"] == ("python benchmarks/shadow.py --replicas 8 --pairs coding-agent:consistent-hash "
                                "--decisions 40 --repeats 1 --json out.json")
    assert saved["code"] is not None and saved["replicas"] == 8
    (row,) = saved["rows"]
    assert (row["primary"], row["shadow"]) == ("coding-agent", "consistent-hash")
    assert row["notes_without_shadow_p50_us"] > 0
