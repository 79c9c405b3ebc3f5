"""KV room on DP-attention replicas: a request runs on one rank, within that rank's KV pool.

From a `/v1/loads` body through the parser, the replica registry's view and the cluster
simulator's fold, to the coding-agent rule that moves a session only where its prompt has room
(`rehome_evicted` / `stay_no_room`). No servers: the parts the poller and the policy use.
"""

from __future__ import annotations

import json
import random

import pytest

from kvrouter.loadtest.cluster_sim_dp import fold_ranks
from kvrouter.policies.coding_agent import CodingAgent
from kvrouter.policies.domain import ReplicaView, RequestSummary, SessionView, Snapshot
from kvrouter.policies.steps import has_kv_room
from kvrouter.router.replicas import ReplicaRegistry
from kvrouter.sglang_protocol.loads import parse_loads_json, parse_rank_loads
from kvrouter.sglang_protocol.signals import SignalParseError, parse_metrics_text

RANK_POOL = 100_000  # KV tokens of each DP rank
MARK = 0.92  # coding-agent's replica_max_token_usage
BLOCKS = tuple(range(1, 50))  # the prompt has prefix blocks: the KV index was consulted


def loads_body(*usages: float) -> dict:
    """A `/v1/loads` body of one replica whose DP ranks have these token_usage values."""
    return {"loads": [
        {"dp_rank": rank, "num_running_reqs": 1 if usage else 0, "num_waiting_reqs": 0,
         "num_used_tokens": int(usage * RANK_POOL), "max_total_num_tokens": RANK_POOL,
         "token_usage": usage}
        for rank, usage in enumerate(usages)]}


def polled_view(url: str, *usages: float) -> ReplicaView:
    """The registry's view of a DP replica after a poll of its `/v1/loads`."""
    registry = ReplicaRegistry([url])
    registry.update_signals(url, parse_loads_json(loads_body(*usages)))
    view = registry.view(url)
    assert view is not None
    return view


def test_loads_keep_each_ranks_kv_in_rank_order():
    body = loads_body(0.0, 1.0)
    body["loads"].reverse()  # SGLang lists ranks in order; the parser does not rely on it
    signals = parse_loads_json(body)
    assert signals.rank_kv == ((0.0, RANK_POOL), (1.0, RANK_POOL))
    # the folded signals are unchanged: the worst rank's usage, the pools summed
    assert (signals.token_usage, signals.max_total_num_tokens) == (1.0, 2 * RANK_POOL)
    assert parse_loads_json(loads_body(0.5)).rank_kv is None  # one rank: the folded view is it
    # the simulator folds its ranks' signals as the poller folds /v1/loads
    assert fold_ranks(parse_rank_loads(loads_body(0.0, 1.0))) == parse_loads_json(loads_body(0.0, 1.0))


def test_room_is_one_ranks_room_on_a_replica_with_a_full_rank_and_an_empty_one():
    view = polled_view("http://b", 1.0, 0.0)
    assert has_kv_room(view, RANK_POOL // 2, MARK, RANK_POOL)  # fits the empty rank
    assert not has_kv_room(view, int(1.2 * RANK_POOL), MARK, RANK_POOL)  # more than one rank's pool
    # a replica without ranks keeps the folded reading
    assert has_kv_room(ReplicaView("c", token_usage=0.4, max_total_num_tokens=RANK_POOL), 50_000, MARK, 1)
    assert not has_kv_room(ReplicaView("c", token_usage=0.5, max_total_num_tokens=RANK_POOL), 50_000, MARK, 1)


def _decide(moving_to: ReplicaView, prompt: int):
    home = ReplicaView("http://a", num_running_reqs=4, num_queue_reqs=2, max_total_num_tokens=RANK_POOL)
    request = RequestSummary(route="/v1/chat/completions", session_key="s1", prompt_tokens=prompt,
                             cached_tokens={"http://a": prompt // 10}, prefix_blocks=BLOCKS)
    snapshot = Snapshot((home, moving_to), SessionView("s1", home="http://a"))
    return CodingAgent().decide(snapshot, request, random.Random(0))


def test_a_session_whose_home_lost_it_moves_to_a_dp_replica_with_one_rank_free():
    # Rank 0 at the mark, rank 1 empty: the folded usage (the worst rank's) said no room.
    d = _decide(polled_view("http://b", MARK, 0.0), prompt=RANK_POOL // 2)
    assert (d.replica, d.reason, d.home) == ("http://b", "rehome_evicted", "http://b")


def test_a_prompt_larger_than_one_ranks_pool_does_not_move_to_a_dp_replica():
    # Both ranks empty: the pools summed said room for a prompt no one rank holds.
    d = _decide(polled_view("http://b", 0.0, 0.0), prompt=int(1.2 * RANK_POOL))
    assert (d.replica, d.reason, d.home) == ("http://a", "stay_no_room", None)


def test_a_dp_replica_with_one_full_rank_and_one_empty_takes_the_session():
    # The worst rank over the usage mark put the replica over the high-water mark, which ran
    # before the room check: the empty rank was never seen.
    d = _decide(polled_view("http://b", 1.0, 0.0), prompt=RANK_POOL // 2)
    assert (d.replica, d.reason, d.home) == ("http://b", "rehome_evicted", "http://b")


def test_a_dp_replica_with_every_rank_over_the_mark_still_does_not():
    d = _decide(polled_view("http://b", 1.0, 0.95), prompt=RANK_POOL // 20)
    assert d.replica == "http://a"


def metrics_page(*usages: float) -> str:
    """A `/metrics` page of one replica whose DP ranks (SGLang's `dp_rank` label) have these
    token_usage values, listed from the last rank to the first."""
    lines = []
    for name, value in (("token_usage", lambda u: u), ("max_total_num_tokens", lambda u: RANK_POOL),
                        ("num_used_tokens", lambda u: int(u * RANK_POOL))):
        lines += [f"# TYPE sglang:{name} gauge"]
        lines += [f'sglang:{name}{{model_name="m",tp_rank="0",dp_rank="{rank}"}} {float(value(u))}'
                  for rank, u in reversed(list(enumerate(usages)))]
    return "\n".join(lines) + "\n"


def test_metrics_pages_keep_each_ranks_kv_as_loads_bodies_do():
    signals = parse_metrics_text(metrics_page(1.0, 0.0, 0.25))
    assert signals.rank_kv == parse_loads_json(loads_body(1.0, 0.0, 0.25)).rank_kv
    assert signals.rank_kv == ((1.0, RANK_POOL), (0.0, RANK_POOL), (0.25, RANK_POOL))
    assert parse_metrics_text(metrics_page(0.5)).rank_kv is None  # one rank


def test_a_pool_that_rounds_to_zero_tokens_is_no_rank_pool():
    body = loads_body(0.0, 0.0)
    for entry in body["loads"]:
        entry["max_total_num_tokens"] = 0.4
    registry = ReplicaRegistry(["http://b"])
    registry.update_signals("http://b", parse_loads_json(body))
    view = registry.view("http://b")
    assert view is not None and view.rank_kv is None
    assert not has_kv_room(view, 10, MARK, RANK_POOL)  # the folded reading (a 1-token pool), not a division by 0


@pytest.mark.parametrize("body", [
    b'{"loads": [{"dp_rank": 0, "num_running_reqs": 1, "max_total_num_tokens": 1e400, "token_usage": 0.1}]}',
    b'{"loads": [{"dp_rank": 0, "num_running_reqs": 1, "max_total_num_tokens": 100, "token_usage": 0.1},'
    b' {"dp_rank": 1, "num_running_reqs": 1, "max_total_num_tokens": 1e400, "token_usage": 0.1}]}',
    b'{"loads": [{"dp_rank": 0, "num_running_reqs": 1, "max_total_num_tokens": 100,'
    b' "token_usage": 0.1, "num_used_tokens": ' + str(10**400).encode() + b'}]}',
])
def test_a_loads_body_with_a_number_beyond_float_range_is_a_parse_error(body):
    """JSON's 1e400 decodes to inf (and a huge integer overflows a float): the body is garbage,
    refused as a SignalParseError (a failed scrape), never an OverflowError out of the parser
    (which the poller treats as a bug and restarts on, every round)."""
    loads = json.loads(body)  # (orjson refuses integers past 64 bits outright)
    with pytest.raises(SignalParseError):
        parse_loads_json(loads)
    with pytest.raises(SignalParseError):
        parse_rank_loads(loads)
