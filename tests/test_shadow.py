"""Shadow policies (routing.shadow): asked on every decision's snapshot, recorded, never moving
traffic; and `kvrouter report LOG`, which compares them with the live policy."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from kvrouter.loadtest.shadow_report import render_report, shadow_report
from kvrouter.metrics.router_metrics import RouterMetrics
from kvrouter.policies.domain import Decision, RequestSummary
from kvrouter.policies.registry import build_policy
from kvrouter.router.config import ConfigError, parse_config
from kvrouter.router.decision_log import LOG_FORMAT
from kvrouter.router.engine import RoutingEngine
from kvrouter.router.kv_index_shadow import ShadowKVIndex
from kvrouter.router.replicas import ReplicaRegistry
from kvrouter.router.sessions import SessionTable
from tests.test_placement import Scripted

A, B, C = "http://a", "http://b", "http://c"


def make_engine(policy, shadows: tuple[str, ...] = ()) -> RoutingEngine:
    engine = RoutingEngine(policy, ReplicaRegistry([A, B, C]), ShadowKVIndex(), SessionTable(),
                           random.Random(1), metrics=RouterMetrics())
    engine.shadows = tuple((name, build_policy(name)) for name in shadows)
    return engine


def placed(engine: RoutingEngine, n: int) -> list[str]:
    out = []
    for i in range(n):
        p = engine.place(RequestSummary("/v1/completions", prompt_tokens=100, prefix_blocks=(i, i + 1)), None)
        assert p is not None
        out.append(p.url)
        p.done()
    return out


def test_shadows_never_change_where_traffic_goes() -> None:
    # The live policy draws from the engine's rng; shadows that draw too must not disturb it.
    plain = placed(make_engine(build_policy("random")), 60)
    shadowed_engine = make_engine(build_policy("random"), ("random", "consistent-hash", "prefix-aware"))
    assert placed(shadowed_engine, 60) == plain
    assert len(set(plain)) == 3


def test_each_shadow_records_its_pick_and_prediction_on_the_same_snapshot() -> None:
    engine = make_engine(Scripted(Decision(A, "scripted")), ("prefix-aware",))
    blocks = tuple(range(40))
    engine.index.record(B, blocks)  # B holds the prompt's prefix; the live policy picks A anyway
    p = engine.place(RequestSummary("/v1/completions", prompt_tokens=40 * 64, prefix_blocks=blocks), None)
    assert p is not None and p.url == A and p.notes is not None
    (name, decision, guess), = p.notes.shadows
    assert name == "prefix-aware" and decision is not None and decision.replica == B
    assert guess is not None and guess.cached_tokens > 0 and p.notes.chosen.cached_tokens == 0
    assert guess.ttft_s is not None and p.notes.chosen.ttft_s is not None
    assert guess.ttft_s < p.notes.chosen.ttft_s  # the cached replica is predicted faster
    reg = engine.metrics.registry
    assert reg.get_sample_value("kvrouter_shadow_decisions_total",
                                {"shadow": "prefix-aware", "agrees": "false"}) == 1
    assert reg.get_sample_value("kvrouter_shadow_picks_total", {"shadow": "prefix-aware", "replica": B}) == 1
    p.done()


def test_shadow_counts_land_once_and_leave_with_their_replica() -> None:
    # Kept as plain tallies between collections: each collection moves them into the series
    # once, and a replica that leaves takes the picks counted for it before it left.
    engine = make_engine(Scripted(*[Decision(A, "scripted")] * 3), ("prefix-aware",))
    blocks = tuple(range(40))
    engine.index.record(B, blocks)
    reg = engine.metrics.registry
    picks = {"shadow": "prefix-aware", "replica": B}
    for expected in (1, 2):
        p = engine.place(RequestSummary("/v1/completions", prompt_tokens=40 * 64, prefix_blocks=blocks), None)
        assert p is not None
        p.done()
        assert reg.get_sample_value("kvrouter_shadow_picks_total", picks) == expected
        assert reg.get_sample_value("kvrouter_shadow_picks_total", picks) == expected  # collected twice
    live = reg.get_sample_value("kvrouter_shadow_predicted_ttft_seconds_total",
                                {"policy": "scripted", "role": "live"})
    assert live is not None and live > 0
    p = engine.place(RequestSummary("/v1/completions", prompt_tokens=40 * 64, prefix_blocks=blocks), None)
    assert p is not None
    p.done()
    engine.metrics.forget_replica(B)  # before any collection saw the third pick
    assert reg.get_sample_value("kvrouter_shadow_picks_total", picks) is None
    assert reg.get_sample_value("kvrouter_shadow_decisions_total",
                                {"shadow": "prefix-aware", "agrees": "false"}) == 3


def test_a_shadow_picking_a_replica_gone_from_the_snapshot_counts_its_picks_but_no_prediction() -> None:
    # Its picks have no predicted TTFT (the replica is not in the snapshot): no TTFT series for it.
    engine = make_engine(Scripted(*[Decision(A, "scripted")] * 2))
    engine.shadows = (("gone", Scripted(*[Decision("http://gone", "scripted")] * 2)),)
    for _ in range(2):
        p = engine.place(RequestSummary("/v1/completions", prompt_tokens=100), None)
        assert p is not None and p.notes is not None
        (_, decision, guess), = p.notes.shadows
        assert decision is not None and guess is not None and guess.ttft_s is None
        p.done()
    reg = engine.metrics.registry
    assert reg.get_sample_value("kvrouter_shadow_picks_total", {"shadow": "gone", "replica": "http://gone"}) == 2
    assert reg.get_sample_value("kvrouter_shadow_predicted_ttft_seconds_total",
                                {"policy": "gone", "role": "shadow"}) is None


def test_a_shadow_with_no_replica_counts_a_disagreement_and_nothing_else() -> None:
    engine = make_engine(Scripted(*[Decision(A, "scripted")] * 2))
    engine.shadows = (("nowhere", Scripted()),)  # decides None every time
    for _ in range(2):
        p = engine.place(RequestSummary("/v1/completions", prompt_tokens=100), None)
        assert p is not None and p.notes is not None
        assert p.notes.shadows == (("nowhere", None, None),)
        p.done()
    reg = engine.metrics.registry
    assert reg.get_sample_value("kvrouter_shadow_decisions_total", {"shadow": "nowhere", "agrees": "false"}) == 2
    assert reg.get_sample_value("kvrouter_shadow_decisions_total", {"shadow": "nowhere", "agrees": "true"}) is None
    series = [s for metric in reg.collect() for s in metric.samples]
    assert not [s for s in series if s.labels.get("shadow") == "nowhere" and s.name.startswith("kvrouter_shadow_picks")]
    assert not [s for s in series if s.labels.get("policy") == "nowhere"]  # no predicted TTFT series either


def test_no_shadows_no_notes() -> None:
    engine = make_engine(Scripted(Decision(A, "scripted")))
    p = engine.place(RequestSummary("/v1/completions", prompt_tokens=10), None)
    assert p is not None and p.notes is None  # nothing computed when nothing records it
    p.done()


def test_unknown_or_repeated_shadow_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"routing\.shadow: unknown policy 'nope'"):
        parse_config({"routing": {"shadow": ["nope"]}})
    with pytest.raises(ConfigError, match=r"routing\.shadow: a shadow policy is named twice"):
        parse_config({"routing": {"shadow": ["prefix-aware", "prefix-aware"]}})


def _row(replica: str, ttft: float, shadows: dict[str, tuple[str, float, int]], **extra) -> dict:
    return {"t": 1.0, "replica": replica, "policy": "coding_agent", "predicted_cached": 100,
            "predicted_ttft_s": ttft, "ttft_s": ttft + 0.1, "reported_cached": 90,
            "shadow": {n: {"replica": r, "predicted_ttft_s": t, "predicted_cached": c}
                       for n, (r, t, c) in shadows.items()}, "status": 200, **extra}


def test_report_summarises_agreement_and_predicted_gain(tmp_path: Path) -> None:
    rows = [
        _row(A, 1.0, {"prefix-aware": (A, 1.0, 100), "consistent-hash": (B, 3.0, 0)}),
        _row(B, 2.0, {"prefix-aware": (B, 2.0, 100), "consistent-hash": (C, 1.0, 0)}),
        {"t": 2.0, "replica": None, "status": 503},  # no decision: not counted
    ]
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in [{"format": LOG_FORMAT}, *rows]))
    report = shadow_report(path)
    ph, pa = report["shadows"]["consistent-hash"], report["shadows"]["prefix-aware"]
    assert pa["agreement"] == 1.0 and pa["predicted_gain_s"] == 0.0
    assert ph["agreement"] == 0.0 and ph["predicted_gain_s"] == pytest.approx(0.5)  # (3+1)/2 - (1+2)/2
    assert ph["shadow_faster_share"] == 0.5 and ph["predicted_cached_mean"] == 0
    assert report["live"]["requests"] == 2 and report["live"]["measured_ttft_mean_s"] == pytest.approx(1.6)
    table = render_report(report)
    assert "| consistent-hash | 2 | 0.0% | 0 / 100 | 2.000 / 1.500 | 0.500 | 50.0% |" in table
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, "-m", "kvrouter.cli", "report", str(path), "--json", str(out)],
                          check=True, capture_output=True, text=True, timeout=60)
    assert "| prefix-aware | 2 | 100.0% |" in done.stdout
    assert json.loads(out.read_text())["shadows"]["prefix-aware"]["requests"] == 2


def test_report_over_a_sampled_log_compares_each_shadow_over_the_lines_that_have_it(tmp_path: Path) -> None:
    rows = [_row(A, 1.0, {"consistent-hash": (B, 3.0, 0)}), _row(B, 2.0, {}), _row(C, 4.0, {})]
    del rows[1]["shadow"]  # routing.shadow_sample: this decision was not asked
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in [{"format": LOG_FORMAT}, *rows]))
    report = shadow_report(path)
    ch = report["shadows"]["consistent-hash"]
    assert ch["requests"] == 1 and ch["agreement"] == 0.0
    assert ch["predicted_gain_s"] == pytest.approx(2.0)  # 3.0 against the live 1.0 of that line
    assert report["live"]["requests"] == 3


def test_shadow_counts_follow_a_replaced_metrics_object_and_sum_every_prediction() -> None:
    # The shadow counts are tallies kept on the RouterMetrics: a new one (a benchmark or a test
    # swaps it) starts its own, and every decision's predictions must be summed.
    engine = make_engine(build_policy("round-robin"), ("consistent-hash", "least-load"))
    first = placed(engine, 4)
    assert len(first) == 4
    engine.metrics = fresh = RouterMetrics()
    placements = []
    for i in range(6):
        p = engine.place(RequestSummary("/v1/completions", session_key=f"s{i}", prompt_tokens=100,
                                        prefix_blocks=(i,)), None)
        assert p is not None and p.notes is not None
        placements.append(p)
        p.done()
    reg = fresh.registry
    for name in ("consistent-hash", "least-load"):
        agree = sum(n == name and d.replica == p.url for p in placements for n, d, _ in p.notes.shadows)
        assert reg.get_sample_value("kvrouter_shadow_decisions_total", {"shadow": name, "agrees": "true"}) == (agree or None)
        assert reg.get_sample_value("kvrouter_shadow_decisions_total",
                                    {"shadow": name, "agrees": "false"}) == ((6 - agree) or None)
        picks = sum(reg.get_sample_value("kvrouter_shadow_picks_total", {"shadow": name, "replica": r}) or 0
                    for r in (A, B, C))
        assert picks == 6
        ttft = sum(g.ttft_s for p in placements for n, _, g in p.notes.shadows if n == name)
        assert reg.get_sample_value("kvrouter_shadow_predicted_ttft_seconds_total",
                                    {"policy": name, "role": "shadow"}) == pytest.approx(ttft)
    live = sum(p.notes.chosen.ttft_s for p in placements)
    assert reg.get_sample_value("kvrouter_shadow_predicted_ttft_seconds_total",
                                {"policy": "round_robin", "role": "live"}) == pytest.approx(live)


def test_sampled_shadows_are_asked_about_that_share_of_decisions_and_counted_only_then() -> None:
    engine = make_engine(build_policy("random"), ("consistent-hash", "prefix-aware"))
    engine.shadow_sample = 0.25
    engine.explain = True  # every decision still gets its own prediction
    asked = 0
    urls = []
    live_ttft = 0.0  # the live pick's predictions of the decisions asked, and only those
    for i in range(400):
        p = engine.place(RequestSummary("/v1/completions", prompt_tokens=100, prefix_blocks=(i, i + 1)), None,
                         defer_notes=bool(i % 2))  # the relay's deferred notes sample alike
        assert p is not None
        p.settle_notes()
        assert p.notes is not None and p.notes.chosen.replica == p.url
        names = [name for name, _, _ in p.notes.shadows]
        assert names in ([], ["consistent-hash", "prefix-aware"])  # all shadows or none
        asked += bool(names)
        live_ttft += p.notes.chosen.ttft_s if names else 0.0
        urls.append(p.url)
        p.done()
    assert 60 <= asked <= 140  # a quarter of 400, drawn per decision
    reg = engine.metrics.registry
    for name in ("consistent-hash", "prefix-aware"):
        assert sum(reg.get_sample_value("kvrouter_shadow_decisions_total", {"shadow": name, "agrees": a}) or 0
                   for a in ("true", "false")) == asked
    assert reg.get_sample_value("kvrouter_shadow_predicted_ttft_seconds_total",
                                {"policy": "random", "role": "live"}) == pytest.approx(live_ttft)
    assert urls == placed(make_engine(build_policy("random")), 400)  # traffic as without shadows


def test_sampling_leaves_the_shadows_own_stream_as_it_was() -> None:
    # A random shadow asked about a share of decisions draws what it would have drawn on its
    # first decisions when asked about all of them: the sample comes from a stream of its own.
    def shadow_picks(sample: float, n: int) -> list[str]:
        engine = make_engine(build_policy("round-robin"), ("random",))
        engine.shadow_sample = sample
        picks = []
        for i in range(n):
            p = engine.place(RequestSummary("/v1/completions", prompt_tokens=100, prefix_blocks=(i,)), None)
            assert p is not None
            picks += [d.replica for _, d, _ in (p.notes.shadows if p.notes is not None else ())]
            p.done()
        return picks

    sampled = shadow_picks(0.5, 200)
    assert 0 < len(sampled) < 200
    assert sampled == shadow_picks(1.0, len(sampled))


def test_shadow_sample_must_be_a_share() -> None:
    assert parse_config({}).routing.shadow_sample == 1.0
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ConfigError, match=r"routing\.shadow_sample"):
            parse_config({"routing": {"shadow": ["prefix-aware"], "shadow_sample": bad}})
