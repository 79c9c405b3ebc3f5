"""The shortcuts the decision path takes give exactly what the plain definitions give: the cost
terms a view keeps (policies/cost.py), the written-out draws of a plain Random (candidate
sampling, near-tie picks), and the shadow metrics' series leaving with their replica."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvrouter.metrics.router_metrics import RouterMetrics
from kvrouter.policies.cost import CostParams, expected_cost, expected_costs, prefill_s, request_cost
from kvrouter.policies.domain import Decision, ReplicaView, RequestSummary, Snapshot
from kvrouter.policies.predict import DEFAULT_COST as PREDICT_DEFAULT, Prediction, predict
from kvrouter.policies.steps import ExpectedCost, HighWater, NearTiePowerOfTwo, _two_of


def plain_cost(p: CostParams, replica: ReplicaView, request: RequestSummary, home: str | None,
               placement: bool) -> float:
    """The cost model written out for one replica, term by term, as it read before any terms
    were kept with the view."""
    prompt = request.prompt_tokens
    cached = request.cached_tokens.get(replica.id, 0)
    on_host = request.host_cached_tokens.get(replica.id, 0)
    if cached or on_host:
        cached = min(cached, prompt)
        on_host = min(on_host, prompt - cached)
        uncached = prompt - cached - on_host
        cost = prefill_s(p, uncached, cached + on_host) + on_host * p.load_back_s_per_token
    else:
        cost = prefill_s(p, prompt, 0)
    load, queued = replica.load, replica.num_queue_reqs or 0
    waiting = max(load - p.max_running, queued)
    cost += waiting * p.queue_s_per_waiting + min(load, p.max_running) * p.decode_s_per_running
    usage = replica.token_usage or 0.0
    if usage > p.capacity_target:
        cost += p.queue_s_per_waiting * (usage - p.capacity_target) / (1.0 - p.capacity_target + 1e-9)
    if placement:
        capacity = replica.max_total_num_tokens or p.default_capacity_tokens
        new = replica.id != home
        demand = replica.homed_tokens + (prompt if new else 0)
        cost += p.kv_demand_s * demand / capacity
        cost += p.session_s * (replica.homed_sessions + new)
        overflow = int(demand - p.capacity_target * capacity)
        if overflow > 0:
            cost += p.capacity_weight * prefill_s(p, overflow, 0)
    return cost


def random_views(rng: random.Random, n: int) -> list[ReplicaView]:
    return [ReplicaView(f"r{i}", in_flight=rng.randrange(60),
                        num_running_reqs=rng.choice([None, rng.randrange(60)]),
                        num_queue_reqs=rng.choice([None, rng.randrange(5)]),
                        token_usage=rng.choice([None, rng.random()]),
                        max_total_num_tokens=rng.choice([None, 200_000]),
                        homed_sessions=rng.randrange(6), homed_tokens=rng.randrange(600_000))
            for i in range(n)]


def test_costs_from_kept_terms_are_the_plain_model_bit_for_bit() -> None:
    # Two cost models take turns on the same views: each must find its own terms, never the
    # other's; equal parameter sets (distinct objects) share them.
    rng = random.Random(3)
    models = [CostParams(), CostParams(queue_s_per_waiting=0.3, session_s=0.5, capacity_target=0.8),
              CostParams()]
    views = random_views(rng, 12)
    for _ in range(200):
        if rng.random() < 0.4:  # a new prompt nobody holds: the cold placement loop
            request = RequestSummary("/v1/chat/completions", prompt_tokens=rng.randrange(1, 200_000))
        else:
            request = RequestSummary("/v1/chat/completions", prompt_tokens=rng.randrange(1, 200_000),
                                     cached_tokens={f"r{i}": rng.randrange(250_000) for i in range(0, 12, 3)},
                                     host_cached_tokens={"r1": rng.randrange(250_000)})
        p = rng.choice(models)
        home = rng.choice(["r2", None, "gone"])
        for placement in (True, False):
            expected = [plain_cost(p, v, request, home, placement) for v in views]
            assert expected_costs(p, views, request, home=home, placement=placement) == expected
            assert [expected_cost(p, v, request, is_home=v.id == home, placement=placement)
                    for v in views] == expected
        # One request's cost alone (what a prediction asks): the per-request terms, no home.
        assert [request_cost(p, v, request) for v in views] == [
            plain_cost(p, v, request, None, False) for v in views]
        if rng.random() < 0.3:  # a replica changes: its new view starts without terms
            at = rng.randrange(len(views))
            views[at] = dataclasses.replace(views[at], in_flight=rng.randrange(60),
                                            homed_sessions=rng.randrange(6))
            assert views[at].cost_terms is None


def test_filtering_and_costing_in_one_pass_is_the_filter_then_the_costs() -> None:
    # A placement filters its candidates by the high-water marks and costs the rest; for a
    # prompt nobody holds both happen in one pass, which must keep and cost the same replicas.
    # The pass keeps each view's verdict against the marks with its cost terms: views are
    # reused across cost models and marks, so a verdict must never serve other marks.
    rng = random.Random(11)
    fleet = random_views(rng, 40)
    for p in (CostParams(), CostParams(session_s=0.5, capacity_target=0.8)):
        for placement in (True, False):
            score = ExpectedCost(p, placement=placement)
            for _ in range(100):
                marks = rng.choice((HighWater(40, 2, 0.92), HighWater(20, 0, 0.5), HighWater(40, 2, 0.92)))
                views = rng.sample(fleet, rng.randrange(0, 20)) if rng.random() < 0.7 else random_views(rng, 12)
                if rng.random() < 0.2:  # another cost model costs some of them in between
                    expected_costs(rng.choice((CostParams(), CostParams(session_s=0.5))), views[:5],
                                   RequestSummary("/x", prompt_tokens=1000))
                held = {f"r{i}": rng.randrange(1, 250_000) for i in range(0, len(views), 4)}
                request = RequestSummary("/x", prompt_tokens=rng.randrange(0, 300_000),
                                         cached_tokens=held if rng.random() < 0.3 else {})
                usable = marks(views)
                expected = [plain_cost(p, v, request, None, placement) for v in usable]
                assert score.under(views, request, marks) == (usable, expected)


def test_kept_terms_are_not_part_of_the_view() -> None:
    view = ReplicaView("a", num_running_reqs=3)
    twin = ReplicaView("a", num_running_reqs=3)
    expected_costs(CostParams(), [view], RequestSummary("/x", prompt_tokens=10))
    assert view.cost_terms is not None and twin.cost_terms is None
    assert view == twin and hash(view) == hash(twin) and "cost_terms" not in repr(view)


class CountingRandom(random.Random):
    """A Random subclass: the shortcuts must leave it to its own methods."""


@pytest.mark.parametrize("rng_type", [random.Random, CountingRandom])
def test_written_out_draws_are_the_random_module_draws(rng_type) -> None:
    for n in [*range(2, 30), 64, 65, 100, 1000]:
        population = [ReplicaView(f"r{i}") for i in range(n)]
        for seed in range(40):
            ours, theirs = rng_type(seed), random.Random(seed)
            for _ in range(4):
                assert _two_of(population, ours) == tuple(theirs.sample(population, 2))
            assert ours.random() == theirs.random()  # the streams stay in step


@pytest.mark.timeout(10)
@pytest.mark.parametrize("rng_type", [random.Random, CountingRandom])
def test_fewer_than_two_ties_raise_as_sample_does(rng_type) -> None:
    # NaN scores (a NaN cost) leave no replica within the near-tie limit: `rng.sample` raises,
    # and the written-out draws must too, never draw forever on the event loop.
    views = [ReplicaView("a"), ReplicaView("b")]
    with pytest.raises(ValueError):
        _two_of([], rng_type(0))
    with pytest.raises(ValueError):
        NearTiePowerOfTwo(0.05, 0.0)(views, [float("nan"), 1.0], rng_type(0))


@pytest.mark.parametrize("rng_type", [random.Random, CountingRandom])
def test_fleet_sample_draws_what_choice_draws(rng_type) -> None:
    rng = random.Random(9)
    views = tuple(ReplicaView(f"r{i}", healthy=rng.random() < 0.9) for i in range(150))
    snapshot = Snapshot(views)
    for seed in range(50):
        request = RequestSummary("/x", exclude=frozenset(rng.sample([v.id for v in views], 3)))
        ours, theirs = rng_type(seed), random.Random(seed)
        chosen: dict[str, ReplicaView] = {}
        for _ in range(4 * 16):  # the plain definition: choice() until 16 usable ones
            if len(chosen) >= 16:
                break
            view = theirs.choice(views)
            if view.healthy and view.id not in request.exclude:
                chosen.setdefault(view.id, view)
        assert snapshot.sample(request, 16, ours) == list(chosen.values())
        assert ours.random() == theirs.random()


@pytest.mark.parametrize("rng_type", [random.Random, CountingRandom])
@pytest.mark.parametrize("n", [65, 100, 150, 1000])
def test_sampling_an_all_healthy_fleet_draws_what_choice_draws(rng_type, n: int) -> None:
    # The registry's snapshot counts its healthy replicas: with all of them healthy and nothing
    # excluded, the sample skips only repeats (by index), and must draw the same replicas.
    views = tuple(ReplicaView(f"r{i}") for i in range(n))
    snapshot = Snapshot(views, healthy_count=n, healthy_load=0)
    for seed in range(50):
        k = 2 + seed % 20
        ours, theirs = rng_type(seed), random.Random(seed)
        chosen: dict[str, ReplicaView] = {}
        for _ in range(4 * k):
            if len(chosen) >= k:
                break
            view = theirs.choice(views)
            chosen.setdefault(view.id, view)
        expected = list(chosen.values()) if n > 4 * k else list(views)
        assert snapshot.sample(RequestSummary("/x"), k, ours) == expected
        if n > 4 * k:
            assert ours.random() == theirs.random()


def test_a_leaving_replica_takes_its_shadow_pick_series_with_it() -> None:
    m = RouterMetrics()
    m.count(m.shadow_picks, ("http://a", "least-load"))
    m.count(m.shadow_picks, ("http://b", "least-load"))
    m.count(m.shadow_decisions, ("least-load", "true"))
    m.forget_replica("http://a")
    sample = m.registry.get_sample_value
    assert sample("kvrouter_shadow_picks_total", {"replica": "http://a", "shadow": "least-load"}) is None
    assert sample("kvrouter_shadow_picks_total", {"replica": "http://b", "shadow": "least-load"}) == 1.0
    assert sample("kvrouter_shadow_decisions_total", {"shadow": "least-load", "agrees": "true"}) == 1.0


def test_decisions_and_predictions_set_through_their_slots_are_ordinary_frozen_dataclasses() -> None:
    # Both are made with a hand-written __init__ (the slots' own setters): the same values,
    # defaults, keywords, equality, hashing, replace() and the frozen guard as generated.
    decision = Decision("http://a", "new_session")
    assert (decision.replica, decision.reason, decision.home) == ("http://a", "new_session", None)
    assert decision == Decision(replica="http://a", reason="new_session", home=None)
    assert hash(decision) == hash(Decision("http://a", "new_session"))
    assert dataclasses.replace(decision, home="http://a") == Decision("http://a", "new_session", "http://a")
    assert Decision("http://a", "x") != Decision("http://b", "x")
    prediction = Prediction("http://a", 3, None)
    assert prediction == Prediction(replica="http://a", cached_tokens=3, ttft_s=None)
    assert dataclasses.astuple(prediction) == ("http://a", 3, None)
    for value in (decision, prediction):
        with pytest.raises(dataclasses.FrozenInstanceError):
            value.replica = "http://b"  # type: ignore[misc]
    with pytest.raises(TypeError):
        Decision("http://a")  # type: ignore[call-arg]


def test_decisions_and_predictions_pickle_copy_and_convert_as_generated_ones_do() -> None:
    # The decision log and the simulator may pickle, copy or convert them: the hand-written
    # __init__ must leave those as the generated one did.
    import copy
    import pickle

    decision = Decision("http://a", "rehome_evicted", home="http://a")
    prediction = Prediction("http://a", 7, 0.25)
    for value in (decision, prediction):
        assert pickle.loads(pickle.dumps(value)) == value
        assert copy.copy(value) == value and copy.deepcopy(value) == value
    assert dataclasses.asdict(decision) == {"replica": "http://a", "reason": "rehome_evicted", "home": "http://a"}
    assert repr(decision) == "Decision(replica='http://a', reason='rehome_evicted', home='http://a')"
    assert repr(prediction) == "Prediction(replica='http://a', cached_tokens=7, ttft_s=0.25)"


def test_a_prediction_is_the_pick_s_request_cost_and_its_match() -> None:
    # `predict` makes its Prediction without the __init__ call and finds the cost model without
    # `_model`'s: the same object as the plain definition, for the default parameters and others,
    # a view whose terms another model keeps, a replica the snapshot lacks and a held prefix.
    views = (ReplicaView("http://a", num_running_reqs=3, num_queue_reqs=1, token_usage=0.95),
             ReplicaView("http://b", in_flight=2, pending_prefill_tokens=5000))
    snapshot = Snapshot(views, by_id={v.id: v for v in views})
    held = RequestSummary("/v1/chat/completions", prompt_tokens=9000, cached_tokens={"http://b": 12_000},
                          host_cached_tokens={"http://a": 700})
    cold = RequestSummary("/v1/chat/completions", prompt_tokens=9000)
    other = CostParams(queue_s_per_waiting=0.7)
    for params in (PREDICT_DEFAULT, other, PREDICT_DEFAULT):  # the terms kept switch models
        for request in (held, cold):
            for view in views:
                found = predict(snapshot, request, view.id, params)
                cached = min(request.prompt_tokens, request.cached_tokens.get(view.id, 0))
                fresh = dataclasses.replace(view)  # the same view, no terms kept
                assert found == Prediction(view.id, cached, request_cost(params, fresh, request))
                assert type(found) is Prediction and dataclasses.astuple(found) == (view.id, cached, found.ttft_s)
                with pytest.raises(dataclasses.FrozenInstanceError):
                    found.ttft_s = 0.0  # type: ignore[misc]
            assert predict(snapshot, request, "http://gone", params) == Prediction("http://gone", 0, None)
    hand_built = Snapshot(views)  # no id index: the snapshot's own lookup
    assert predict(hand_built, held, "http://b") == predict(snapshot, held, "http://b")


def test_the_near_tie_pick_is_its_plain_definition() -> None:
    # The pick's tie loop and load comparison, written out, against the definition: ties in
    # candidate order, two drawn as `rng.sample` draws them, the lower (load, homed KV) wins.
    def plain(tolerance: float, abs_s: float, candidates, scores, rng):
        limit = min(scores) * (1 + tolerance) + abs_s
        ties = [r for c, r in zip(scores, candidates) if c <= limit]
        if len(ties) == 1:
            return ties[0]
        a, b = rng.sample(ties, 2)
        return a if (a.load, a.homed_tokens) <= (b.load, b.homed_tokens) else b

    cases = random.Random(11)
    for _ in range(400):
        views = [ReplicaView(f"r{i}", in_flight=cases.randrange(0, 4), homed_tokens=cases.choice([0, 5, 9]))
                 for i in range(cases.randrange(1, 24))]
        scores = [6.6 + cases.choice([0.0, 0.01, 0.011, 0.02, 0.5, float("nan")]) for _ in views]
        tolerance, abs_s = cases.choice([(0.01, 0.02), (0.0, 0.0), (0.1, 0.5)])
        seed = cases.randrange(1 << 30)
        fast_rng, plain_rng = random.Random(seed), random.Random(seed)
        try:
            fast = NearTiePowerOfTwo(tolerance, abs_s)(views, scores, fast_rng)
        except ValueError:
            with pytest.raises(ValueError):
                plain(tolerance, abs_s, views, scores, plain_rng)
            continue
        assert fast is plain(tolerance, abs_s, views, scores, plain_rng)
        assert fast_rng.random() == plain_rng.random()  # the same draws


def test_decision_notes_behave_as_a_generated_frozen_dataclass() -> None:
    # Made through its slots' setters (one per decision noted): defaults, equality, replace,
    # pickling and the frozen guard as the generated __init__ gave them.
    import pickle

    from kvrouter.router.placement import DecisionNotes

    chosen = Prediction("http://a", 7, 0.25)
    notes = DecisionNotes("coding_agent", chosen)
    assert (notes.shadows, notes.candidates) == ((), 0)
    full = DecisionNotes("coding_agent", chosen, (("consistent-hash", None, None),), 3)
    assert dataclasses.replace(notes, shadows=(("consistent-hash", None, None),), candidates=3) == full
    assert pickle.loads(pickle.dumps(full)) == full and hash(full) == hash(pickle.loads(pickle.dumps(full)))
    assert [f.default for f in dataclasses.fields(DecisionNotes)][2:] == [(), 0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        notes.candidates = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        DecisionNotes("coding_agent")  # type: ignore[call-arg]
