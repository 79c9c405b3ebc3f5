"""A workload that cannot fit the replicas is refused before any load; failures are grouped by reason."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kvrouter.cli import main
from kvrouter.loadtest.fit import limits_for_profile, limits_from_metrics, refusal
from kvrouter.loadtest.report import RequestRecord, failure_reason, summarize_requests
from kvrouter.loadtest.workload_config import load_workload

from .procs import start_sim_proc, wait_http

ROOT = Path(__file__).resolve().parent.parent
TINY_KV_TOKENS = "20,480"  # loadtest/profiles/tiny.yaml max_total_num_tokens


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_compare_refuses_a_workload_that_cannot_fit_before_starting_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    code = main(["compare", "--replicas", "2", "--profile", "tiny", "--workload", "coding-agent",
                 "--policies", "round_robin", "--users", "4", "--duration", "30",
                 "--out-dir", str(tmp_path / "out")])
    assert code == 2
    assert time.monotonic() - t0 < 30  # nothing was started: no replica, no router, no load
    line = _one_line(capsys.readouterr().err)
    assert "profile 'tiny'" in line and TINY_KV_TOKENS in line and "max_total_num_tokens" in line
    assert "workload 'coding-agent'" in line and "prompts of" in line
    assert not (tmp_path / "out").exists()


def test_the_check_passes_workloads_that_fit() -> None:
    assert refusal(load_workload("tiny"), limits_for_profile("tiny")) is None
    assert refusal(load_workload("coding-agent"), limits_for_profile("kimi-k2.6-b200-tp4")) is None


def test_the_check_mirrors_what_the_replica_enforces() -> None:
    limits = limits_for_profile("tiny")  # 20480 KV tokens, clip_max_new_tokens 4096
    assert limits.fits(20_000, 400) and not limits.fits(20_000, 480)
    assert limits.fits(10_000, 100_000)  # the replica reserves at most clip_max_new_tokens
    assert not limits.fits(300_000, 1)  # longer than the context length


async def test_loadtest_refuses_using_the_replicas_own_limits(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    proc, url = start_sim_proc(tmp_path)
    try:
        await wait_http(url)
        import asyncio

        code = await asyncio.to_thread(main, [
            "loadtest", "--target", url, "--workload", "coding-agent", "--users", "2", "--duration", "30",
            "--replica-metrics", url + "/metrics"])
    finally:
        proc.stop()
    assert code == 2
    line = _one_line(capsys.readouterr().err)
    assert f"replica {url}/metrics" in line and TINY_KV_TOKENS in line


def test_limits_from_a_metrics_page() -> None:
    text = ('# HELP sglang:max_total_num_tokens x\nsglang:max_total_num_tokens{model_name="m"} 20480.0\n'
            'sglang:context_len{model_name="m"} 4096.0\n')
    limits = limits_from_metrics(text, "replica r")
    assert limits is not None and (limits.max_total_num_tokens, limits.context_len) == (20480, 4096)
    assert limits_from_metrics("sglang:num_running_reqs 0\n", "r") is None


def test_failure_reasons_group_status_and_message() -> None:
    body = '{"error":{"message":"The input (31000 tokens) is longer than the model\'s context length (2048 tokens).","code":400}}'
    records = [RequestRecord("s", ok=True)] + [
        RequestRecord("s", ok=False, error=f"HTTP 400: {body.replace('31000', str(30000 + i))}") for i in range(3)
    ] + [RequestRecord("s", ok=False, error="SSE error: {'message': 'upstream replica failed', 'code': 502}"),
         RequestRecord("s", ok=False, error="stream ended before data: [DONE]")]
    failures = summarize_requests(records, replicas=1, duration_model_s=60)["failures"]
    assert failures == [
        {"status": 400, "message": "The input (N tokens) is longer than the model's context length (N tokens).",
         "count": 3},
        {"status": 502, "message": "upstream replica failed", "count": 1},
        {"status": None, "message": "stream ended before data: [DONE]", "count": 1},
    ]
    assert failure_reason("HTTP 503: <html>busy</html>") == (503, "<html>busy</html>")


async def test_loadtest_reports_failed_requests_by_reason(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Prompts longer than the replica's context: every request fails with the replica's 400, and the
    printed table and the JSON say so by status and message."""
    workload = tmp_path / "too-long.yaml"
    workload.write_text((ROOT / "loadtest" / "workloads" / "tiny.yaml").read_text().replace("name: tiny", "name: too-long")
                        .replace("system_prompt_tokens: 64", "system_prompt_tokens: 30000")
                        .replace("max_context_tokens: 2048", "max_context_tokens: 262144"))
    proc, url = start_sim_proc(tmp_path, time_scale=100.0)
    out = tmp_path / "results.json"
    try:
        await wait_http(url)
        import asyncio

        code = await asyncio.to_thread(main, [
            "loadtest", "--target", url, "--workload", str(workload), "--users", "2", "--duration", "1",
            "--time-scale", "100", "--json", str(out)])
    finally:
        proc.stop()
    assert code == 1  # nothing succeeded
    printed = capsys.readouterr().out
    assert "failed requests by reason" in printed and "| 400 |" in printed
    result = json.loads(out.read_text())["results"]
    (failures,) = [r["failures"] for r in result.values()]
    assert failures and all(f["status"] == 400 for f in failures)
    assert sum(f["count"] for f in failures) == sum(r["requests_failed"] for r in result.values())
    assert [f["message"] for f in failures] == ["request 'N' can never fit in N KV tokens"]
