"""The policy matrix's summary: means and ranges over seeds, and whether the default's mean is at
least every baseline's (higher cache-hit rate, lower TTFT p95)."""

from __future__ import annotations

from kvrouter.loadtest.policy_matrix import markdown, summarize


def r(chr_: float, p95: float) -> dict:
    return {"cache_hit_rate": chr_, "ttft_p95_s": p95}


def test_summary_means_ranges_and_default_flags():
    runs = {
        "nominal": {"coding-agent": {1: r(0.9, 3.0), 2: r(0.8, 4.0)},
                    "prefix-aware": {1: r(0.84, 3.2), 2: r(0.84, 3.2)}},
    }
    row = summarize(runs)["nominal"]
    assert abs(row["coding-agent"]["cache_hit_rate"]["mean"] - 0.85) < 1e-9
    assert row["coding-agent"]["ttft_p95_s"]["min"] == 3.0 and row["coding-agent"]["ttft_p95_s"]["max"] == 4.0
    assert row["default_best_chr"] is True and row["default_best_p95"] is False
    table = markdown(summarize(runs))
    assert "| nominal | coding-agent | 0.850 (0.800-0.900) | 3.50 (3.00-4.00) (behind) |" in table
    assert "| nominal | prefix-aware | 0.840 (0.840-0.840) | 3.20 (3.20-3.20) |" in table
