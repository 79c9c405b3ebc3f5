"""The live sweep's session sets: gzipped traces, the rule that chose sets 2 and up, the committed
sets themselves, and the mean and range over sets in the report."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvrouter.loadtest.trace_claude_code import claude_code_arrivals
from kvrouter.loadtest.traces import trace_sessions

from .benchmark_modules import load_benchmark

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "loadtest" / "data" / "traces" / "trace_0684.json"


def _ids(arrivals) -> list[tuple[float, str, list[int]]]:
    return [(at, s.session_id, [r.prompt_tokens for _, r in s.planned()]) for at, s in arrivals]


def test_gzipped_trace_replays_as_the_plain_file(tmp_path: Path) -> None:
    folder = tmp_path / "set"
    folder.mkdir()
    (folder / "trace_0684.json.gz").write_bytes(gzip.compress(SAMPLE.read_bytes()))
    plain = _ids(claude_code_arrivals([SAMPLE], max_requests=5))
    assert _ids(claude_code_arrivals(folder, max_requests=5)) == plain  # a folder of .json.gz
    assert _ids(trace_sessions(folder / "trace_0684.json.gz", max_requests=5)) == plain  # one file
    assert plain[0][1] == "trace_0684"


def test_gzipped_trace_without_id_is_named_by_its_file(tmp_path: Path) -> None:
    data = json.loads(SAMPLE.read_text())
    del data["id"]
    path = tmp_path / "trace_0999.json.gz"
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    [(_, session), *_] = claude_code_arrivals([path], max_requests=1)
    assert session.session_id == "trace_0999"


def _trace(path: Path, sizes: list[int], sub: int | None = None, gz: bool = False) -> Path:
    """A small kv-cache-tester file: one top-level request per size (prompt tokens), 10 output
    tokens each; `sub` adds a sub-agent with one request of that size after the first request."""
    reqs: list[dict] = [{"t": float(i), "type": "n", "in": n, "out": 10, "think_time": 1.0,
                         "hash_ids": list(range(1, n // 64 + 1))} for i, n in enumerate(sizes)]
    if sub is not None:
        reqs.insert(1, {"type": "subagent", "t": 0.5, "agent_id": "a", "requests": [
            {"t": 0.5, "type": "n", "in": sub, "out": 10, "hash_ids": list(range(1000, 1000 + sub // 64))}]})
    body = json.dumps({"id": path.name.split(".")[0], "block_size": 64, "requests": reqs}).encode()
    path.write_bytes(gzip.compress(body) if gz else body)
    return path


def test_selection_rule_takes_the_first_replayable_traces_in_order(tmp_path: Path) -> None:
    sets = load_benchmark("session_sets")
    ok = [640] * 12
    files = [
        _trace(tmp_path / "trace_0001.json", ok),  # in set 1 already: skipped
        _trace(tmp_path / "trace_0002.json", [640] * 11),  # 11 requests: too few
        _trace(tmp_path / "trace_0003.json", [640] * 5 + [100_000] + [640] * 6),  # 100k + 10 > limit
        _trace(tmp_path / "trace_0004.json", ok + [200_000]),  # too long only after the 12th: fine
        _trace(tmp_path / "trace_0005.json", ok, sub=6400),  # a sub-agent larger than allowed
        _trace(tmp_path / "trace_0006.json", [640] * 11 + [5000]),  # the largest allowed exactly
        _trace(tmp_path / "trace_0007.json", ok, sub=640),
        _trace(tmp_path / "trace_0008.json", ok),
    ]
    allowed = 5010
    assert sets.replayable(files[3], allowed) and not sets.replayable(files[1], allowed)
    assert not sets.replayable(files[2], allowed) and not sets.replayable(files[4], allowed)
    assert sets.replayable(files[5], allowed) and not sets.replayable(files[5], allowed - 1)
    sets.SET_SIZE = 2  # the module's own constant; a fresh module per test
    chosen = sets.choose(files, {"trace_0001"}, allowed, sets=2)
    assert [[f.name for f in s] for s in chosen] == [["trace_0004.json", "trace_0006.json"],
                                                     ["trace_0007.json", "trace_0008.json"]]
    # candidates run out: the last set is short, not padded
    assert [len(s) for s in sets.choose(files, {"trace_0001"}, allowed, sets=3)] == [2, 2, 0]


def test_committed_sets_follow_the_rule_and_are_disjoint() -> None:
    sets = load_benchmark("session_sets")
    reference = sorted((ROOT / "benchmarks" / "traces").glob("trace_*.json"))
    largest = sets.largest_request_tokens(reference)
    assert sets.available_sets()[:3] == [1, 2, 3]
    seen = {f.name.split(".")[0] for f in reference}
    previous = max(seen)
    for number in (2, 3):
        files = sorted(sets.set_dir(number).glob("trace_*.json.gz"))
        names = [f.name.split(".")[0] for f in files]
        assert len(files) == sets.SET_SIZE and not seen & set(names)
        assert min(names) > previous or number == 2  # set 3 follows set 2 in trace-id order
        assert all(sets.replayable(f, largest) for f in files)
        arrivals = claude_code_arrivals(files, max_requests=12, max_context_tokens=100_000)
        top = [s for _, s in arrivals if "/" not in s.session_id]
        assert len(top) == 12 and all(len(s.planned()) == 12 for s in top)
        seen |= set(names)
        previous = max(names)
        sources = (ROOT / "benchmarks" / "traces" / "SOURCES.md").read_text()
        [row] = [line for line in sources.splitlines() if line.startswith(f"| {number} | ")]
        assert row.split(" | ")[1] == ", ".join(n.removeprefix("trace_") for n in names)


def _set(number: int, bound: float, hits: dict[str, float], p95: dict[str, float]) -> dict:
    results = {n: {"cache_hit_rate": h, "ttft_p95_s": p95[n], "requests_failed": 0} for n, h in hits.items()}
    return {"judged": "me", "peers": ["peer"], "session_set": number,
            "trace": {"reuse_bound": bound, "sessions": 12, "requests": 144, "prompt_tokens": 5e6,
                      "median_peak_tokens": 50_000, "largest_request_tokens": 90_000},
            "points": [{"kind": "sim", "capacity_sessions": 2.5, "chars_per_token": 4.0, "capacity_tokens": 1,
                        "capacity_median_sessions": 2.5, "results": results}]}


def test_sets_report_gives_mean_range_and_judges_the_means(tmp_path: Path) -> None:
    report = load_benchmark("live_sweep_report")
    a = _set(2, 0.90, {"me": 0.80, "peer": 0.70}, {"me": 1.0, "peer": 2.0})  # met: +8 points, 0.5x
    b = _set(3, 0.92, {"me": 0.70, "peer": 0.72}, {"me": 1.0, "peer": 1.0})  # missed on both
    for d in (a, b):
        for p in d["points"]:
            p["verdict"] = report.verdict(p, d["judged"], d["peers"], d["trace"]["reuse_bound"])
    summary = report.write_sets_outputs([a, b], tmp_path, "python benchmarks/live_sweep.py", 60.0)
    [point] = summary["points"]
    me, peer = point["results"]["me"], point["results"]["peer"]
    assert me["cache_hit_rate"] == 0.75 and (me["cache_hit_min"], me["cache_hit_max"]) == (0.70, 0.80)
    assert peer["cache_hit_rate"] == 0.71 and peer["ttft_p95_s"] == 1.5 and me["ttft_p95_s"] == 1.0
    v = point["verdict_on_means"]
    assert v["hit_target"] == 0.73 and v["ttft_p95_vs_best_peer"] == pytest.approx(2 / 3) and v["met"]
    assert [x["met"] for x in point["verdict_per_set"]] == [True, False]
    text = (tmp_path / "report.md").read_text()
    assert "| sim / 2.5, 2.5 / 4 cpt | 75.0% | 71.0% | +2.0 pt | 0.67x | yes | yes, no (hit, TTFT) |" in text
    assert "| sim / 2.5, 2.5 / 4 cpt | me | 75.0% | 70.0%-80.0% | 1000 | 1000-1000 | 0 |" in text
    assert json.loads((tmp_path / "summary.json").read_text())["sets"][1]["dir"] == "set-3"


def test_saved_single_set_results_still_render_as_committed() -> None:
    report = load_benchmark("live_sweep_report")
    saved = ROOT / "docs" / "live-sweep"
    data = json.loads((saved / "results.json").read_text())
    assert "session_set" not in data
    assert report.render_report(data) == (saved / "report.md").read_text()


def test_session_sets_option_names_existing_sets_only() -> None:
    sweep = load_benchmark("live_sweep")
    assert sweep.parse_args(["--session-sets", "2,3"]).session_sets == [2, 3]
    assert sweep.parse_args([]).session_sets is None
    for bad in ("9", "2,2", "0"):
        with pytest.raises(SystemExit):
            sweep.parse_args(["--session-sets", bad])
    # The sets replace --traces: both at once would silently replay the sets alone.
    with pytest.raises(SystemExit):
        sweep.parse_args(["--session-sets", "2", "--traces", "benchmarks/traces/set2"])


def test_saved_runs_combine_into_one_summary(tmp_path: Path) -> None:
    """`--combine` judges saved runs (e.g. set 1's docs/live-sweep run with a --session-sets run)
    over the points they share."""
    saved = ROOT / "docs" / "live-sweep"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "live_sweep_report.py"), "--combine", str(tmp_path),
         str(saved / "results.json"), str(saved / "time-scale-4" / "results.json")],
        capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["dir"] for s in summary["sets"]] == ["docs/live-sweep", "docs/live-sweep/time-scale-4"]
    [point] = summary["points"]  # the one point the time-scale-4 run has
    assert (point["kind"], point["capacity_sessions"], point["chars_per_token"]) == ("sim", 4.0, 4.0)
    assert point["results"]["coding-agent"]["sets"] == 2 and len(point["verdict_per_set"]) == 2
    assert "| 1 | `docs/live-sweep` |" in (tmp_path / "report.md").read_text()
    assert summary["combined"] and "wall_s" not in summary
    assert "--combine" in summary["command"] and not summary["command"].split()[1].startswith("/")


def test_routing_doc_other_sessions_quotes_the_saved_runs() -> None:
    """Every row of routing.md's "Other sessions" table is the saved run's own figures, and the
    load averages it quotes are those of load-average.txt in each set's window."""
    import re
    import statistics

    report = load_benchmark("live_sweep_report")
    doc = (ROOT / "docs" / "routing.md").read_text()
    section = doc[doc.index("## Other sessions"):doc.index("## Measured in the simulator")]
    runs = {1: ROOT / "docs/live-sweep/runs/2afe9d4/results.json",  # the sets ran at that sweep's commit
            2: ROOT / "docs/live-sweep/sets/set-2/results.json",
            3: ROOT / "docs/live-sweep/sets/set-3/results.json"}
    names = ["coding-agent", "vllm_consistent_hash", "smg_cache_aware", "consistent_hash"]
    rows = 0
    for number, path in runs.items():
        data = json.loads(path.read_text())
        for p in data["points"]:
            line = re.escape(f"| {p['kind']} / {p['capacity_median_sessions']:g} / {p['chars_per_token']:g} cpt "
                             f"| {number} |")
            found = re.search(line + r"(.*)\|\n", section)
            if found is None:
                continue
            v = report.verdict(p, data["judged"], data["peers"], data["trace"]["reuse_bound"])
            cells = [c.strip() for c in found.group(1).split("|")]
            assert cells[:4] == [f"{100 * p['results'][n]['cache_hit_rate']:.1f}%" for n in names]
            assert cells[4:7] == [f"{100 * v['hit_margin']:+.1f} pt", f"{v['ttft_p95_vs_best_peer']:.2f}x",
                                  report._met_word(v)]
            rows += 1
    assert rows == 12
    text = (ROOT / "docs/live-sweep/sets/load-average.txt").read_text()
    windows = dict(re.findall(r"set (\d) (?:ran )?(\d\d:\d\d:\d\d-\d\d:\d\d:\d\d)", text.splitlines()[1]))
    samples = [line.split() for line in text.splitlines() if line[:1].isdigit()]
    quoted = re.findall(r"(\d\.\d)-(\d\.\d) \(median (\d\.\d+)\) during set (\d)", " ".join(section.split()))
    assert [q[3] for q in quoted] == ["2", "3"]
    for low, high, median, number in quoted:
        start, end = windows[number].split("-")
        loads = [float(s[1]) for s in samples if start <= s[0] < end]
        assert (low, high) == (f"{min(loads):.1f}", f"{max(loads):.1f}")
        assert float(median) == pytest.approx(statistics.median(loads), abs=0.051)


def test_repeats_of_one_set_are_reported_as_runs(tmp_path: Path) -> None:
    """Saved runs of the same session set combined are repeats: the report names runs, not sets."""
    report = load_benchmark("live_sweep_report")
    runs = [_set(1, 0.90, {"me": h, "peer": 0.70}, {"me": 1.0, "peer": 2.0}) for h in (0.80, 0.84)]
    for d in runs:
        for p in d["points"]:
            p["verdict"] = report.verdict(p, d["judged"], d["peers"], d["trace"]["reuse_bound"])
    report.write_sets_outputs(runs, tmp_path, "python benchmarks/live_sweep_report.py --combine", None)
    text = (tmp_path / "report.md").read_text()
    assert text.startswith("# Live sweep repeated: mean and range per contender over 2 runs of session set 1")
    assert "met per run (run 1, run 2)" in text and "mean and range over the runs" in text


def test_report_script_answers_help_without_reading_a_file() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "live_sweep_report.py"), "--help"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "--combine" in done.stdout and not done.stderr


def test_runs_combined_are_each_judged_against_the_peers_they_all_ran(tmp_path: Path) -> None:
    """A run with an extra peer (here one ahead of the judged policy) is judged, in the combined
    report, against the peers every run had, as the means are."""
    report = load_benchmark("live_sweep_report")
    plain = _set(1, 0.90, {"me": 0.80, "peer": 0.70}, {"me": 1.0, "peer": 2.0})
    extra = _set(1, 0.90, {"me": 0.80, "peer": 0.70, "variant": 0.81}, {"me": 1.0, "peer": 2.0, "variant": 1.0})
    extra["peers"] = ["peer", "variant"]
    for d in (plain, extra):
        for p in d["points"]:
            p["verdict"] = report.verdict(p, d["judged"], d["peers"], d["trace"]["reuse_bound"])
    assert not extra["points"][0]["verdict"]["met"]  # against the variant, in its own run
    summary = report.write_sets_outputs([plain, extra], tmp_path, "python benchmarks/live_sweep_report.py", None)
    assert summary["peers"] == ["peer"]
    assert [v["met"] for v in summary["points"][0]["verdict_per_set"]] == [True, True]
