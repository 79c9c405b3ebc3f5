"""The replica model publishes its signals at SGLang's points only (virtual time, no sleeps):
/metrics gauges after a prefill batch, every decode_log_interval decode steps and on the idle
refresh; /v1/loads every load_snapshot_publish_interval decode steps, on prefill and on idle; KV
events at the stats reports and on idle."""

import dataclasses
import random

import pytest

from kvrouter.loadtest.cluster_sim import signals_of
from kvrouter.loadtest.profiles import load_profile
from kvrouter.loadtest.radix_cache import page_keys
from kvrouter.loadtest.replica_model import FirstToken, ReplicaModel, SimRequest
from kvrouter.loadtest.sim_kv_publisher import KVHashTracker

# One token per decode step, so a request's decode steps at time t are progress(t) - 1.
PLAIN = load_profile("tiny").model_copy(update={"spec_accept_length": 1.0, "spec_verify_tokens": 1})
PS = PLAIN.page_size


def request(rid, prompt_len, out, seed=0, prefix=()):
    rng = random.Random(seed)
    prompt = list(prefix) + [rng.randrange(1 << 17) for _ in range(prompt_len - len(prefix))]
    full = prompt + [rng.randrange(1 << 17) for _ in range(out)]
    return SimRequest(rid, len(prompt), out, page_keys(full, PS, "m"), full), full


def first_token_time(model, rid, t=0.0):
    while True:
        t = model.next_event_time()
        for ev in model.advance(t):
            if isinstance(ev, FirstToken) and ev.rid == rid:
                return ev


def sample(model, start, end, n, rid="a"):
    """(t, published metrics, published loads, instant load, decode steps of `rid`) at n + 1
    evenly spaced times (closer than one decode step)."""
    out = []
    for i in range(n + 1):
        t = start + (end - start) * i / n
        model.advance(t)
        out.append((t, model.published_metrics(t), model.published_loads(t), model.load(t),
                    decode_steps(model, rid, t)))
    return out


def decode_steps(model, rid, now):
    """Decode steps of `rid` by `now` (the model's current time: progress is not a history)."""
    return model.progress(rid, now) - 1


def steps_at_change(rows, col, value_time):
    """Decode steps at the first sample showing the value published at `value_time`."""
    return next(row[4] for row in rows if row[col].time == value_time)


def test_metrics_change_only_after_prefill_and_every_decode_log_interval_steps():
    model = ReplicaModel(PLAIN)
    req, _ = request("a", 200, 3000)
    model.submit(req, 0.0)
    ft = first_token_time(model, "a")
    m = model.published_metrics(ft.time)
    # report_prefill_stats: the batch's hit rate; its requests are not yet in the running batch
    assert m.time == ft.time and m.num_running_reqs == 0 and m.cache_hit_rate == 0.0
    assert m.num_used_tokens > 0

    end = ft.time + 1.0
    rows = sample(model, ft.time, end, 4000)
    refreshes = sorted({row[1].time for row in rows} - {ft.time})
    assert len(refreshes) >= 3
    # each refresh lands on a multiple of decode_log_interval decode steps
    assert [steps_at_change(rows, 1, t) for t in refreshes] == [
        PLAIN.decode_log_interval * (i + 1) for i in range(len(refreshes))
    ]
    # between two refreshes the gauges are one unchanged object, while the live state moves on
    window = [row for row in rows if refreshes[0] <= row[0] < refreshes[1]]
    assert len({id(row[1]) for row in window}) == 1
    assert len({row[3].num_used_tokens for row in window}) > 1
    report = window[0][1]
    assert report.num_running_reqs == 1 and report.cache_hit_rate == 0.0
    assert report.gen_throughput > 0
    assert report.decode_sum_seq_lens == 200 + 1 + PLAIN.decode_log_interval
    # the published usage is the one at the report step, not the instant one
    assert window[-1][3].num_used_tokens > report.num_used_tokens


def test_loads_publish_every_load_snapshot_interval_steps_and_on_prefill():
    model = ReplicaModel(PLAIN)
    req, _ = request("a", 200, 3000)
    model.submit(req, 0.0)
    ft = first_token_time(model, "a")
    assert model.published_loads(ft.time).time == ft.time  # forced on the prefill result
    rows = sample(model, ft.time, ft.time + 0.3, 1500)
    publishes = sorted({row[2].time for row in rows} - {ft.time})
    assert len(publishes) >= 6
    every = PLAIN.load_snapshot_publish_interval
    assert [steps_at_change(rows, 2, t) for t in publishes[:4]] == [every, 2 * every, 3 * every, 4 * every]
    snap = rows[-1][2]
    assert snap.num_running_reqs == 1 and snap.num_waiting_reqs == 0
    assert snap.num_total_tokens == snap.num_used_tokens  # nothing waiting


def test_cache_hit_rate_from_the_last_prefill_then_zero_at_the_next_decode_report():
    model = ReplicaModel(PLAIN)
    first, full = request("a", 320, 16, seed=1)
    model.submit(first, 0.0)
    while model.next_event_time() is not None:
        model.advance(model.next_event_time())
    second, _ = request("b", 480, 200, seed=2, prefix=full[:320])
    t0 = model._now + 1.0
    model.submit(second, t0)
    ft = first_token_time(model, "b")
    hit = model.published_metrics(ft.time).cache_hit_rate
    assert hit == pytest.approx(320 / 480)
    # unchanged until the first decode report, then reset to 0
    t = ft.time
    while model.published_metrics(t).time == ft.time:
        t += 0.001
        model.advance(t)
        if model.published_metrics(t).time == ft.time:
            assert model.published_metrics(t).cache_hit_rate == hit
    assert model.published_metrics(t).cache_hit_rate == 0.0
    # the decode-step counter is the scheduler's, never reset: "a" made 15 of the first 40
    assert 15 + decode_steps(model, "b", t) == PLAIN.decode_log_interval


def test_idle_refresh_waits_idle_metrics_interval_after_the_last_report():
    model = ReplicaModel(PLAIN)
    req, _ = request("a", 200, 100)
    model.submit(req, 0.0)
    while model.next_event_time() is not None:
        model.advance(model.next_event_time())
    done = model._now
    last = model.published_metrics(done)
    assert last.num_running_reqs == 1  # the last decode report, 80 steps in
    assert model.published_loads(done).num_running_reqs == 0  # loads are published on idle
    assert model.published_metrics(last.time + PLAIN.idle_metrics_interval_s - 1e-6) is last
    idle = model.published_metrics(last.time + PLAIN.idle_metrics_interval_s)
    assert idle.num_running_reqs == 0 and idle.gen_throughput == 0.0
    assert idle.time == pytest.approx(last.time + PLAIN.idle_metrics_interval_s)
    assert idle.num_used_tokens == model.load(done + 100).num_used_tokens


def test_small_decode_log_interval_tracks_the_live_state():
    fast = PLAIN.model_copy(update={"decode_log_interval": 1, "load_snapshot_publish_interval": 1})
    model = ReplicaModel(fast)
    req, _ = request("a", 200, 300)
    model.submit(req, 0.0)
    ft = first_token_time(model, "a")
    for t, m, loads, live, _ in sample(model, ft.time + 0.01, ft.time + 0.2, 50):
        assert m.num_running_reqs == live.num_running_reqs == loads.num_running_reqs == 1
        assert 0 <= t - m.time < 0.003 and 0 <= t - loads.time < 0.003  # at most one step old


def test_kv_events_wait_for_the_next_report():
    tracker = KVHashTracker(PS)
    model = ReplicaModel(PLAIN, kv_sink=tracker)
    long_req, _ = request("long", 160, 400, seed=3)
    short_req, _ = request("short", 160, 50, seed=4)
    model.submit(long_req, 0.0)
    model.submit(short_req, 0.0)
    ft = first_token_time(model, "long")
    assert tracker.take()  # the prefill's pages, flushed with report_prefill_stats
    finish = None
    t = ft.time
    while finish is None:
        t = model.next_event_time()
        for ev in model.advance(t):
            if getattr(ev, "rid", None) == "short" and type(ev).__name__ == "Finished":
                finish = ev.time
    steps = decode_steps(model, "long", finish)
    assert steps % PLAIN.decode_log_interval != 0
    model.advance(finish + 1e-9)
    assert tracker.take() == []  # the finished request's pages are in the tree, not yet published
    report_at = steps + (-steps % PLAIN.decode_log_interval)
    while decode_steps(model, "long", t) < report_at:
        t += 0.0005
        model.advance(t)
    assert tracker.take()  # published with the decode report


def test_cluster_signals_are_the_published_gauges():
    model = ReplicaModel(PLAIN)
    req, _ = request("a", 200, 300)
    model.submit(req, 0.0)
    ft = first_token_time(model, "a")
    t = ft.time + 0.05
    model.advance(t)
    signals = signals_of(model, t)
    published = model.published_metrics(t)
    # 20 decode steps in: still the prefill report, which did not count the new request running
    assert signals.num_running_reqs == published.num_running_reqs == 0
    assert model.load(t).num_running_reqs == 1
    assert signals.num_used_tokens == published.num_used_tokens
    assert signals.cache_hit_rate == published.cache_hit_rate


def test_retraction_gauges_are_set_at_prefill_reports_only():
    """SGLang's log_prefill_stats publishes the admission ratio (new_token_ratio) and the last
    retraction's count (num_retracted_reqs, then zeroed for the next report); decode and idle
    reports repeat the last values."""
    tiny = load_profile("tiny").model_copy(update={"max_total_num_tokens": 4096})
    model = ReplicaModel(tiny)
    assert model.signals.metrics.new_token_ratio == 0.0  # SchedulerStats' default before a report
    reports = []  # (ratio, retractions so far, last retraction's count) at each prefill report
    original = model.signals.prefill_report

    def spy(*args, **kwargs):
        reports.append((model.new_token_ratio, model.num_retracted_reqs_total, model.num_retracted_reqs))
        original(*args, **kwargs)
        published = model.signals.metrics
        seen_before = reports[-2][1] if len(reports) > 1 else 0
        expected = reports[-1][2] if reports[-1][1] != seen_before else 0
        assert (published.new_token_ratio, published.num_retracted_reqs) == (reports[-1][0], expected)

    model.signals.prefill_report = spy
    for i in range(8):
        req, _ = request(f"r{i}", 200, 900 + 37 * i, seed=400 + i)
        model.submit(dataclasses.replace(req, max_new_tokens=req.output_len), 0.0)
    published = []
    while (t := model.next_event_time()) is not None:
        model.advance(t)
        m = model.published_metrics(t)
        published.append(m.num_retracted_reqs)
        if reports:  # decode reports in between carry the last prefill report's values
            assert m.new_token_ratio == reports[-1][0]
    assert model.num_retracted_reqs_total > 0
    assert max(published) > 0 and published[-1] == 0


def test_a_model_without_loads_publishes_the_same_metrics_and_refuses_loads():
    """The cluster simulator polls /metrics only, so its models keep no /v1/loads snapshot;
    everything else they publish and schedule is unchanged."""
    with_loads, without = ReplicaModel(PLAIN), ReplicaModel(PLAIN, publish_loads=False)
    shared = request("a", 300, 700, seed=1)[1][:256]
    for model in (with_loads, without):
        model.submit(request("a", 300, 700, seed=1)[0], 0.0)
        model.submit(request("b", 500, 90, seed=2, prefix=shared)[0], 0.05)
    seen = {id(with_loads): [], id(without): []}
    t = 0.0
    while t < 30.0:
        for model in (with_loads, without):
            events = model.advance(t)
            seen[id(model)].append((events, model.published_metrics(t), signals_of(model, t)))
        t += 0.013
    assert seen[id(with_loads)] == seen[id(without)]
    assert any(events for events, _, _ in seen[id(without)])
    assert with_loads.published_loads(t).time > 0
    with pytest.raises(RuntimeError, match="publish_loads"):
        without.published_loads(t)
