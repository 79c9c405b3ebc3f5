"""The simulated replica's `/metrics` page: prometheus_client's exposition byte for byte, and cheap.

A replica on a hand-driven clock (no event loop work, so every scrape sees a known state) is taken
through requests, aborts and idle refreshes; at every step its page must equal what
prometheus_client's `generate_latest` writes for the same series at that moment.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvrouter.loadtest import sim_metrics_page, tokenizer
from kvrouter.loadtest.profiles import load_profile
from kvrouter.loadtest.sim_metrics import SimCollector
from kvrouter.loadtest.sim_metrics_page import MetricsPage
from kvrouter.loadtest.sim_replica import SimReplica
from kvrouter.sglang_protocol import metric_names as sg
from kvrouter.sglang_protocol.signals import parse_metrics_text


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _replica(hicache: bool, name: str = "kimi") -> tuple[SimReplica, Clock, CollectorRegistry]:
    profile = load_profile("tiny").model_copy(update={"idle_metrics_interval_s": 0.5})
    if hicache:
        profile = profile.model_copy(update={"host_total_num_tokens": 40960})
    clock = Clock()
    sim = SimReplica(profile, time_scale=1.0, clock=clock, served_model_name=name)
    reference = CollectorRegistry(auto_describe=False)
    reference.register(SimCollector(sim))  # type: ignore[arg-type]
    return sim, clock, reference


def _scrape_matches(sim: SimReplica, reference: CollectorRegistry) -> bytes:
    page = sim.metrics_page.render()
    assert page == generate_latest(reference)
    assert MetricsPage(sim).render() == page  # a page built from nothing says the same
    return page


@pytest.mark.parametrize(("hicache", "name"), [(False, "kimi"), (True, 'we"ird\\name\nx')])
def test_page_equals_prometheus_client_text_through_requests(hicache: bool, name: str) -> None:
    sim, clock, reference = _replica(hicache, name)
    pages = [_scrape_matches(sim, reference)]
    prompt = tokenizer.synthetic_text(300, 1)
    for i in range(12):
        sim.submit(prompt_text=prompt + tokenizer.synthetic_text(50 * i, i), max_new_tokens=20 + i,
                   stream=i % 3 != 0)
        clock.t += 0.01
        pages.append(_scrape_matches(sim, reference))
    doomed = sim.submit(prompt_text=tokenizer.synthetic_text(200, 99), max_new_tokens=500)
    clock.t += 0.01
    sim.abort(doomed.rid)
    for _ in range(40):  # decode, finish, then an idle refresh
        clock.t += 0.05
        pages.append(_scrape_matches(sim, reference))
    assert not sim.running_rids()
    signals = parse_metrics_text(pages[-1].decode(), strict=True)
    assert signals.num_running_reqs == 0 and signals.max_total_num_tokens == 20480
    text = pages[-1].decode()
    assert 'sglang:num_requests_total{' in text and 'is_streaming="true"' in text
    assert 'sglang:num_aborted_requests_total{' in text
    assert len(set(pages)) > 10  # the values moved along the way


def test_a_change_shows_at_the_next_scrape_and_an_unchanged_page_is_reused() -> None:
    sim, clock, reference = _replica(hicache=False)
    first = sim.metrics_page.render()
    assert sim.metrics_page.render() is first  # nothing changed: the same bytes
    st = sim.submit(prompt_text=tokenizer.synthetic_text(100, 3), max_new_tokens=5)
    while not st.over:
        clock.t += 0.01
        sim.poll()
    after = _scrape_matches(sim, reference)
    assert after != first
    requests = [line for line in after.decode().splitlines()
                if line.startswith(sg.prefixed(sg.NUM_REQUESTS_TOTAL) + "{")]
    assert requests and requests[0].endswith(" 1.0")


def test_an_unchanged_histogram_is_not_formatted_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # A busy replica is scraped several times a second; only what changed is formatted again.
    sim, clock, _ = _replica(hicache=False)
    for i in range(3):
        sim.submit(prompt_text=tokenizer.synthetic_text(100, i), max_new_tokens=5, stream=True)
    while sim.running_rids():
        clock.t += 0.01
        sim.poll()
    formatted = []
    real = sim_metrics_page.floatToGoString

    def counting(v: float) -> str:
        formatted.append(v)
        return real(v)

    monkeypatch.setattr(sim_metrics_page, "floatToGoString", counting)
    full = MetricsPage(sim).render()
    everything = len(formatted)
    samples = sum(1 for line in full.decode().splitlines() if not line.startswith("#"))
    assert everything == samples > 100
    formatted.clear()
    sim.metrics_page.render()
    formatted.clear()
    sim.metrics_page.render()
    assert 0 < len(formatted) < 40  # the gauges and counters, no histogram bucket


def test_scrape_cpu_benchmark_runs_and_finds_the_texts_equal(capsys: pytest.CaptureFixture[str]) -> None:
    # benchmarks/metrics_scrape_cpu.py asserts the page equals generate_latest at every scrape of
    # a busy replica of the default profile (speculative decoding, its own buckets of traffic).
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "metrics_scrape_cpu.py"
    spec = importlib.util.spec_from_file_location("metrics_scrape_cpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--rounds", "1", "--scrapes", "5", "--warm-finished", "20"])
    assert "busy: page" in capsys.readouterr().out
