"""benchmarks/shadow_traces.py: every decision of a short replay of the committed traces is timed
without and with the shadow, and the JSON names its code, its rows and the shadow's rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .benchmark_modules import load_benchmark


def test_short_replay_times_every_decision_and_writes_the_rows(tmp_path: Path, monkeypatch) -> None:
    bench = load_benchmark("shadow_traces")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # a relative --json from another directory
    assert bench.main(["--pairs", "consistent-hash:coding-agent", "--copies", "1", "--duration-s", "120",
                       "--json=../shadow.json"]) == 0
    saved = json.loads((tmp_path / "shadow.json").read_text())
    assert saved["replicas"] == 100 and saved["gc_paused_while_timed"] is True
    # Every option spelled out; a path outside the repository keeps only its name.
    assert saved["command"] == ("python benchmarks/shadow_traces.py --pairs consistent-hash:coding-agent --copies 1 "
                                "--stagger-s 2 --duration-s 120 --json shadow.json")
    assert saved["code"] is not None
    (row,) = saved["rows"]
    assert (row["primary"], row["shadow"]) == ("consistent-hash", "coding-agent")
    assert row["decisions"] > 0
    rules = row["by_shadow_rule"]
    assert sum(r["decisions"] for r in rules.values()) == row["decisions"]
    assert "affinity" in rules  # returning turns go home
    assert all(r["notes_without_shadow_mean_us"] > 0 for r in rules.values())


def test_runs_measure_each_pair_in_fresh_interpreters_and_summarise_them(tmp_path: Path, monkeypatch) -> None:
    bench = load_benchmark("shadow_traces")
    monkeypatch.chdir(tmp_path)
    assert bench.main(["--pairs", "consistent-hash:coding-agent", "--copies", "1", "--duration-s", "60",
                       "--runs", "2", "--json", "runs.json"]) == 0
    saved = json.loads((tmp_path / "runs.json").read_text())
    assert saved["command"] == ("python benchmarks/shadow_traces.py --pairs consistent-hash:coding-agent --copies 1 "
                                "--stagger-s 2 --duration-s 60 --runs 2 --json runs.json")
    assert saved["runs"] == 2 and [r["run"] for r in saved["rows"]] == [1, 2]
    assert {r["simulated_s"] for r in saved["rows"]} == {60.0}  # the options reached each run
    assert {r["decisions"] for r in saved["rows"]} == {saved["rows"][0]["decisions"]}  # the same replay
    (pair,) = saved["by_pair"]
    assert (pair["primary"], pair["shadow"], pair["runs"]) == ("consistent-hash", "coding-agent", 2)
    means = pair["overhead_mean_us"]
    assert means["each"] == [r["overhead_mean_us"] for r in saved["rows"]]
    assert means["min"] <= means["mean"] <= means["max"]


def test_numbers_given_to_each_run_read_back_as_the_same_float() -> None:
    bench = load_benchmark("shadow_traces")
    assert bench._number(2.0) == "2" and bench._number(3600.0) == "3600"
    assert float(bench._number(1234567.0)) == 1234567.0  # `:g` alone would say 1.23457e+06
    assert float(bench._number(0.1 + 0.2)) == 0.1 + 0.2


def test_with_the_collector_on_a_row_says_where_collections_fell_and_the_overhead_without_them(
        tmp_path: Path) -> None:
    bench = load_benchmark("shadow_traces")
    assert bench.main(["--pairs", "coding-agent:prefix-aware", "--copies", "1", "--duration-s", "120", "--keep-gc",
                       "--json", str(tmp_path / "gc.json")]) == 0
    saved = json.loads((tmp_path / "gc.json").read_text())
    assert saved["gc_paused_while_timed"] is False
    (row,) = saved["rows"]
    landed = row["collections_in_timed_notes"]
    assert set(landed) == {"without_shadow", "with_shadow"} and all(n >= 0 for n in landed.values())
    assert sum(row["collections_whole_run"].values()) >= sum(landed.values())
    assert isinstance(row["overhead_mean_us_less_collections"], float)


def test_paused_collector_rows_carry_no_collection_figures(tmp_path: Path) -> None:
    bench = load_benchmark("shadow_traces")
    assert bench.main(["--pairs", "consistent-hash:coding-agent", "--copies", "1", "--duration-s", "60",
                       "--json", str(tmp_path / "paused.json")]) == 0
    (row,) = json.loads((tmp_path / "paused.json").read_text())["rows"]
    assert "collections_in_timed_notes" not in row


def test_collections_are_counted_in_paired_interpreters_with_one_hash_seed(tmp_path: Path, monkeypatch) -> None:
    bench = load_benchmark("shadow_collections")
    monkeypatch.chdir(tmp_path)
    assert bench.main(["--pairs", "coding-agent:prefix-aware", "--copies", "1", "--duration-s", "120",
                       "--runs", "1", "--json", "collections.json"]) == 0
    saved = json.loads((tmp_path / "collections.json").read_text())
    assert saved["command"] == ("python benchmarks/shadow_collections.py --pairs coding-agent:prefix-aware "
                                "--copies 1 --stagger-s 2 --duration-s 120 --runs 1 --json collections.json")
    (row,) = saved["rows"]
    assert row["hash_seed"] == 1
    without, with_ = row["without_shadow"], row["with_shadow"]
    assert without["decisions"] == with_["decisions"] > 0  # the same replay on both sides
    assert without["decisions_digest"] == with_["decisions_digest"]
    for generation, added in row["collections_added"].items():
        assert added == with_["collections"].get(generation, 0) - without["collections"].get(generation, 0)


def test_added_pause_is_the_added_collections_at_their_mean_pause() -> None:
    bench = load_benchmark("shadow_collections")
    without = {"decisions": 1000, "collections": {"0": 10, "1": 1}, "paused_ms": {"0": 20.0, "1": 5.0}}
    with_ = {"decisions": 1000, "collections": {"0": 12, "1": 1}, "paused_ms": {"0": 24.0, "1": 5.0}}
    added = bench.added_by_shadow(without, with_)
    assert added["collections_added"] == {"0": 2, "1": 0}
    assert added["added_pause_us_per_decision"] == 4.0  # 2 collections x 2 ms / 1000 decisions


def test_a_pair_that_is_not_primary_colon_shadow_is_refused(capsys) -> None:  # type: ignore[no-untyped-def]
    bench = load_benchmark("shadow_collections")
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--pairs", "coding-agent"])
    assert exit_.value.code == 2
    assert "is not primary:shadow" in capsys.readouterr().err


def test_a_replay_too_short_to_decide_adds_no_collections() -> None:
    bench = load_benchmark("shadow_collections")
    empty = {"decisions": 0, "collections": {}, "paused_ms": {}}
    assert bench.added_by_shadow(empty, empty) == {"collections_added": {}, "added_pause_us_per_decision": 0.0}


def test_pauses_are_summed_per_timed_call_and_counted_per_generation() -> None:
    bench = load_benchmark("shadow_traces")
    now = [0.0]
    pauses = bench._Pauses(lambda: now[0])

    def collect(generation: int, seconds: float) -> None:
        pauses.hook("start", {"generation": generation})
        now[0] += seconds
        pauses.hook("stop", {"generation": generation})

    collect(0, 1.0)  # between calls: counted for the run, in no call
    pauses.region = True
    collect(0, 2.0)
    collect(1, 3.0)
    pauses.region = False
    collect(0, 0.5)
    pauses.region = None
    assert pauses.in_region == {False: 0.5, True: 5.0}
    assert pauses.counts == {False: 1, True: 2}
    assert pauses.total == {"0": 3, "1": 1}
    assert pauses.paused == {"0": 3.5, "1": 3.0}
