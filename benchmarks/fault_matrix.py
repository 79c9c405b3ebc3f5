"""Render the fault matrix of docs/reliability.md from the observed outcomes of a test run.

    KVROUTER_FAULT_MATRIX=docs/reliability-faults.json .venv/bin/python -m pytest -m fault_matrix
    .venv/bin/python benchmarks/fault_matrix.py docs/reliability-faults.json --doc docs/reliability.md

Tests marked `fault_matrix(fault=..., clients_saw=...)` record every request their clients sent and
what came back, and the replicas' own counts, in the `fault_record` ledger (tests/fault_ledger.py);
each test becomes one row of the JSON. With --doc, the table between the
`<!-- fault-matrix:begin -->` and `<!-- fault-matrix:end -->` lines is replaced in place. Exit code 1
if a row lost a request or its test did not pass.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BEGIN, END = "<!-- fault-matrix:begin -->", "<!-- fault-matrix:end -->"


def _errors(client: dict) -> str:
    """Clean errors by status, e.g. `503 x8, 502 x2`."""
    by_status: dict[str, int] = {}
    for e in client["errors"]:
        key = str(e["status"] if e["status"] is not None else "SSE")
        by_status[key] = by_status.get(key, 0) + e["count"]
    parts = [f"{k} x{n}" if n > 1 else k for k, n in by_status.items()]
    return f"{client['clean_errors']} ({', '.join(parts)})" if parts else str(client["clean_errors"])


def _replicas(replicas: dict | None) -> str:
    if replicas is None:
        return "-"
    return f"{replicas['received']} / {replicas['completed']} / {replicas['aborted']} / {replicas['running']}"


def render(rows: list[dict]) -> str:
    out = [
        "| Fault | What clients saw | Sent | Complete | Clean errors (status) | Left on purpose | Nothing "
        "| Replicas: received / completed / aborted / still running | Lost | Test (result) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        c = r["client"]
        note = f" ({r['notes']})" if r.get("notes") else ""
        out.append(
            f"| {r['fault']} | {r['clients_saw']}{note} | {c['sent']} | {c['complete']} | {_errors(c)} "
            f"| {c['left_on_purpose']} | {c['nothing']} | {_replicas(r['replicas'])} | **{r['lost']}** "
            f"| `{r['test']}` ({r['outcome']}) |"
        )
    total_lost = sum(r["lost"] or 0 for r in rows)
    sent = sum(r["client"]["sent"] for r in rows)
    passed = sum(r["outcome"] == "passed" for r in rows)
    disagreements = [d for r in rows for d in r["disagreements"]]
    out += ["", f"{len(rows)} faults, {passed} passed; {sent} requests sent, **{total_lost} lost**"
            + (f"; disagreements: {'; '.join(disagreements)}." if disagreements else
               "; clients and replicas agree on every count.")]
    return "\n".join(out) + "\n"


def replace_section(text: str, table: str) -> str | None:
    head, _, rest = text.partition(BEGIN)
    _, found, tail = rest.partition(END)
    if not found:
        return None
    return f"{head}{BEGIN}\n{table}{END}{tail}"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("json")
    p.add_argument("--doc", help="markdown file whose marked section is replaced")
    args = p.parse_args()
    rows = json.loads(Path(args.json).read_text())
    table = render(rows)
    if args.doc:
        doc = Path(args.doc)
        new = replace_section(doc.read_text(), table)
        if new is None:
            print(f"{doc}: no {BEGIN} ... {END} section", file=sys.stderr)
            return 1
        doc.write_text(new)
    else:
        print(table)
    return 0 if all(r["outcome"] == "passed" and r["lost"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
