"""metrics/: the Grafana dashboard only queries metrics that exist (the router's registry or
SGLang's names in sglang_protocol/metric_names.py), and the alert rules pass `promtool check rules` and the
`promtool test rules` unit tests. Every dashboard query is also parsed by promtool."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvrouter.metrics.router_metrics import RouterMetrics
from kvrouter.sglang_protocol.metric_names import METRIC_SPECS, PREFIXES

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "metrics" / "kvrouter-dashboard.json"
ALERTS = ROOT / "metrics" / "kvrouter-alerts.yaml"
ALERT_TESTS = ROOT / "tests" / "promtool" / "kvrouter-alerts.test.yaml"

PROMQL_WORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
                "group_right", "bool", "offset", "inf", "nan", "le"}


def router_metric_names() -> set[str]:
    names = set()
    for family in RouterMetrics().registry.collect():
        if family.type == "counter":
            names |= {family.name + "_total", family.name + "_created"}
        elif family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count", "_created")}
        else:
            names.add(family.name)
    return names


def sglang_metric_names() -> set[str]:
    names = set()
    for spec in METRIC_SPECS:
        for prefix in PREFIXES:
            base = spec.name(prefix)
            names |= {base + s for s in ("_bucket", "_sum", "_count")} if spec.type == "histogram" else {base}
    return names


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (not functions, keywords or label names)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\$\{?\w+\}?", "", e)
    found = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end():].lstrip().startswith("(") or m.group(0) in PROMQL_WORDS:
            continue
        found.add(m.group(0))
    return found


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for var in dash["templating"]["list"]:
        q = var.get("query")
        if isinstance(q, dict) and "label_values(" in q.get("query", ""):
            exprs.append(re.sub(r"label_values\(([^,]+),.*\)", r"\1", q["query"]))
    return exprs


def alert_exprs() -> list[str]:
    return [r["expr"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def test_metric_name_extraction():
    assert metric_names('histogram_quantile(0.95, sum by (le) (rate(a_bucket{job=~"$job"}[5m])))') == {"a_bucket"}
    assert metric_names("x > 2 and on (job, instance) avg without (replica) (y) >= 4") == {"x", "y"}
    assert metric_names("sum(rate(sglang:prompt_tokens_total[$__rate_interval]))") == {"sglang:prompt_tokens_total"}


def test_dashboard_queries_only_existing_metrics():
    known = router_metric_names() | sglang_metric_names()
    used = set().union(*(metric_names(e) for e in dashboard_exprs()))
    assert used, "no queries found in the dashboard"
    assert sorted(used - known) == []
    # What the dashboard must show.
    for required in ("kvrouter_routing_decisions_total", "kvrouter_estimated_cached_tokens_total",
                     "kvrouter_prompt_tokens_total", "kvrouter_replica_in_flight_requests",
                     "kvrouter_replica_queued_requests", "kvrouter_replica_token_usage_ratio",
                     "kvrouter_upstream_ttfb_seconds_bucket", "kvrouter_request_duration_seconds_bucket",
                     "kvrouter_load_max_over_mean_ratio", "kvrouter_affinity_store_degraded",
                     "sglang:time_to_first_token_seconds_bucket"):
        assert required in used, required
    decisions = [e for e in dashboard_exprs() if "kvrouter_routing_decisions_total" in e]
    assert any("by (reason)" in e for e in decisions)


def test_dashboard_shows_shadow_policies_and_decision_log_drops():
    exprs = dashboard_exprs()
    used = set().union(*(metric_names(e) for e in exprs))
    for required in ("kvrouter_shadow_decisions_total", "kvrouter_shadow_picks_total",
                     "kvrouter_shadow_predicted_ttft_seconds_total", "kvrouter_decision_log_dropped_total"):
        assert required in used, required
    # Agreement rate and predicted gain, per shadow policy.
    assert any('agrees="true"' in e and "by (shadow)" in e for e in exprs)
    assert any('role="shadow"' in e and 'role="live"' in e and "by (policy)" in e for e in exprs)
    alerts = [e for e in alert_exprs() if "kvrouter_decision_log_dropped_total" in e]
    assert alerts, "no alert on decision-log drops"


def test_dashboard_is_importable_grafana_json():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    ids = []

    def walk(panels):
        for p in panels:
            ids.append(p["id"])
            assert set(p["gridPos"]) == {"h", "w", "x", "y"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
            walk(p.get("panels", []))

    walk(dash["panels"])
    assert len(ids) == len(set(ids))


def test_alert_rules_use_existing_metrics():
    known = router_metric_names() | sglang_metric_names()
    used = set().union(*(metric_names(e) for e in alert_exprs()))
    assert sorted(used - known) == []


# -- promtool ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def promtool() -> str:
    """promtool from Debian's `prometheus` package (.ci/run installs it). Missing: a skip on a
    developer's machine, a failure under CI (CI=true), where the rule checks must run."""
    path = shutil.which("promtool")
    if path is None:
        why = ("promtool not found: install the Debian package `prometheus` "
               "(apt-get install -y --no-install-recommends prometheus) to run the rule checks")
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return path


def run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_promtool_check_rules(promtool):
    done = run([promtool, "check", "rules", str(ALERTS)])
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_unit_tests(promtool):
    done = run([promtool, "test", "rules", str(ALERT_TESTS)])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_rejects_a_broken_rule(promtool, tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("groups:\n  - name: x\n    rules:\n      - alert: X\n        expr: sum(rate(a[5m])\n")
    assert run([promtool, "check", "rules", str(bad)]).returncode != 0


def test_promtool_parses_every_dashboard_query(promtool, tmp_path: Path):
    rules = [{"record": f"dashboard:query_{i}:expr",
              "expr": e.replace("$__rate_interval", "5m").replace("$job", ".*")}
             for i, e in enumerate(dashboard_exprs())]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = run([promtool, "check", "rules", str(path)])
    assert done.returncode == 0, done.stdout + done.stderr
