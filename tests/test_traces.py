from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from kvrouter.loadtest.cluster_sim import ClusterSimulator, SimConfig
from kvrouter.loadtest.segment_keys import SegmentKeyCache
from kvrouter.loadtest.trace_claude_code import claude_code_arrivals
from kvrouter.loadtest.sim_prompt import render_chat
from kvrouter.loadtest.trace_mooncake import mooncake_arrivals
from kvrouter.loadtest.trace_session import TraceSession
from kvrouter.loadtest.trace_stats import reuse_bound, trace_summary
from kvrouter.loadtest.traces import (
    DATA_DIR,
    bundled_claude_code_traces,
    bundled_mooncake_trace,
    bundled_traces,
    trace_sessions,
)
from kvrouter.loadtest.workload_config import load_workload

ROOT = Path(__file__).resolve().parent.parent
# The full Claude Code trace set lives beside the repository, in ../shared/traces (not shipped).
FULL_SET = ROOT.parent / "shared" / "traces" / "weka_claude_code"


def _all(session: TraceSession, reply=lambda r: r.expected_output_tokens) -> list:
    out = []
    batch = session.next_requests(None)
    while batch:
        assert len(batch) == 1
        out.append(batch[0])
        batch = session.next_requests([reply(r) for r in batch])
    return out


def _flat(requests: list[dict]) -> list[dict]:
    return [r for r in requests if r.get("type") != "subagent"]


def _write(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


# -- bundled samples ------------------------------------------------------------------------------


def test_bundled_samples_present_and_small() -> None:
    cc = bundled_claude_code_traces()
    assert len(cc) == 3
    assert bundled_mooncake_trace().is_file()
    for name in ("SOURCES.md", "LICENSE-APACHE-kv-cache-tester", "LICENSE-APACHE-Mooncake"):
        assert (DATA_DIR / name).is_file()
    assert sum(p.stat().st_size for p in DATA_DIR.iterdir()) < 1_500_000
    assert set(bundled_traces()) == {"claude-code-sample", "mooncake-sample"}


def test_claude_code_parsing_matches_trace() -> None:
    arrivals = claude_code_arrivals(bundled_claude_code_traces(), stagger_s=7.0)
    assert [a for a, _ in arrivals] == [0.0, 7.0, 14.0]
    for path, (_, session) in zip(bundled_claude_code_traces(), arrivals):
        data = json.loads(path.read_text())
        trace = _flat(data["requests"])
        assert session.session_id == data["id"]
        assert session.n_turns == len(trace)
        reqs = _all(session)
        assert len(reqs) == len(trace)
        for i, (req, raw) in enumerate(zip(reqs, trace)):
            assert req.prompt_tokens == raw["in"]
            assert req.turn_index == i and req.n_branches == 1
            n_blocks = raw["in"] // 64
            assert len(req.segments) == n_blocks + (1 if raw["in"] % 64 else 0)
            assert all(s.tokens == 64 for s in req.segments[:n_blocks])
            if raw["in"] % 64:
                assert req.segments[-1].tokens == raw["in"] % 64
            assert req.expected_output_tokens == req.max_tokens == max(1, raw["out"])
            assert req.think_time_s == (raw["think_time"] if i else 0.0)
            assert req.reused_tokens + req.new_tokens == req.prompt_tokens
        # equal ids <=> equal segment keys, within the session
        by_id: dict[int, str] = {}
        for req, raw in zip(reqs, trace):
            for h, seg in zip(raw["hash_ids"], req.segments):
                assert by_id.setdefault(h, seg.key) == seg.key
        assert len(set(by_id.values())) == len(by_id)


def test_mooncake_parsing_matches_trace() -> None:
    path = bundled_mooncake_trace()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    arrivals = mooncake_arrivals(path)
    assert len(arrivals) == len(rows) == 300
    for (at, session), row in zip(arrivals, rows):  # the sample is in timestamp order
        assert at == pytest.approx(row["timestamp"] / 1000)
        assert session.n_turns == 1
        (req,) = session.next_requests(None)
        assert req.prompt_tokens == row["input_length"]
        assert len(req.segments) == len(row["hash_ids"]) == math.ceil(row["input_length"] / 512)
        assert [s.key for s in req.segments] == [f"mc/{h}" for h in row["hash_ids"]]
        assert req.expected_output_tokens == max(1, row["output_length"])
        assert session.next_requests([5]) == []
    fast = mooncake_arrivals(path, speedup=4.0, limit=10)
    assert len(fast) == 10
    assert fast[-1][0] == pytest.approx(rows[9]["timestamp"] / 4000)


def test_system_blocks_shared_across_sessions() -> None:
    arrivals = claude_code_arrivals(bundled_claude_code_traces())
    firsts = [s.next_requests(None)[0] for _, s in arrivals]
    ks = []
    for path in bundled_claude_code_traces():
        data = json.loads(path.read_text())
        ks.append((data["tool_tokens"] + data["system_tokens"]) // 64)
    k = min(ks)
    keys = [[s.key for s in r.segments] for r in firsts]
    assert keys[0][:k] == keys[1][:k] == keys[2][:k] == [f"cc-system/{j}" for j in range(k)]
    assert all(s.shared and s.role == "system" for r in firsts for s in r.segments[:k])
    # past the system prompt, keys are local to the trace
    for r, kk, key_list in zip(firsts, ks, keys):
        assert all(key.startswith(f"{r.session_id}/") for key in key_list[kk:])
    # same segment objects too (text rendered once for all sessions)
    assert all(a is b for a, b in zip(firsts[0].segments[:k], firsts[1].segments[:k]))
    # page keys agree exactly on the shared prefix, then differ
    cache = SegmentKeyCache(64)
    pages = [cache.keys(r.session_id, r.segments) for r in firsts]
    assert pages[0][:k] == pages[1][:k] == pages[2][:k]
    assert pages[0][k] != pages[1][k]
    # smaller pages: same answer, k * 4 pages shared
    cache16 = SegmentKeyCache(16)
    p16 = [cache16.keys(r.session_id, r.segments) for r in firsts]
    assert p16[0][: 4 * k] == p16[1][: 4 * k] and p16[0][4 * k] != p16[1][4 * k]


def test_page_keys_follow_turn_prefixes() -> None:
    (_, session), *_ = claude_code_arrivals(bundled_claude_code_traces()[0])
    reqs = _all(session)
    cache = SegmentKeyCache(64)
    fresh = SegmentKeyCache(64)
    prev = None
    for req in reqs:
        keys = cache.keys(session.session_id, req.segments)
        assert keys == fresh.keys(f"x{req.turn_index}", req.segments)  # incremental == from scratch
        if prev is not None:
            same = req.reused_tokens // 64
            assert keys[:same] == prev[:same]
            if same < len(prev) and same < len(keys):
                assert keys[same] != prev[same]
        prev = keys


def test_live_rendering_extends_previous_prompt() -> None:
    (_, session), *_ = claude_code_arrivals(bundled_claude_code_traces()[0])
    r1 = session.next_requests(None)[0]
    reply = session.reply_segment(r1, "some reply text")
    assert reply.key == f"{session.session_id}/r0/reply" and reply.text() == "some reply text"
    r2 = session.next_requests(["some reply text"])[0]  # the reply does not change the next prompt
    m1, m2 = r1.messages, r2.messages
    # as an agent sends it: the previous request's messages unchanged, then its answer and the new input
    assert [m["role"] for m in m1] == ["system", "user"]
    assert [m["role"] for m in m2] == ["system", "user", "assistant", "user"] and m2[:2] == m1
    assert len(m2[2]["content"]) == 4 * r1.max_tokens  # the answer is the trace's output length
    for r, m in ((r1, m1), (r2, m2)):
        assert sum(len(x["content"]) for x in m) == 4 * r.prompt_tokens


def test_live_rendering_is_append_only_until_the_prefix_breaks() -> None:
    """Every request's messages start with the previous one's (a partial last block's text is
    the start of the whole block the next request has there), except where the trace's own
    prefix breaks (a compaction): that request starts its messages over."""
    for path in bundled_claude_code_traces():
        for _, session in claude_code_arrivals(path):
            prev = None
            for _, r in session.planned():
                m = r.messages
                assert sum(len(x["content"]) for x in m) == 4 * r.prompt_tokens
                assert m[-1]["role"] == "user" and all(x["content"] for x in m)
                if prev is not None:  # the trace says it extends: its whole blocks go on, its prompt grows
                    blocks = [s for s in prev_r.segments if not s.key.endswith("/tail")]
                    extends = list(r.segments[:len(blocks)]) == blocks and r.prompt_tokens > prev_r.prompt_tokens
                    assert (m[:len(prev)] == prev) == extends, session.session_id
                prev, prev_r = m, r


def test_rendering_after_a_prefix_break_keeps_what_it_shares_and_ends_with_the_user(tmp_path: Path) -> None:
    """The third request goes back to the first 11 blocks of the second (its 12th rewritten),
    with no partial block: it keeps the second's messages up to where they part, and its text
    past the last user message still ends in a user message, never the assistant's."""
    data = {"id": "brk", "block_size": 64, "tool_tokens": 64, "system_tokens": 0, "requests": [
        _req(0.0, list(range(1, 11)), 650, out=50), _req(1.0, list(range(1, 13)), 773, out=50),
        _req(2.0, list(range(1, 12)), 704, out=50)]}
    (_, session), = claude_code_arrivals(_write(tmp_path / "trace_brk.json", data))
    first, second, third = (r.messages for _, r in session.planned())
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"] and second[:2] == first
    assert [m["role"] for m in third][-1] == "user" and third[:3] == second[:3]
    shared = 11 * 64 * 4 - sum(len(m["content"]) for m in second[:3])  # of the second's last message
    assert third[3]["content"][:shared - 4] == second[3]["content"][:shared - 4]


def test_a_request_shorter_than_the_system_prompt_still_ends_with_a_user_message(tmp_path: Path) -> None:
    """A request that ends inside the shared system prefix: its partial block is a user message
    (some chat templates refuse a request without one), with the text the next request's system
    block starts with; the next request's system prompt stays one message."""
    data = {"id": "sys", "block_size": 64, "tool_tokens": 128, "system_tokens": 0, "requests": [
        _req(0.0, [1], 100, out=20), _req(1.0, [1, 2, 3, 4], 300, out=20),
        _req(2.0, [1, 2, 3, 4, 5], 350, out=20)]}  # the system prefix: blocks 1 and 2
    (_, session), = claude_code_arrivals(_write(tmp_path / "trace_sys.json", data))
    first, second, _ = (r.messages for _, r in session.planned())
    assert [m["role"] for m in first] == ["system", "user"] and len(first[1]["content"]) == 4 * 36
    assert [m["role"] for m in second] == ["system", "user"] and len(second[0]["content"]) == 4 * 128
    assert second[0]["content"] == first[0]["content"] + first[1]["content"] + second[0]["content"][4 * 100:]


def test_session_protocol_errors() -> None:
    (_, session), *_ = claude_code_arrivals(bundled_claude_code_traces()[0], max_requests=2)
    with pytest.raises(ValueError):
        session.next_requests([1])
    session.next_requests(None)
    with pytest.raises(ValueError):
        session.next_requests([1, 2])
    assert session.next_requests([None])  # a failed request: the trace goes on
    assert session.next_requests(["x"]) == []
    assert session.next_requests(None) == []


# -- sub-agents, options ---------------------------------------------------------------------------


def _req(t: float, ids: list[int], n_in: int, out: int = 10, think: float = 0.0) -> dict:
    return {"t": t, "type": "n", "in": n_in, "out": out, "hash_ids": ids, "think_time": think,
            "api_time": 1.0}


def _hand_trace() -> dict:
    sub = {
        "type": "subagent", "agent_id": "agent_001", "subagent_type": "Explore", "t": 30.0,
        "tool_tokens": 64, "system_tokens": 0,
        "requests": [_req(0.0, [50, 51], 130), _req(4.0, [50, 51, 52], 200, think=3.0)],
    }
    return {
        "id": "hand", "block_size": 64, "hash_id_scope": "local", "tool_tokens": 100, "system_tokens": 28,
        "requests": [
            _req(0.0, [1, 2, 3], 200),
            _req(10.0, [1, 2, 3, 4], 256, think=8.0),
            sub,
            _req(60.0, [1, 2, 3, 4, 5], 330, think=20.0),
        ],
    }


def test_subagents_become_sessions(tmp_path: Path) -> None:
    path = _write(tmp_path / "trace_0001.json", _hand_trace())
    arrivals = claude_code_arrivals([path, path], copies=1, stagger_s=100.0)
    assert [(a, s.session_id) for a, s in arrivals] == [
        (0.0, "hand"), (30.0, "hand/agent_001"), (100.0, "hand#1"), (130.0, "hand#1/agent_001"),
    ]
    parent, sub = arrivals[0][1], arrivals[1][1]
    assert parent.n_turns == 3 and sub.n_turns == 2
    p = _all(parent)
    s = _all(sub)
    assert [x.key for x in p[0].segments] == ["cc-system/0", "cc-system/1", "hand/3", "hand/r0/tail"]
    assert [x.key for x in s[1].segments] == [
        "cc-system/Explore/0", "hand/51", "hand/52", "hand/agent_001/r1/tail",
    ]
    assert p[2].think_time_s == 20.0 and s[1].think_time_s == 3.0
    # the copy is another user: own local blocks, shared system blocks
    arrivals = claude_code_arrivals(path, copies=2, stagger_s=100.0)
    assert [s.session_id for _, s in arrivals] == ["hand", "hand/agent_001", "hand#1", "hand#1/agent_001"]
    c = arrivals[2][1].next_requests(None)[0]
    assert [x.key for x in c.segments] == ["cc-system/0", "cc-system/1", "hand#1/3", "hand#1/r0/tail"]
    # truncation keeps only the sub-agents started by the last kept request
    assert [s.session_id for _, s in claude_code_arrivals(path, max_requests=2)] == ["hand"]
    assert len(claude_code_arrivals(path, max_requests=3)) == 2


def test_context_cap_drops_requests(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.json", _hand_trace())
    (_, parent), _ = claude_code_arrivals(path, max_context_tokens=300)
    reqs = _all(parent)
    assert [r.prompt_tokens for r in reqs] == [200, 256]
    (_, parent), _ = claude_code_arrivals(path, max_context_tokens=260)
    reqs = _all(parent)
    assert [r.prompt_tokens for r in reqs] == [200]


@pytest.mark.skipif(not (FULL_SET / "trace_0276.json").is_file() and os.environ.get("CI") != "true",
                    reason="full trace set not available (../shared/traces/weka_claude_code)")
def test_real_subagents() -> None:
    data = json.loads((FULL_SET / "trace_0276.json").read_text())
    subs = [r for r in data["requests"] if r.get("type") == "subagent"]
    arrivals = claude_code_arrivals(FULL_SET / "trace_0276.json")
    assert len(arrivals) == 1 + len(subs)
    for sub in subs:
        at, s = next((a, s) for a, s in arrivals if s.session_id == f"trace_0276/{sub['agent_id']}")
        assert at == pytest.approx(sub["t"]) and s.n_turns == len(sub["requests"])


# -- dispatch ------------------------------------------------------------------------------------


def test_trace_sessions_dispatch(tmp_path: Path) -> None:
    assert len(trace_sessions(DATA_DIR)) == 3  # a directory: its trace_*.json
    assert len(trace_sessions(bundled_claude_code_traces()[0])) == 1
    assert len(trace_sessions(bundled_mooncake_trace(), limit=5)) == 5
    assert len(trace_sessions("claude-code-sample", max_requests=1)) == 3
    assert len(trace_sessions("mooncake-sample", speedup=2.0)) == 300
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"a": 1}\n')
    with pytest.raises(ValueError):
        trace_sessions(bad)
    with pytest.raises(FileNotFoundError):
        trace_sessions(tmp_path / "missing.json")
    with pytest.raises(TypeError):
        trace_sessions(DATA_DIR, speedup=2.0)  # a Mooncake option for a Claude Code trace


# -- reuse bound -----------------------------------------------------------------------------------


def test_reuse_bound_mooncake_by_hand(tmp_path: Path) -> None:
    lines = [  # file order != time order: the bound follows timestamps
        {"timestamp": 2000, "input_length": 1024, "output_length": 5, "hash_ids": [1, 3]},
        {"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 1000, "input_length": 900, "output_length": 5, "hash_ids": [1, 3]},
    ]
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    # pages of 256: t=0 nothing seen; t=1: block 1 (512) hit, block 3 has 388 tokens = 1 new page;
    # t=2: block 1 (512) + the first page of block 3 (256) hit.
    assert reuse_bound(mooncake_arrivals(path), 256) == pytest.approx((512 + 768) / (1024 + 900 + 1024))
    # one page per block: block 3 was only partial before, so t=2 hits block 1 only
    assert reuse_bound(mooncake_arrivals(path), 512) == pytest.approx((512 + 512) / (1024 + 900 + 1024))


def test_reuse_bound_claude_code_by_hand(tmp_path: Path) -> None:
    data = _hand_trace()
    data["requests"] = data["requests"][:2]  # [1,2,3]+8 tail, then [1,2,3,4]
    path = _write(tmp_path / "t.json", data)
    assert reuse_bound(claude_code_arrivals(path), 64) == pytest.approx(192 / (200 + 256))
    # a second user shares the 2 system blocks (k = 128 // 64) with the first
    two = claude_code_arrivals(path, copies=2)
    assert reuse_bound(two, 64) == pytest.approx((192 + 128 + 192) / (2 * 456))


def test_reuse_bound_bundled_sample() -> None:
    arrivals = claude_code_arrivals(bundled_claude_code_traces())
    bound = reuse_bound(arrivals, 64)
    assert 0.9 < bound < 1.0
    assert reuse_bound(arrivals, 64) == bound  # planned() does not consume the sessions
    assert all(s.turn == 0 for _, s in arrivals)
    summary = trace_summary(arrivals)
    assert summary["sessions"] == 3 and summary["requests"] == 111


# -- simulator -------------------------------------------------------------------------------------


def test_cluster_sim_replays_claude_code() -> None:
    arrivals = claude_code_arrivals(bundled_claude_code_traces(), stagger_s=5.0, max_requests=12)
    config = SimConfig(replicas=2, profile="kimi-k2.6-b200-tp4-fp8kv", duration_s=120.0,
                       warmup_s=0.0, drain_s=120.0)
    sim = ClusterSimulator(config, "prefix_aware", load_workload("tiny"), arrivals=arrivals)
    result = sim.run()
    assert result["requests_ok"] > 20 and result["requests_failed"] == 0
    assert result["cache_hit_rate"] > 0.5
    # the simulated hit rate never beats the trace's own bound on the same requests
    done: dict[str, int] = {}
    for rec in sim.records:
        done[rec.session_id] = max(done.get(rec.session_id, 0), rec.turn_index + 1)
    fresh = claude_code_arrivals(bundled_claude_code_traces(), stagger_s=5.0, max_requests=12)
    same = [(a, TraceSession(s.session_id, s._steps[: done[s.session_id]]))
            for a, s in fresh if s.session_id in done]
    assert result["cache_hit_rate"] <= reuse_bound(same, 64) + 1e-9


# -- live rendering against a simulated replica -------------------------------------------------


async def test_live_replica_caches_trace_prefixes(start_app, tmp_path: Path) -> None:
    import aiohttp

    from kvrouter.loadtest.sim_server import build_app

    data = {
        "id": "live", "block_size": 64, "tool_tokens": 200, "system_tokens": 56,  # 4 system blocks
        "requests": [
            _req(0.0, list(range(1, 11)), 650, out=8),
            _req(5.0, list(range(1, 15)), 900, out=8, think=1.0),
            _req(9.0, list(range(1, 21)), 1300, out=8, think=1.0),
        ],
    }
    path = _write(tmp_path / "trace_live.json", data)
    app = build_app("tiny", time_scale=200.0)
    url = await start_app(app)
    cached: dict[str, list[int]] = {}
    rendered: list[int] = []  # the first user's prompts as the replica counts them
    async with aiohttp.ClientSession() as http:
        for _, session in claude_code_arrivals(path, copies=2):
            replies = None
            while batch := session.next_requests(replies):
                (req,) = batch
                if session.session_id == "live":
                    rendered.append(len(render_chat(req.messages)) // 4)
                body = {"model": "m", "messages": req.messages, "max_tokens": req.max_tokens}
                async with http.post(url + "/v1/chat/completions", json=body,
                                     headers={"x-session-id": req.session_id}) as resp:
                    assert resp.status == 200, await resp.text()
                    out = await resp.json()
                usage = out["usage"]
                cached.setdefault(req.session_id, []).append(
                    (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                )
                replies = [out["choices"][0]["message"]["content"]]
    first, second = cached["live"], cached["live#1"]
    # (observed: [0, 656, 928] and [256, 656, 928]: the whole pages of the previous prompt hit,
    # its partial last block (10 tokens past 640) included, since the next one extends it)
    assert first[0] == 0 and 640 < first[1] <= rendered[0] and first[1] < first[2] <= rendered[1]
    assert 0 < second[0] < first[1]  # another user: only the shared system blocks hit
    assert second[1:] == first[1:]  # then its own history, as for the first user
