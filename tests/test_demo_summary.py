"""The demo's summary over seeded rounds: means, ranges, rounds won, and the verdict in words."""

from __future__ import annotations

from kvrouter.loadtest.demo_summary import demo_report, summarize_rounds, table, verdict

POLICIES = ("coding-agent", "prefix_aware", "consistent_hash")


def res(chr_: float, p50: float, p95: float) -> dict:
    return {"cache_hit_rate": chr_, "ttft_p50_s": p50, "ttft_p95_s": p95}


def rounds_where(default: list[tuple], prefix: list[tuple], chash: list[tuple]) -> list[dict]:
    return [{"coding-agent": res(*a), "prefix_aware": res(*b), "consistent_hash": res(*c)}
            for a, b, c in zip(default, prefix, chash)]


def test_means_ranges_and_rounds_won():
    rounds = rounds_where([(0.8, 0.1, 2.0), (0.7, 0.2, 3.0)], [(0.75, 0.1, 2.5), (0.72, 0.3, 2.0)],
                          [(0.5, 0.5, 9.0), (0.5, 0.6, 9.0)])
    s = summarize_rounds(rounds, POLICIES)
    chr_ = s["policies"]["coding-agent"]["cache_hit_rate"]
    assert s["rounds"] == 2 and abs(chr_["mean"] - 0.75) < 1e-9 and (chr_["min"], chr_["max"]) == (0.7, 0.8)
    assert chr_["wins"] == 1 and s["policies"]["prefix_aware"]["cache_hit_rate"]["wins"] == 1
    assert s["policies"]["coding-agent"]["ttft_p50_s"]["wins"] == 2  # a tie counts for both
    assert "75.0% (70.0%-80.0%) | 1 of 2" in table(s)


def test_verdict_says_a_clear_win_only_when_every_round_agrees():
    rounds = rounds_where([(0.9, 0.1, 2.0)] * 3, [(0.8, 0.2, 3.0)] * 3, [(0.5, 0.5, 9.0)] * 3)
    words = verdict(summarize_rounds(rounds, POLICIES), "coding-agent")
    assert words[0].startswith("cache-hit rate: coding-agent 90.0% against prefix_aware's 80.0%")
    assert "best in every round" in words[0]
    assert words[-1] == "coding-agent has the best mean on every metric shown."


def test_verdict_names_where_the_default_does_not_win_and_calls_overlap_noise():
    rounds = rounds_where([(0.80, 0.2, 4.0), (0.70, 0.1, 5.0)], [(0.78, 0.1, 2.0), (0.74, 0.2, 2.5)],
                          [(0.5, 0.5, 9.0), (0.5, 0.6, 9.0)])
    words = verdict(summarize_rounds(rounds, POLICIES), "coding-agent")
    text = "\n".join(words)
    assert "prefix_aware is ahead on average" in words[0] and "not a clear loss" in words[0]
    assert "TTFT p95: coding-agent 4.50 s against prefix_aware's 2.25 s" in text
    assert "prefix_aware is better on average and coding-agent is best in no round; the ranges do not overlap" in text
    assert "TTFT p50: coding-agent 0.15 s against prefix_aware's 0.15 s (mean of 2 rounds): level on average" in text
    assert words[-1] == "Where coding-agent does not win here: cache-hit rate, TTFT p50, TTFT p95."
    report = demo_report("kvrouter demo --rounds 2", [0, 1], summarize_rounds(rounds, POLICIES), words)
    assert "[seed 1](round-1/report.md)" in report and "- Where coding-agent does not win" in report


def test_a_lead_the_printed_figures_cannot_show_is_level_and_not_a_win():
    # TTFT p50 0.131 s against 0.134 s: both print as 0.13 s
    rounds = rounds_where([(0.9, 0.131, 1.0)], [(0.8, 0.134, 2.0)], [(0.7, 0.2, 3.0)])
    words = verdict(summarize_rounds(rounds, POLICIES), "coding-agent")
    assert "TTFT p50: coding-agent 0.13 s against prefix_aware's 0.13 s (mean of 1 round): level on average; " \
           "coding-agent is best in 1 of 1 rounds." in words
    assert words[-1] == "Where coding-agent does not win here: TTFT p50."


def test_demo_refuses_zero_rounds(capsys):
    from kvrouter.cli import main

    assert main(["demo", "--rounds", "0"]) == 2
    assert "--rounds must be >= 1" in capsys.readouterr().err
