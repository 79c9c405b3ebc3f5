"""The cluster simulator knows only what the live router knows, and can run in a world that is not
the policy's model (`kvrouter simulate --world-perturb`)."""

from __future__ import annotations

import pytest

from kvrouter.cli import main
from kvrouter.loadtest.cluster_sim import ClusterSimulator, ScaleEvent, SimConfig, signals_of
from kvrouter.loadtest.profiles import load_profile, scale_profile
from kvrouter.loadtest.replica_model import FirstToken, ReplicaModel, SimRequest
from kvrouter.loadtest.segment_keys import SegmentKeyCache
from kvrouter.loadtest.distributions import Constant
from kvrouter.loadtest.turn_request import Segment
from kvrouter.loadtest.workload import make_session
from kvrouter.loadtest.workload_config import load_workload
from kvrouter.loadtest.world import SignalDelay, World, WorldSpecError, parse_world
from kvrouter.policies.cost import DEFAULT_CAPACITY_TOKENS, CostParams
from kvrouter.policies.registry import build_policy

WL = load_workload("coding-agent")
PROFILE = load_profile()


# -- Knowledge: homes outlive the session until the TTL -------------------------------------------
def test_ended_session_keeps_its_home_and_kv_until_the_ttl():
    workload = WL.model_copy(update={"turns_per_session": Constant(value=2)})
    session = make_session(workload, 1, 0)
    ttl = 60.0
    sim = ClusterSimulator(
        SimConfig(replicas=2, duration_s=600.0, seed=1, warmup_s=0, warm_start=False,
                  session_ttl_s=ttl, drain_s=0),
        "coding-agent", workload, arrivals=[(0.0, session)],
    )
    seen: list[tuple[float, bool, str | None, int, float]] = []

    def observe() -> None:  # in place of the load sampler: what the router holds, every 5 s
        entry = sim.table.entry(session.session_id)
        home = entry.home if entry is not None else None
        view = sim.registry.view(home) if home is not None else None
        seen.append((sim.now, bool(sim._sessions), home, view.homed_tokens if view else 0,
                     entry.last_seen if entry is not None else -1.0))

    sim._sample = observe
    sim.run()
    ended = [s for s in seen if not s[1]]
    assert ended and ended[0][0] < 300.0, "the session should end well before the run does"
    last_seen = ended[0][4]
    within = [s for s in ended if s[0] - last_seen <= ttl]
    after = [s for s in ended if s[0] - last_seen >= ttl + sim.config.housekeeping_interval_s]
    assert within and after
    for _, _, home, homed_tokens, _ in within:  # ended, but the router cannot know: home kept
        assert home is not None and homed_tokens > 0
    for _, _, home, homed_tokens, _ in after:  # idle past the TTL: forgotten, KV demand released
        assert home is None
    assert all(view.homed_tokens == 0 and view.homed_sessions == 0 for view in sim.registry.snapshot().replicas)


def test_the_router_hears_of_a_replica_only_through_polls():
    sim = ClusterSimulator(SimConfig(replicas=2, duration_s=10.0), "coding-agent", WL)
    # Before the first poll the router knows nothing of the replicas' signals or capacity.
    assert all(view.max_total_num_tokens is None for view in sim.registry.snapshot().replicas)
    sim._poll()
    assert all(view.max_total_num_tokens == PROFILE.max_total_num_tokens
               for view in sim.registry.snapshot().replicas)


# -- The spec --------------------------------------------------------------------------------------
def test_world_spec_parses():
    assert parse_world("nominal") == World()
    assert parse_world("speed=2") == World(speed=2.0, spec="speed=2")
    world = parse_world("capacity=0.7, signal-lag=2")
    assert (world.capacity, world.signal_lag_s, world.speed) == (0.7, 2.0, 1.0)
    assert world.spec == "capacity=0.7,signal-lag=2"


@pytest.mark.parametrize("spec", ["speed", "speed=fast", "lag=2", "speed=0", "capacity=-1",
                                  "signal-lag=-1", "speed=2,speed=3", "speed=nan"])
def test_bad_world_spec_is_one_clear_line_and_exit_2(spec, capsys):
    with pytest.raises(WorldSpecError):
        parse_world(spec)
    assert main(["simulate", "--replicas", "2", "--world-perturb", spec]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--world-perturb" in err and "bad world spec" in err
    assert "Traceback" not in err


# -- The perturbed world really differs ------------------------------------------------------------
def _cold_ttft(profile) -> float:
    model = ReplicaModel(profile)
    keys = SegmentKeyCache(profile.page_size, namespace="t")
    prompt = 50_000
    seg = Segment("user", prompt, "cold-prompt")
    model.submit(SimRequest("r", prompt, 50, keys.keys("sess", (seg,))), 0.0)
    t = 0.0
    while (at := model.next_event_time()) is not None:
        t = max(t, at)
        for event in model.advance(t):
            if isinstance(event, FirstToken):
                return event.time
    raise AssertionError("no first token")


def test_speed_scales_every_prefill_and_decode_time():
    nominal = _cold_ttft(PROFILE)
    assert _cold_ttft(scale_profile(PROFILE, speed=2)) == pytest.approx(nominal / 2, rel=1e-9)
    assert _cold_ttft(scale_profile(PROFILE, speed=0.5)) == pytest.approx(nominal * 2, rel=1e-9)
    from kvrouter.loadtest import timing

    fast = scale_profile(PROFILE, speed=2)
    assert timing.decode_step_time(fast, 8, 50_000) == pytest.approx(
        timing.decode_step_time(PROFILE, 8, 50_000) / 2, rel=1e-12)


def test_capacity_is_smaller_and_reported_but_the_policy_defaults_stay_nominal():
    sim = ClusterSimulator(SimConfig(replicas=2, duration_s=30.0, world=parse_world("capacity=0.7")),
                           "coding-agent", WL)
    true = sim.profile.max_total_num_tokens
    assert true == int(PROFILE.max_total_num_tokens * 0.7) // PROFILE.page_size * PROFILE.page_size
    model = next(iter(sim.models.values()))
    assert signals_of(model, 0.0).max_total_num_tokens == true  # the replica reports the truth
    sim._poll()
    assert {v.max_total_num_tokens for v in sim.registry.snapshot().replicas} == {true}
    # ... while everything the policy and engine were configured with is the nominal profile's.
    assert sim.engine.default_capacity_tokens == PROFILE.max_total_num_tokens
    assert sim.index.default_capacity_tokens == PROFILE.max_total_num_tokens
    assert sim.engine.policy.params == build_policy("coding-agent", {}).params
    assert CostParams().default_capacity_tokens == DEFAULT_CAPACITY_TOKENS  # untouched by the world
    assert load_profile() == PROFILE  # the loaded profile is not changed by scaling


def test_perturbed_worlds_run_and_leave_the_policy_untouched():
    before = build_policy("coding-agent", {}).params
    results = {}
    for spec in ("nominal", "speed=2", "speed=0.5"):
        sim = ClusterSimulator(SimConfig(replicas=4, sessions=12, duration_s=150.0, seed=2, warmup_s=0,
                                         page_tokens=512, world=parse_world(spec)), "coding-agent", WL)
        results[spec] = sim.run()
        assert sim.engine.policy.params == before
    assert results["speed=2"]["ttft_p50_s"] < results["nominal"]["ttft_p50_s"] < results["speed=0.5"]["ttft_p50_s"]


# -- Signal lag ------------------------------------------------------------------------------------
def test_signal_delay_delivers_exactly_lag_late():
    delay = SignalDelay(2.0)
    a, b = object(), object()
    assert delay.publish("r0", a, 0.25) == 2.25  # type: ignore[arg-type]
    delay.publish("r1", b, 0.5)  # type: ignore[arg-type]
    assert delay.due(2.2499) == []
    assert delay.due(2.25) == [("r0", a)]
    assert delay.due(2.4) == []
    assert delay.due(2.5) == [("r1", b)]
    assert len(delay) == 0


def test_simulated_router_receives_each_poll_lag_seconds_late():
    sim = ClusterSimulator(SimConfig(replicas=3, sessions=9, duration_s=60.0, seed=1, warmup_s=0,
                                     page_tokens=512, world=parse_world("signal-lag=2")),
                           "coding-agent", WL)
    published: dict[int, float] = {}
    received: list[tuple[float, float]] = []
    publish, receive = sim.signal_delay.publish, sim._receive

    def on_publish(url, signals, now):
        published[id(signals)] = now
        return publish(url, signals, now)

    def on_receive(url, signals):
        received.append((sim.now, published[id(signals)]))
        receive(url, signals)

    sim.signal_delay.publish = on_publish
    sim._receive = on_receive
    sim.run()
    assert len(received) > 20
    assert all(got - sent == 2.0 for got, sent in received)
    # Nothing reaches the registry in the first two seconds.
    assert min(got for got, _ in received) == 2.0


def test_a_crashed_replica_is_found_out_by_failed_polls_not_told():
    sim = ClusterSimulator(SimConfig(replicas=4, sessions=16, duration_s=200.0, seed=3, page_tokens=512,
                                     scale_events=(ScaleEvent(150.0, remove=("replica-0000",)),)),
                           "coding-agent", WL)
    health: list[tuple[float, bool]] = []
    scale, poll = sim._scale, sim._poll

    def on_scale(event):
        scale(event)
        view = sim.registry.view("replica-0000")
        assert view is not None and view.healthy  # the crash itself is news to nobody

    def on_poll():
        poll()
        if sim.now >= 150.0:
            health.append((sim.now, sim.registry.view("replica-0000").healthy))

    sim._scale, sim._poll = on_scale, on_poll
    result = sim.run()
    first_unhealthy = min(t for t, healthy in health if not healthy)
    threshold = sim.config.failure_threshold
    assert first_unhealthy <= 150.0 + (threshold - 1) * sim.config.poll_interval_s
    assert all(not healthy for t, healthy in health if t >= first_unhealthy)
    # Requests placed on it before then were refused and placed again: none was lost to it.
    assert not [r for r in sim.records if r.replica == "replica-0000" and r.start_s >= 150.0]
    assert all(r.error != "no replica" for r in sim.records)
    assert result["decisions"].get("rehome", 0) > 0


def test_regenerating_the_simulation_doc_keeps_the_perturbed_worlds_section():
    from kvrouter.loadtest.scenarios import kept_sections

    doc = "# Fleet\n\nintro\n\n## Textbook\n\nold\n\n## Perturbed worlds\n\nby hand\n\n| a |\n\n## Performance\n\np\n"
    assert kept_sections(doc) == [("Perturbed worlds", "by hand\n\n| a |")]
    assert kept_sections("# Fleet\n\n## Textbook\n\nx\n") == []


def test_regenerating_the_simulation_doc_keeps_the_note_on_what_changed():
    from kvrouter.loadtest.scenarios import kept_sections

    doc = ("# Fleet\n\n## Textbook\n\nold\n\n## Perturbed worlds\n\nby hand\n\n"
           "## What changed in the simulator\n\nold -> new\n")
    assert kept_sections(doc) == [("Perturbed worlds", "by hand"), ("What changed in the simulator", "old -> new")]


def test_scenario_results_are_saved_as_json(tmp_path):
    import json

    from kvrouter.loadtest.scenarios import save_results

    path = tmp_path / "simulation" / "scenarios.json"
    save_results(path, {"scale_out": {"coding-agent": {"timeline": [(15.0, 0.9, 1.2)]}}, "performance": {512: {"wall_s": 1.0}}})
    assert json.loads(path.read_text()) == {"scale_out": {"coding-agent": {"timeline": [[15.0, 0.9, 1.2]]}},
                                            "performance": {"512": {"wall_s": 1.0}}}


def test_a_request_that_can_never_fit_fails_with_a_400_instead_of_stopping_the_simulation():
    """A world whose replicas hold less than the workload's longest context: those requests fail
    as a replica would answer them (400), counted by reason, and the run goes on."""
    sim = ClusterSimulator(SimConfig(replicas=2, sessions=4, duration_s=60.0, seed=1, warmup_s=0.0,
                                     world=parse_world("capacity=0.05")), "coding-agent", WL)
    result = sim.run()
    failed = [r for r in sim.records if not r.ok]
    assert failed and all(r.error.startswith("HTTP 400: ") for r in failed)
    assert result["requests_failed"] == len(failed)
    assert [f["status"] for f in result["failures"]] == [400]
    assert not sim._flights  # nothing left in flight
