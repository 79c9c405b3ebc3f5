"""`kvrouter compare`: real subprocesses (simulated replicas, routers) on the tiny profile."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvrouter.cli import main
from kvrouter.loadtest.compare import run_compare
from kvrouter.loadtest.compare_charts import CHART_FILES
from kvrouter.loadtest.compare_config import CompareConfig, expand_template, parse_external, parse_variant
from kvrouter.loadtest.process_group import CompareError, ProcessGroup
from kvrouter.loadtest.report import RESULT_KEYS

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _our_kvrouter_children() -> list[str]:
    """Command lines of live (non-zombie) processes whose parent is this test process and that run
    kvrouter (compare starts every subprocess as a direct child)."""
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, ppid = fields[0], int(fields[1])
        if ppid == me and state != "Z" and "kvrouter" in cmd:
            found.append(cmd)
    return found


def test_compare_two_policies_on_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "out"
    json_path = tmp_path / "results.json"
    code = main([
        "compare", "--replicas", "2", "--profile", "tiny", "--workload", "tiny",
        "--policies", "coding-agent,round_robin", "--users", "4", "--duration", "2.5",
        "--seed", "7", "--drain-timeout", "10", "--json", str(json_path), "--out-dir", str(out_dir),
    ])
    assert code == 0
    report = json.loads(json_path.read_text())
    assert report["schema"] == 1
    assert report["workload"]["name"] == "tiny"
    assert report["workload"]["replicas"] == 2
    assert set(report["results"]) == {"coding-agent", "round_robin"}
    for name, result in report["results"].items():
        missing = [k for k in RESULT_KEYS if k not in result]
        assert not missing, f"{name} lacks {missing}"
        assert result["requests_ok"] > 0
        assert result["requests_failed"] == 0
        # replica_header is on for our routers, so sessions are counted on both replicas
        assert len(result["sessions_per_replica"]) == 2
    assert report["results"]["coding-agent"]["cache_hit_rate"] > 0
    assert "sweep" not in report
    table = capsys.readouterr().out
    assert "| coding-agent | 4 |" in table and "| round_robin | 4 |" in table
    md = (out_dir / "report.md").read_text()
    assert "kvrouter compare" in md and "| coding-agent | 4 |" in md
    assert not _our_kvrouter_children()
    if not HAS_MATPLOTLIB:
        pytest.skip("matplotlib not installed: PNG charts not checked (pip install '.[charts]')")
    for name in CHART_FILES:
        png = out_dir / name
        assert png.is_file(), name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size < 60_000


def test_external_contender_is_our_router(tmp_path: Path) -> None:
    """--external with a template: our own router started as an unknown command."""
    template = "{python} -m kvrouter.cli serve {worker_url_flags} --port {port} --policy round_robin"
    cfg = CompareConfig(
        replicas=2, profile="tiny", workload="tiny", policies=[], users=[2, 3], duration_s=1.5,
        seed=1, drain_timeout_s=10, externals=[parse_external(f"ext-rr={template}")],
    )
    report, runs = run_compare(cfg, say=lambda line: None)
    assert set(report["results"]) == {"ext-rr@u2", "ext-rr@u3"}
    assert [e["users"] for e in report["sweep"]["ext-rr"]] == [2, 3]
    for result in report["results"].values():
        assert all(k in result for k in RESULT_KEYS)
        assert result["requests_ok"] > 0
        assert result["sessions_per_replica"] == []  # no x-kvrouter-replica header without our config
    assert report["workload"]["contenders"] == {"ext-rr": {"external": template}}
    assert all(r.load_samples for r in runs)
    assert not _our_kvrouter_children()


def test_failing_contender_leaves_no_process_behind() -> None:
    cfg = CompareConfig(
        replicas=2, profile="tiny", workload="tiny", policies=[], users=[2], duration_s=1.0,
        externals=[parse_external("broken={python} -c 'import sys; sys.exit(3)' {port}")],
    )
    with pytest.raises(CompareError, match="exited with code 3"):
        run_compare(cfg, say=lambda line: None)
    assert not _our_kvrouter_children()


def test_expand_template_placeholders() -> None:
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert expand_template("r --port {port} --worker-urls {worker_urls}", 9, urls) == [
        "r", "--port", "9", "--worker-urls", *urls,
    ]
    assert expand_template("r {worker_url_flags}", 9, urls) == [
        "r", "--replica", urls[0], "--replica", urls[1],
    ]
    # quoted: one argument; other braces are left alone
    assert expand_template("sh -c 'echo {worker_urls} {\"a\": 1}' {port}", 9, urls) == [
        "sh", "-c", f'echo {urls[0]} {urls[1]} {{"a": 1}}', "9",
    ]
    assert expand_template("{python} x {port}", 1, urls)[0] == sys.executable
    argv = expand_template("r --port {port} --prometheus-port {free_port}", 9, urls)
    assert argv[:3] == ["r", "--port", "9"] and argv[3] == "--prometheus-port" and int(argv[4]) not in (0, 9)


@pytest.mark.parametrize("spec", ["noequals", "=cmd {port}", "name=", "a@b=cmd {port}", "n=cmd without port"])
def test_parse_external_rejects(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_external(spec)


def test_a_variant_is_the_router_with_config_settings(tmp_path: Path) -> None:
    from kvrouter.loadtest.compare import _router_config_file
    from kvrouter.router.config import parse_config

    v = parse_variant("ca_leaf=coding-agent learning.eviction_order=leaf_first routing.shadow_sample=0.5")
    assert (v.name, v.policy, v.kind) == ("ca_leaf", "coding-agent", "policy")
    assert v.settings == (("learning.eviction_order", "leaf_first"), ("routing.shadow_sample", 0.5))
    conf = tmp_path / "router.yaml"
    _router_config_file(conf, v.policy, 8000, ["http://127.0.0.1:1"], {"decision_log": "d.jsonl"}, v.settings)
    config = parse_config(yaml.safe_load(conf.read_text()))
    assert config.learning.eviction_order == "leaf_first" and config.routing.shadow_sample == 0.5
    assert config.observability.decision_log == "d.jsonl" and config.server.replica_header
    # a policy's params reach the router: its config file names the policy, no flag overrides it
    _router_config_file(conf, "consistent_hash", 8000, ["http://127.0.0.1:1"], None,
                        (("policy.params.vnodes", 8),))
    assert parse_config(yaml.safe_load(conf.read_text())).policy.params == {"vnodes": 8}


@pytest.mark.parametrize("spec", ["noequals", "=coding-agent", "name=", "a@b=coding-agent",
                                  "n=coding-agent novalue", "n=coding-agent .x=1", "n=coding-agent a..b=1",
                                  "n=coding-agent x=[1"])
def test_parse_variant_rejects(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_variant(spec)


def test_process_group_kills_grandchildren(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path)
    marker = tmp_path / "child.pid"
    proc = group.start("sh", ["sh", "-c", f"sleep 30 & echo $! > {marker}; wait"])
    deadline = time.monotonic() + 5
    while not (marker.exists() and marker.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.02)
    grandchild = int(marker.read_text())
    group.close()
    assert proc.popen.poll() is not None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        # reaped by init once orphaned; a zombie still answers kill(0) briefly
        state = Path(f"/proc/{grandchild}/stat").read_text().rsplit(")", 1)[1].split()[0] \
            if Path(f"/proc/{grandchild}/stat").exists() else "X"
        if state in ("Z", "X"):
            break
        time.sleep(0.05)
    else:
        pytest.fail("grandchild still alive")


# ----------------------------------------------------------------------------------------------
# driver options used by compare/demo/loadtest: warm start, ramp, warm-up, timed load samples, trace
# ----------------------------------------------------------------------------------------------


async def test_driver_warm_start_ramp_warmup_and_timed_samples(start_app: Any) -> None:
    from kvrouter.loadtest.driver import run_load
    from kvrouter.loadtest.report import RequestRecord
    from kvrouter.loadtest.sim_server import build_app
    from kvrouter.loadtest.workload_config import load_workload

    url = await start_app(build_app("tiny", time_scale=1.0))
    wl = load_workload("tiny")
    records: list[RequestRecord] = []
    samples: list[tuple[float, list[float]]] = []
    report = await run_load(
        url, wl, users=4, duration_s=1.5, seed=5, replica_metrics_urls=[url], progress=lambda line: None,
        metrics_interval_s=0.1, records_out=records, load_samples_out=samples,
        ramp_s=0.4, warm_start=True, warmup_s=0.3,
    )
    result = report["results"]["target"]
    assert report["workload"]["warm_start"] is True and report["workload"]["warmup_s"] == 0.3
    assert samples and all(len(v) == 1 for _, v in samples)
    times = [t for t, _ in samples]
    assert times == sorted(times) and times[0] < 0.3 < times[-1]
    measured = [r for r in records if r.ok and r.start_s >= 0.3]
    assert result["requests_ok"] == len(measured) < sum(r.ok for r in records)
    # ramp: users start 0.1 s apart, so until 0.09 s only user 0 sends: requests of different
    # sessions never overlap in time (without the ramp, 4 users would start at once)
    early = sorted((r for r in records if r.ok and r.start_s < 0.09), key=lambda r: r.start_s)
    assert early
    for a, b in zip(early, early[1:]):
        if a.session_id != b.session_id:
            assert b.start_s >= a.start_s + (a.e2e_s or 0.0) - 1e-3
    # warm start: some first sessions begin past turn 0 (their first request is not turn 0)
    first_turn = {}
    for r in sorted(records, key=lambda r: r.start_s):
        first_turn.setdefault(r.session_id, r.turn_index)
    assert any(t > 0 for t in first_turn.values())


async def test_driver_replays_arrivals(start_app: Any) -> None:
    from kvrouter.loadtest.driver import run_load
    from kvrouter.loadtest.report import RequestRecord
    from kvrouter.loadtest.sim_server import build_app
    from kvrouter.loadtest.workload import make_session
    from kvrouter.loadtest.workload_config import load_workload

    url = await start_app(build_app("tiny", time_scale=1.0))
    wl = load_workload("tiny")
    arrivals = [(0.0, make_session(wl, 1, 0)), (0.2, make_session(wl, 1, 1)), (99.0, make_session(wl, 1, 2))]
    records: list[RequestRecord] = []
    report = await run_load(url, wl, None, 1.0, arrivals=arrivals, progress=lambda line: None,
                            records_out=records)
    assert {r.session_id for r in records} == {arrivals[0][1].session_id, arrivals[1][1].session_id}
    assert min(r.start_s for r in records if r.session_id == arrivals[1][1].session_id) >= 0.2
    assert report["workload"]["trace_sessions"] == 3
    with pytest.raises(ValueError):
        await run_load(url, wl, 2, 1.0, arrivals=arrivals)


def test_loadtest_cli_needs_one_mode(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["loadtest", "--target", "http://127.0.0.1:9", "--duration", "1"]) == 2
    assert main(["loadtest", "--target", "http://127.0.0.1:9", "--duration", "1", "--users", "2",
                 "--trace", "x"]) == 2
    assert "exactly one of" in capsys.readouterr().err


def test_loadtest_cli_refuses_a_bad_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "trace_bad.json"
    bad.write_text('{"id": "bad"}')
    for trace in (tmp_path / "missing.jsonl", bad):
        assert main(["loadtest", "--target", "http://127.0.0.1:9", "--duration", "1",
                     "--trace", str(trace)]) == 2
        assert f"--trace {trace}:" in capsys.readouterr().err
