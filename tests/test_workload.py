from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvrouter.loadtest.turn_request import count_tokens, synthetic_text
from kvrouter.loadtest.workload import Session, make_session, summarize
from kvrouter.loadtest.workload_config import (
    WORKLOADS_DIR,
    WorkloadConfig,
    WorkloadConfigError,
    builtin_workloads,
    load_workload,
)


def _tiny(**overrides: object) -> WorkloadConfig:
    data = load_workload("tiny").model_dump()
    data.update(overrides)
    return WorkloadConfig.model_validate(data)


def _run(session: Session, reply=lambda r: r.expected_output_tokens) -> list[list]:
    """All batches of a session, replying with `reply(request)`."""
    batches = []
    batch = session.next_requests(None)
    while batch:
        batches.append(batch)
        batch = session.next_requests([reply(r) for r in batch])
    return batches


def test_builtins_load() -> None:
    assert {"coding-agent", "tiny"} <= set(builtin_workloads())
    for name in builtin_workloads():
        assert load_workload(name).name == name


def test_coding_agent_shape_matches_production() -> None:
    # workload.md: ~100k input, ~500 output, ~200:1; SOURCES.md: median 45 requests/session,
    # think time median 10 s / p90 166 s.
    s = summarize(load_workload("coding-agent"), seed=0, n_sessions=150)
    assert 80_000 <= s["mean_input_tokens"] <= 130_000, s
    assert 380 <= s["mean_output_tokens"] <= 650, s
    assert 150 <= s["input_output_ratio"] <= 280, s
    assert 35 <= s["median_turns_per_session"] <= 55, s
    assert 6 <= s["think_p50_s"] <= 15 and 100 <= s["think_p90_s"] <= 250, s
    assert 0.01 <= s["branch_turn_fraction"] <= 0.06, s
    assert 0.002 <= s["edit_turn_fraction"] <= 0.03, s
    assert s["reusable_prefix_fraction"] > 0.9, s


def test_turn_structure_matches_tiny_config() -> None:
    cfg = _tiny(branch={"rate": 0.0}, edit_rate=0.0)
    for i in range(50):
        batches = _run(make_session(cfg, 3, i))
        assert 2 <= len(batches) <= 5  # turns_per_session: choice [2, 3, 4, 5]
        assert all(len(b) == 1 for b in batches)
        for b in batches:
            r = b[0]
            # system + repo context + (user, assistant) per earlier turn + new user message
            assert len(r.segments) == 2 + 2 * r.turn_index + 1
            assert r.segments[0].role == "system" and r.segments[-1].role == "user"
            assert r.max_tokens == r.expected_output_tokens >= 1
            assert r.new_tokens == r.segments[-1].tokens


def test_text_is_four_chars_per_token() -> None:
    text = synthetic_text("k", 123)
    assert len(text) == 4 * 123 and text.isascii()
    assert count_tokens(text) == 123
    assert synthetic_text("k", 123) == text and synthetic_text("k2", 123) != text
    s = make_session(_tiny(), 0, 0)
    r = s.next_requests(None)[0]
    assert sum(count_tokens(m["content"]) for m in r.messages) == r.prompt_tokens


def test_system_prompt_identical_across_sessions_repo_context_not() -> None:
    cfg = load_workload("tiny")
    a = make_session(cfg, 0, 0).next_requests(None)[0].messages
    b = make_session(cfg, 7, 1).next_requests(None)[0].messages
    assert a[0]["role"] == "system" and a[0] == b[0]
    assert a[1] != b[1]


def test_history_is_exact_prefix_without_edits() -> None:
    cfg = _tiny(edit_rate=0.0, branch={"rate": 0.0})
    s = make_session(cfg, 1, 0)
    prev = s.next_requests(None)[0]
    while True:
        reply_text = f"reply to turn {prev.turn_index}: " + "abcd" * 5
        batch = s.next_requests([reply_text])
        if not batch:
            break
        cur = batch[0]
        n = len(prev.messages)
        assert cur.messages[:n] == prev.messages  # byte-identical prefix
        assert cur.messages[n] == {"role": "assistant", "content": reply_text}  # the server's reply
        assert cur.reused_tokens == prev.prompt_tokens + count_tokens(reply_text)
        prev = cur


def test_edit_changes_an_earlier_message_only() -> None:
    cfg = _tiny(edit_rate=1.0, branch={"rate": 0.0}, turns_per_session=6)
    s = make_session(cfg, 2, 0)
    prev = s.next_requests(None)[0]
    edits = 0
    while True:
        batch = s.next_requests([prev.expected_output_tokens])
        if not batch:
            break
        cur = batch[0]
        assert cur.is_edit and cur.edit_message_index is not None
        i = cur.edit_message_index
        assert i >= 1 and cur.messages[i]["role"] == "user"
        assert cur.messages[:i] == prev.messages[:i]  # everything before it byte-identical
        assert cur.messages[i]["content"] != prev.messages[i]["content"]
        assert count_tokens(cur.messages[i]["content"]) == count_tokens(prev.messages[i]["content"])
        assert cur.messages[i + 1 : len(prev.messages)] == prev.messages[i + 1 :]  # later ones kept
        assert cur.reused_tokens == sum(seg.tokens for seg in cur.segments[:i])
        edits += 1
        prev = cur
    assert edits == 5


def test_branches_share_session_and_history() -> None:
    cfg = _tiny(branch={"rate": 1.0, "fanout": 3}, edit_rate=0.0, turns_per_session=4)
    s = make_session(cfg, 0, 0)
    batches = _run(s)
    assert [len(b) for b in batches] == [1, 3, 3, 3]  # the first turn never fans out
    for b in batches[1:]:
        assert {r.session_id for r in b} == {s.session_id}
        assert [r.branch_index for r in b] == [0, 1, 2] and all(r.n_branches == 3 for r in b)
        shared = b[0].messages[:-1]
        for r in b:
            assert r.messages[:-1] == shared and r.think_time_s == b[0].think_time_s
        assert len({r.messages[-1]["content"] for r in b}) == 3  # each branch its own suffix
    # The session continues from exactly one branch of each fan-out.
    for prev, cur in zip(batches[1:], batches[2:]):
        n = len(prev[0].messages)
        assert sum(cur[0].messages[:n] == p.messages for p in prev) == 1


def test_same_seed_same_sessions() -> None:
    cfg = load_workload("tiny")

    def dump(seed: int, i: int) -> list:
        return [[(r.messages, r.max_tokens, r.think_time_s, r.branch_index, r.is_edit) for r in b]
                for b in _run(make_session(cfg, seed, i))]

    assert dump(5, 3) == dump(5, 3)
    assert dump(5, 3) != dump(6, 3)
    assert summarize(cfg, 9, 30) == summarize(cfg, 9, 30)
    # A Session only draws from the generator it is given.
    def msgs(session: Session) -> list:
        return [[r.messages for r in b] for b in _run(session)]

    assert msgs(Session(cfg, random.Random(1), "x")) == msgs(Session(cfg, random.Random(1), "x"))


def test_context_cap_compacts_or_ends() -> None:
    cfg = _tiny(turns_per_session=40, max_context_tokens=600, branch={"rate": 0.0}, edit_rate=0.0)
    s = make_session(cfg, 0, 0)
    batches = _run(s)
    assert len(batches) == 40 and s.compactions > 0
    for b in batches:
        assert b[0].prompt_tokens + b[0].max_tokens <= 600
    compacted = [b[0] for b in batches if b[0].compacted]
    assert compacted and compacted[0].messages[:2] == batches[0][0].messages[:2]  # system + repo kept

    s = make_session(cfg.model_copy(update={"on_context_full": "end"}), 0, 0)
    batches = _run(s)
    assert 1 <= len(batches) < 40 and s.done and s.compactions == 0


def test_reply_protocol_errors() -> None:
    s = make_session(load_workload("tiny"), 0, 0)
    with pytest.raises(ValueError):
        s.next_requests(["unexpected"])
    s.next_requests(None)
    with pytest.raises(ValueError, match="expected 1 replies"):
        s.next_requests([])


def test_unknown_yaml_key_is_a_clear_error(tmp_path: Path) -> None:
    data = (WORKLOADS_DIR / "tiny.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(data + "bogus_knob: 3\n")
    with pytest.raises(WorkloadConfigError, match=r"bad\.yaml: bogus_knob: unknown key"):
        load_workload(bad)
    bad.write_text(data.replace("p_tool: 0.8", "p_tool: 0.8\n  p_toool: 1"))
    with pytest.raises(WorkloadConfigError, match=r"think_time\.p_toool: unknown key"):
        load_workload(bad)
    bad.write_text(data.replace("edit_rate: 0.1", "edit_rate: 1.5"))
    with pytest.raises(WorkloadConfigError, match="edit_rate"):
        load_workload(bad)
    with pytest.raises(WorkloadConfigError, match="not a built-in"):
        load_workload("no-such-workload")
