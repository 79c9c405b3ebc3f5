import random
import time

import pytest

from kvrouter.loadtest import timing
from kvrouter.loadtest.profiles import list_profiles, load_profile
from kvrouter.loadtest.radix_cache import DEVICE, page_keys
from kvrouter.loadtest.replica_model import Finished, FirstToken, ReplicaModel, SimRequest

TINY = load_profile("tiny")
PS = TINY.page_size


def tokens(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(1 << 17) for _ in range(n)]


_SAME = object()


def request(rid, prompt, out, ns="m", seed=None, max_new=_SAME):
    """prompt + deterministic output tokens, keyed as a driver would. Like the load driver, the
    request asks for max_new_tokens = out unless told otherwise (None: asks for none)."""
    full = list(prompt) + tokens(seed if seed is not None else hash(rid) & 0xFFFF, out)
    max_new = out if max_new is _SAME else max_new
    return SimRequest(rid, len(prompt), out, page_keys(full, PS, ns), full, max_new), full


def drain(model, until=None):
    events = []
    while (t := model.next_event_time()) is not None and (until is None or t <= until):
        events += model.advance(t)
    if until is not None:
        events += model.advance(until)
    return events


def by_rid(events, kind):
    return {e.rid: e for e in events if isinstance(e, kind)}


def free_pages(model):
    return model._free_pages()


# ---- caching across turns ------------------------------------------------------------------------
def test_turn_two_hits_turn_one_prompt_and_output_in_whole_pages():
    model = ReplicaModel(TINY)
    prompt1 = tokens(1, 1000)
    r1, full1 = request("t1", prompt1, 77)
    model.submit(r1, 0.0)
    ev = drain(model)
    assert by_rid(ev, FirstToken)["t1"].cached_tokens == 0  # fresh model
    prompt2 = full1 + tokens(2, 300)
    r2, _ = request("t2", prompt2, 50)
    model.submit(r2, ev[-1].time + 1.0)
    ev2 = drain(model)
    expected = (1000 + 77 - 1) // PS * PS  # the last sampled token has no KV yet
    assert expected == (1000 + 77) // PS * PS  # (sizes chosen so both readings agree)
    assert by_rid(ev2, FirstToken)["t2"].cached_tokens == expected
    assert by_rid(ev2, Finished)["t2"].cached_tokens == expected
    assert model.cached_tokens_device_total == expected and model.cached_tokens_host_total == 0


def test_match_is_capped_at_prompt_minus_one():
    model = ReplicaModel(TINY)
    prompt = tokens(3, 64)  # exactly 4 pages
    r, _ = request("a", prompt, 5)
    model.submit(r, 0.0)
    t = drain(model)[-1].time
    same, _ = request("b", prompt, 5, seed=9)
    model.submit(same, t)
    assert by_rid(drain(model), FirstToken)["b"].cached_tokens == 48  # (64 - 1) // 16 pages


def test_namespaces_never_share():
    model = ReplicaModel(TINY)
    prompt = tokens(4, 500)
    model.submit(request("a", prompt, 10, ns="model|salt=a")[0], 0.0)
    t = drain(model)[-1].time
    model.submit(request("b", prompt, 10, ns="model|salt=b")[0], t)
    model.submit(request("c", prompt, 10, ns="model|salt=a")[0], t)
    first = by_rid(drain(model), FirstToken)
    assert first["b"].cached_tokens == 0
    assert first["c"].cached_tokens == 496


# ---- eviction ------------------------------------------------------------------------------------
def test_filling_past_capacity_evicts_lru_unlocked_prefixes_only():
    model = ReplicaModel(TINY)  # 20,480 tokens
    t = 0.0
    keys = {}
    for i, rid in enumerate("abc"):
        r, _ = request(rid, tokens(10 + i, 6000), 16)
        keys[rid] = r.page_keys
        model.submit(r, t)
        t = drain(model)[-1].time + 1.0
    assert model.evicted_tokens_total == 0
    # a long-running request holds its pages while others push the cache past capacity
    runner, _ = request("run", tokens(20, 2000), 400)
    model.submit(runner, t)
    drain(model, until=t + 0.05)
    assert model.load(t).num_running_reqs == 1
    model.submit(request("d", tokens(21, 6000), 16)[0], t + 0.05)
    model.submit(request("e", tokens(22, 6000), 16)[0], t + 0.05)
    events = drain(model)
    assert model.evicted_tokens_total > 0
    # a (oldest) went first, c (newest idle) survived longer than a and b
    assert keys["a"][-2] not in model.cache
    assert keys["c"][0] in model.cache
    fin = by_rid(events, Finished)
    assert fin["run"].completion_tokens == 400
    # the runner's whole prompt was never evicted while it ran: turn 2 hits it in full
    assert all(k in model.cache for k in runner.page_keys[: 2000 // PS])


def test_running_requests_pages_survive_eviction_pressure():
    model = ReplicaModel(TINY)
    runner, _ = request("run", tokens(30, 4000), 600)
    model.submit(runner, 0.0)
    drain(model, until=0.2)
    held = runner.page_keys[: 4000 // PS]
    t = 0.2
    for i in range(8):  # 8 x 5,000 tokens through a 20k cache
        model.submit(request(f"x{i}", tokens(40 + i, 5000), 8)[0], t)
        t += 0.1
        drain(model, until=t)
        if "run" in model._reqs:
            assert all(k in model.cache for k in held)
    assert model.evicted_tokens_total > 0
    drain(model)


# ---- gauges --------------------------------------------------------------------------------------
def test_token_usage_ignores_idle_cached_prefixes():
    model = ReplicaModel(TINY)
    model.submit(request("a", tokens(50, 3000), 20)[0], 0.0)
    t = drain(model)[-1].time
    idle = model.load(t)
    assert idle.kv_evictable_tokens == (3000 + 20 - 1) // PS * PS
    assert idle.num_used_tokens == 0 and idle.token_usage == 0.0
    model.submit(request("b", tokens(51, 2000), 300)[0], t)
    drain(model, until=t + 0.1)
    busy = model.load(t + 0.1)
    used = busy.max_total_num_tokens - busy.kv_available_tokens - busy.kv_evictable_tokens
    assert busy.num_used_tokens == used > 0
    assert busy.token_usage == pytest.approx(used / busy.max_total_num_tokens)
    assert used == model.cache.locked_tokens + model._own_pages * PS
    assert busy.num_running_reqs == 1 and busy.gen_throughput > 0


# ---- timing --------------------------------------------------------------------------------------
def test_lone_cold_prefill_matches_chunked_timing():
    model = ReplicaModel(TINY)
    model.submit(request("a", tokens(60, 5000), 3)[0], 0.0)  # 5 chunks of 1,024
    ttft = by_rid(drain(model), FirstToken)["a"].ttft
    assert ttft == pytest.approx(timing.chunked_prefill_time(TINY, 5000, 0))


def test_ttft_grows_with_uncached_tokens():
    ttfts = []
    for n_new in (100, 1000, 4000):
        model = ReplicaModel(TINY)
        base, _ = request("warm", tokens(70, 4000), 16)
        model.submit(base, 0.0)
        t = drain(model)[-1].time
        model.submit(request("q", tokens(70, 4000) + tokens(71, n_new), 16)[0], t)
        ttfts.append(by_rid(drain(model), FirstToken)["q"].ttft)
    assert ttfts[0] < ttfts[1] < ttfts[2]


def test_ttft_grows_with_queue_length():
    model = ReplicaModel(TINY)
    for i in range(6):
        model.submit(request(f"q{i}", tokens(80 + i, 1500), 20)[0], 0.0)
    first = by_rid(drain(model), FirstToken)
    ttft = [first[f"q{i}"].ttft for i in range(6)]
    assert ttft == sorted(ttft) and ttft[-1] > 3 * ttft[0]
    assert first["q5"].queue_time > first["q0"].queue_time


def test_decode_speed_per_request_falls_as_batch_grows():
    rates = {}
    for batch in (1, 4, 8):
        model = ReplicaModel(TINY)
        for i in range(batch):
            model.submit(request(f"r{i}", tokens(90 + i, 100), 301)[0], 0.0)
        events = drain(model)
        first, fin = by_rid(events, FirstToken), by_rid(events, Finished)
        rates[batch] = 300 / (fin["r0"].time - first[f"r{batch - 1}"].time)
    assert rates[1] > rates[4] > rates[8]
    assert timing.decode_tokens_per_s_per_user(TINY, 1, 100) == pytest.approx(rates[1], rel=0.05)


def test_progress_streams_whole_steps_up_to_output_len():
    model = ReplicaModel(TINY)
    model.submit(request("a", tokens(95, 200), 101)[0], 0.0)
    seen, t = [], 0.0
    while model.next_event_time() is not None:
        t += 0.003
        model.advance(t)
        seen.append(model.progress("a", t))
    assert seen == sorted(seen) and seen[-1] == 101
    assert seen[0] == 0 and 1 in seen  # the prefill's token before any decode step
    assert all(b - a <= 3 for a, b in zip(seen, seen[1:]) if a)  # accept 2.5: 2 or 3 per step


# ---- HiCache -------------------------------------------------------------------------------------
def test_host_hits_are_counted_as_host_and_cheaper_than_recompute():
    hicache = TINY.model_copy(update={"host_total_num_tokens": 40960})
    ttft = {}
    for profile in (TINY, hicache):
        model = ReplicaModel(profile)
        s1, full = request("s1", tokens(100, 6000), 40)
        model.submit(s1, 0.0)
        t = drain(model)[-1].time
        for i in range(6):  # push s1 out of the device
            model.submit(request(f"f{i}", tokens(110 + i, 5000), 8)[0], t)
            t = drain(model)[-1].time
        assert model.cache.tier_of(s1.page_keys[0]) != DEVICE
        model.submit(request("s2", full + tokens(101, 200), 20)[0], t)
        first = by_rid(drain(model), FirstToken)["s2"]
        model.cache.check_invariants()
        ttft[profile is hicache] = first.ttft
        if profile is hicache:
            assert first.cached_host > 0 and first.cached_tokens == first.cached_device + first.cached_host
            assert model.cached_tokens_host_total == first.cached_host
            assert model.load_back_tokens_total == first.cached_host
            assert model.load(t).host_total_tokens == 40960
        else:
            assert first.cached_host == 0
    assert ttft[True] < ttft[False] / 3


# ---- abort / flush -------------------------------------------------------------------------------
def test_abort_frees_the_slot_and_unlocks_pages():
    model = ReplicaModel(TINY)  # 8 slots
    for i in range(9):
        model.submit(request(f"r{i}", tokens(120 + i, 300), 2000)[0], 0.0)
    drain(model, until=0.5)
    load = model.load(0.5)
    assert (load.num_running_reqs, load.num_queue_reqs) == (8, 1)
    assert model.abort("r0", 0.5)
    assert not model.abort("r0", 0.5)
    events = drain(model, until=1.0)
    assert "r8" in by_rid(events, FirstToken)
    assert "r0" not in by_rid(drain(model, until=1.0), Finished)
    for i in range(1, 9):
        model.abort(f"r{i}", 1.0)
    assert model.cache.locked_tokens == 0 and model._own_pages == 0
    assert model.load(1.0).num_running_reqs == 0
    assert drain(model) == [] and model.next_event_time() is None  # the step in flight ends
    assert model.num_aborted_requests_total == 9
    assert model.cache.match(request("x", tokens(121, 300), 1)[0].page_keys, 18, 1.0)[0] == 18


def test_abort_while_prefilling_and_waiting():
    model = ReplicaModel(TINY)
    model.submit(request("long", tokens(130, 8000), 10)[0], 0.0)
    model.submit(request("wait", tokens(131, 100), 10)[0], 0.0)
    drain(model, until=0.01)
    assert model.abort("wait", 0.01) and model.abort("long", 0.01)
    assert drain(model) == []
    assert model.cache.locked_tokens == 0 and model._own_pages == 0
    assert model.flush_cache() and len(model.cache) == 0


def test_flush_cache_refused_while_running():
    model = ReplicaModel(TINY)
    model.submit(request("a", tokens(140, 500), 50)[0], 0.0)
    assert not model.flush_cache()
    drain(model)
    assert len(model.cache) > 0 and model.flush_cache() and len(model.cache) == 0


# ---- analytic decode vs a step-by-step reference ----------------------------------------------
def reference_finish_times(profile, prompts, outputs):
    """All requests admitted in one prefill batch at t=0, then decoded one step at a time."""
    t = profile.t_prefill_overhead + sum(
        timing.prefill_compute_time(profile, n, 0) for n in prompts
    )
    gen = [1] * len(prompts)
    steps = [0] * len(prompts)
    done = {}
    live = [i for i in range(len(prompts)) if outputs[i] > 1]
    for i in range(len(prompts)):
        if outputs[i] == 1:
            done[i] = t
    while live:
        ctx = sum(prompts[i] + gen[i] for i in live) / len(live)
        t += timing.decode_step_time(profile, len(live), ctx)
        for i in live:
            steps[i] += 1
            gen[i] = min(outputs[i], timing.tokens_after_steps(profile, 1, steps[i]))
            if gen[i] >= outputs[i]:
                done[i] = t
        live = [i for i in live if i not in done]
    return done


@pytest.mark.parametrize("name", ["tiny", "kimi-k2.6-b200-tp4"])
def test_analytic_segments_match_step_by_step_reference(name):
    profile = load_profile(name)
    prompts = [120, 300, 90, 250, 200]  # one prefill batch (<= 1,024 tokens on tiny)
    outputs = [1, 37, 180, 400, 611]
    model = ReplicaModel(profile)
    for i, (n, out) in enumerate(zip(prompts, outputs)):
        full = tokens(200 + i, n + out)
        keys = page_keys(full, profile.page_size, "m")
        model.submit(SimRequest(f"r{i}", n, out, keys, max_new_tokens=out), 0.0)
    fin = by_rid(drain(model), Finished)
    ref = reference_finish_times(profile, prompts, outputs)
    for i in range(len(prompts)):
        step = timing.decode_step_time(profile, 1, prompts[i] + outputs[i])
        assert fin[f"r{i}"].time == pytest.approx(ref[i], abs=step), i
        assert fin[f"r{i}"].completion_tokens == outputs[i]


def test_submit_cuts_a_decode_segment_at_the_next_step_boundary():
    model = ReplicaModel(TINY)
    model.submit(request("a", tokens(300, 200), 500)[0], 0.0)
    model.advance(0.0)  # the idle replica starts the prefill
    t_first = by_rid(model.advance(model.next_event_time()), FirstToken)["a"].time
    dt = timing.decode_step_time(TINY, 1, 200 + 1)
    arrive = t_first + 3.5 * dt
    model.submit(request("b", tokens(301, 50), 5)[0], arrive)
    first_b = by_rid(drain(model, until=arrive + 1.0), FirstToken)["b"]
    boundary = t_first + 4 * dt
    assert first_b.queue_time == pytest.approx(boundary - arrive, abs=1e-9)
    assert first_b.time == pytest.approx(
        boundary + TINY.t_prefill_overhead + timing.prefill_compute_time(TINY, 50, 0), abs=1e-9
    )


# ---- memory pressure ---------------------------------------------------------------------------
def test_kv_growth_under_pressure_retracts_but_everything_finishes():
    small = TINY.model_copy(update={"max_total_num_tokens": 4096})
    model = ReplicaModel(small)
    outs = {}
    for i in range(6):
        outs[f"r{i}"] = 600 + 37 * i
        model.submit(request(f"r{i}", tokens(400 + i, 500), outs[f"r{i}"])[0], 0.0)
    events = []
    while (t := model.next_event_time()) is not None:
        events += model.advance(t)
        assert free_pages(model) >= 0
        model.cache.check_invariants()
    fin = by_rid(events, Finished)
    assert {rid: e.completion_tokens for rid, e in fin.items()} == outs
    assert len(by_rid(events, FirstToken)) == 6  # one first token each, even if retracted
    assert model.cache.locked_tokens == 0 and model._own_pages == 0


# ---- admission and retraction as SGLang's scheduler does them ------------------------------------
def test_admission_reserves_the_max_new_tokens_estimate_not_the_true_output():
    # A decodes a short answer but asked for no max_new_tokens: the scheduler must assume up to
    # clip_max_new_tokens (x new_token_ratio) for it, and B's own clip, so B waits for A.
    model = ReplicaModel(TINY)  # 20,480 KV tokens
    model.submit(request("a", tokens(500, 1000), 300, max_new=None)[0], 0.0)
    assert "a" in by_rid(drain(model, until=0.2), FirstToken)  # a is decoding
    t = 0.2
    model.submit(request("b", tokens(501, 14_000), 10, max_new=None)[0], t)
    events = drain(model, until=t + 0.05)
    assert model.load(t + 0.05).num_queue_reqs == 1  # the true outputs (300 + 10) would fit
    events += drain(model)
    first_b, fin_a = by_rid(events, FirstToken)["b"], by_rid(events, Finished)["a"]
    assert first_b.time > fin_a.time and first_b.queue_time > 0


def test_a_max_new_tokens_near_the_true_output_admits_at_once():
    model = ReplicaModel(TINY)
    model.submit(request("a", tokens(500, 1000), 300)[0], 0.0)
    assert "a" in by_rid(drain(model, until=0.2), FirstToken)  # a is decoding
    t = 0.2
    model.submit(request("b", tokens(501, 14_000), 10)[0], t)
    drain(model, until=t + 0.05)
    assert model.load(t + 0.05).num_queue_reqs == 0


def test_requests_without_max_new_tokens_reserve_up_to_the_context():
    model = ReplicaModel(TINY)
    # prompt + clip_max_new_tokens (4,096) + a page cannot fit 20,480: never admissible
    with pytest.raises(ValueError):
        model.submit(request("long", tokens(502, 16_500), 10, max_new=None)[0], 0.0)
    model.submit(request("ok", tokens(502, 16_500), 10, max_new=100)[0], 0.0)
    # a short context bounds the estimate below the clip: min(ctx-1, pool-1) - prompt - 1
    short = ReplicaModel(TINY.model_copy(update={"context_len": 17_000}))
    short.submit(request("fits", tokens(503, 16_500), 10, max_new=None)[0], 0.0)
    assert by_rid(drain(short), Finished)["fits"].completion_tokens == 10


def pressure_run(n=8, prompt=200):
    """n requests on a 4,096-token pool: the decaying ratio over-admits, decode runs out of KV."""
    model = ReplicaModel(TINY.model_copy(update={"max_total_num_tokens": 4096}))
    outs = {}
    for i in range(n):
        outs[f"r{i}"] = 900 + 37 * i
        model.submit(request(f"r{i}", tokens(400 + i, prompt), outs[f"r{i}"])[0], 0.0)
    events, ratios = [], []
    while (t := model.next_event_time()) is not None:
        events += model.advance(t)
        ratios.append((model.num_retracted_reqs_total, model.new_token_ratio))
        assert free_pages(model) >= 0
        model.cache.check_invariants()
    return model, outs, events, ratios


def test_decode_pressure_retracts_and_every_request_still_finishes_in_full():
    model, outs, events, _ = pressure_run()
    assert model.num_retracted_reqs_total >= 1
    fin = by_rid(events, Finished)
    assert {rid: e.completion_tokens for rid, e in fin.items()} == outs  # nothing lost
    assert sum(e.retractions for e in fin.values()) == model.num_retracted_reqs_total
    assert len(by_rid(events, FirstToken)) == len(outs)  # one first token each
    # the retracted one went to the back of the queue: it finishes last but one or later
    retracted = [rid for rid, e in fin.items() if e.retractions]
    order = [e.rid for e in events if isinstance(e, Finished)]
    assert all(order.index(rid) >= len(order) - 1 - len(retracted) for rid in retracted)
    assert model.num_retracted_output_tokens_total > 0
    assert model.cache.locked_tokens == 0 and model._own_pages == 0


def test_a_retracted_request_goes_to_the_back_with_its_prompt_still_cached():
    model = ReplicaModel(TINY.model_copy(update={"max_total_num_tokens": 4096}))
    for i in range(8):
        model.submit(request(f"r{i}", tokens(400 + i, 200), 900 + 37 * i)[0], 0.0)
    while not model.num_retracted_reqs_total:
        model.advance(model.next_event_time())
    (back,) = [r for r in model._waiting if r.retractions]
    assert back is model._waiting[-1]  # queued behind the requests that never ran
    prompt_pages = back.sim.page_keys[: 200 // PS]
    assert all(k in model.cache for k in prompt_pages)  # unlocked, not freed
    assert model.cache.evictable_tokens >= len(prompt_pages) * PS
    # (here the queued prefills evict it, LRU, before it is admitted again: SGLang would too)


def test_new_token_ratio_rises_on_retraction_decays_and_resets_when_idle():
    model, _, _, ratios = pressure_run()
    p = model.profile
    floor = p.new_token_ratio * p.min_new_token_ratio_factor
    first = next(i for i, (n, _) in enumerate(ratios) if n)
    before, after = ratios[first - 1][1], ratios[first][1]
    assert before < p.new_token_ratio  # decayed while decoding without trouble
    assert after > before  # the retraction re-estimated it upwards
    later = [r for n, r in ratios[first + 1 :]]
    assert min(later[:-1]) == pytest.approx(floor)  # decays back down to the floor
    assert model.new_token_ratio == p.new_token_ratio  # fully idle: reset to init


def test_requests_that_can_never_fit_are_rejected():
    model = ReplicaModel(TINY)
    with pytest.raises(ValueError):
        model.submit(SimRequest("huge", 20_000, 1000, []), 0.0)


# ---- kv events -----------------------------------------------------------------------------------
def test_kv_sink_sees_stored_and_removed_pages():
    class Sink:
        def __init__(self):
            self.stored_keys, self.removed_keys, self.media = set(), set(), set()

        def stored(self, pages, medium):
            self.media.add(medium)
            self.stored_keys.update(k for k, _, _ in pages)

        def removed(self, keys, medium):
            self.removed_keys.update(keys)

        def cleared(self):
            self.stored_keys.clear()

    sink = Sink()
    model = ReplicaModel(TINY, kv_sink=sink)
    t = 0.0
    for i in range(5):
        model.submit(request(f"r{i}", tokens(500 + i, 6000), 10)[0], t)
        t = drain(model)[-1].time
    assert sink.media == {"GPU"}
    assert sink.removed_keys and sink.removed_keys <= sink.stored_keys
    live = sink.stored_keys - sink.removed_keys
    assert len(live) == len(model.cache)


# ---- profiles ------------------------------------------------------------------------------------
def test_every_profile_loads_and_kimi_is_calibrated():
    for name in list_profiles():
        assert load_profile(name).name == name
    p = load_profile()
    cold = timing.chunked_prefill_time(p, 100_000, 0)
    warm = timing.chunked_prefill_time(p, 2_000, 98_000)
    assert 2.0 < cold < 8.0 and 0.1 <= warm <= 0.2
    # batch-1 decode with DFlash at 100k context: between the old 186 tok/s and TRT-LLM's MTP
    # record scaled by accept length (docs/profiles.md); 405 from the derivation
    assert 300 <= timing.decode_tokens_per_s_per_user(p, 1, 100_000) <= 600
    assert load_profile("kimi-k2.6-b200-tp4-hicache").host_total_num_tokens == 2 * p.max_total_num_tokens


# ---- micro-benchmark (reports, never asserts timings) --------------------------------------------
def test_benchmark_many_sessions_reports_events_per_second():
    model = ReplicaModel(TINY)
    rng = random.Random(0)
    sessions = {s: tokens(1000 + s, 800) for s in range(12)}
    t, n_req, n_events = 0.0, 0, 0
    t0 = time.perf_counter()
    for turn in range(20):
        for s, hist in sessions.items():
            out = rng.randint(20, 200)
            req, full = request(f"s{s}t{turn}", hist, out)
            model.submit(req, t)
            sessions[s] = full + tokens(rng.random(), 100)
            n_req += 1
            t += 0.01
            n_events += len(model.advance(t))
        while model.next_event_time() is not None:
            n_events += len(model.advance(model.next_event_time()))
    wall = time.perf_counter() - t0
    assert n_events == 2 * n_req
    print(f"\n{n_req} requests, {n_events} events in {wall * 1e3:.0f} ms wall ({t:.1f} s model time)")


def test_random_churn_keeps_the_books_balanced():
    """Sessions, aborts and HiCache under pressure: every request ends exactly once, no leaks."""
    # host pool twice the device pool, as --hicache-ratio 2 (write_through mirrors device pages)
    profile = TINY.model_copy(update={"max_total_num_tokens": 6144, "host_total_num_tokens": 12288})
    model = ReplicaModel(profile)
    rng = random.Random(5)
    history = {s: tokens(600 + s, rng.randint(100, 1500)) for s in range(10)}
    t, submitted, aborted, events = 0.0, 0, set(), []
    for i in range(150):
        t += rng.expovariate(20.0)
        events += model.advance(t)
        s = rng.randrange(10)
        max_new = rng.choice([None, 300, 1000])  # with and without a max_new_tokens
        if max_new is None and len(history[s]) + 4096 + PS >= 6144:
            max_new = 1000  # (without one, the clip alone would never fit this pool)
        req, full = request(f"q{i}", history[s], rng.randint(1, 300), max_new=max_new)
        model.submit(req, t)
        submitted += 1
        history[s] = (full + tokens(rng.random(), rng.randint(10, 300)))[-2500:]
        if rng.random() < 0.15:
            victim = f"q{rng.randrange(i + 1)}"
            if model.abort(victim, t):
                aborted.add(victim)
        model.cache.check_invariants()
        assert free_pages(model) >= 0
        # the running estimate the admission check reads stays equal to its definition
        assert model._est_sum == sum(model._estimate(r) for r in model._decoding)
    events += drain(model)
    finished = by_rid(events, Finished)
    assert len(finished) + len(aborted) == submitted and not set(finished) & aborted
    assert model.cache.locked_tokens == 0 and model._own_pages == 0
    assert model.num_requests_total == len(finished)
    assert model.cached_tokens_host_total > 0 and model.evicted_tokens_total > 0
    assert model._est_sum == 0


def test_requests_counts_running_and_queued_as_load_does():
    model = ReplicaModel(TINY)  # 8 slots
    for i in range(12):
        model.submit(request(f"r{i}", tokens(i, 300), 40 + 10 * i)[0], 0.0)
    seen = set()
    while model.next_event_time() is not None:
        t = model.next_event_time()
        model.advance(t)
        load = model.load(t)
        assert model.requests() == load.num_running_reqs + load.num_queue_reqs
        seen.add((load.num_running_reqs > 0, load.num_queue_reqs > 0))
    assert (True, True) in seen and model.requests() == 0
