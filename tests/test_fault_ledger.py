"""The fault ledger's verdicts, and the saved fault matrix: every row observed, none lost, the table
in docs/reliability.md rendered from the JSON beside it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from .fault_ledger import (
    CLEAN_ERROR,
    COMPLETE,
    NOTHING,
    FaultRecord,
    Outcome,
    ReplicaCounts,
    outcome_of_body,
    outcome_of_sse,
)

ROOT = Path(__file__).resolve().parent.parent
MATRIX = ROOT / "docs" / "reliability-faults.json"
DOC = ROOT / "docs" / "reliability.md"


def _record(*kinds: str, replicas: list[ReplicaCounts] = ()) -> FaultRecord:
    record = FaultRecord()
    for kind in kinds:
        req = record.send()
        if kind == "left":
            req.left()
        elif kind != "unanswered":
            req.got(Outcome(kind, 200 if kind == COMPLETE else 503, None if kind == COMPLETE else "x"))
    for r in replicas:
        record.replica(r)
    return record


def test_complete_and_clean_errors_are_not_lost() -> None:
    record = _record(COMPLETE, CLEAN_ERROR, "left", replicas=[ReplicaCounts("r", 2, 1, 1)])
    assert record.lost == 0 and record.disagreements() == []


def test_a_request_that_got_nothing_or_no_outcome_is_lost() -> None:
    assert _record(COMPLETE, NOTHING).lost == 1
    assert _record(COMPLETE, "unanswered").lost == 1
    row = _record(NOTHING, "unanswered").row()
    assert row["client"]["nothing"] == 2 and row["lost"] == 2


def test_disagreement_with_the_replicas_is_lost() -> None:
    # a replica completed a request no client received as complete (answered into the void)
    record = _record(COMPLETE, CLEAN_ERROR, replicas=[ReplicaCounts("r", 2, 2, 0)])
    assert record.lost == 1 and record.disagreements()
    # a request still running on a replica after the test (decoding for nobody)
    record = _record(COMPLETE, "left", replicas=[ReplicaCounts("r", 2, 1, 0, running=1)])
    assert record.lost == 1
    # ... unless the replica's process is gone (what it ran died with it)
    record = _record(CLEAN_ERROR, replicas=[ReplicaCounts("victim", 1, 0, 0, running=1, gone=True)])
    assert record.lost == 0


def test_outcomes_are_classified_by_what_came_back() -> None:
    ok = b'data: {"choices": []}\n\ndata: [DONE]\n\n'
    error = b'data: {"choices": []}\n\ndata: {"error": {"message": "cut", "code": 502}}\n\ndata: [DONE]\n\n'
    assert outcome_of_sse(ok).kind == COMPLETE
    assert outcome_of_sse(error) == Outcome(CLEAN_ERROR, 502, "cut")
    assert outcome_of_sse(ok[:-16]).kind == NOTHING  # truncated, no error
    assert outcome_of_sse(ok + b"data: [DONE]\n\n").kind == NOTHING  # answered twice
    assert outcome_of_body(503, b'{"error": {"message": "busy"}}').kind == CLEAN_ERROR
    assert outcome_of_body(502, b"<html>bad gateway</html>").kind == NOTHING
    assert outcome_of_body(200, b'{"choices": [{}]}').kind == COMPLETE


def test_the_saved_matrix_lost_nothing_and_the_doc_is_rendered_from_it() -> None:
    rows = json.loads(MATRIX.read_text())
    assert rows and all(r["outcome"] == "passed" and r["lost"] == 0 and not r["disagreements"] for r in rows)
    assert all(r["client"]["sent"] > 0 for r in rows)  # every fault observed requests
    spec = importlib.util.spec_from_file_location("fault_matrix", ROOT / "benchmarks" / "fault_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = DOC.read_text()
    assert module.replace_section(text, module.render(rows)) == text
