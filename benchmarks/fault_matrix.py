"""Render the fault matrix of docs/reliability.md from a test run.

    KVROUTER_FAULT_MATRIX=fault-matrix.json .venv/bin/python -m pytest -m fault_matrix
    .venv/bin/python benchmarks/fault_matrix.py fault-matrix.json --doc docs/reliability.md

Tests marked `fault_matrix(fault=..., clients_saw=...)` count their requests with the
`fault_record` fixture (tests/conftest.py); each becomes one row. With --doc, the table between
the `<!-- fault-matrix:begin -->` and `<!-- fault-matrix:end -->` lines is replaced in place.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BEGIN, END = "<!-- fault-matrix:begin -->", "<!-- fault-matrix:end -->"


def render(rows: list[dict]) -> str:
    out = [
        "| Fault | What clients saw | Sent | Complete | Clean errors | Lost | Test (result) |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        note = f" ({r['notes']})" if r.get("notes") else ""
        n = {k: ("n/a" if r[k] is None else r[k]) for k in ("sent", "ok", "clean_errors", "lost")}
        out.append(
            f"| {r['fault']} | {r['clients_saw']}{note} | {n['sent']} | {n['ok']} | {n['clean_errors']} | "
            f"**{n['lost']}** | `tests/{r['test']}` ({r['outcome']}) |"
        )
    total_lost = sum(r["lost"] or 0 for r in rows)
    sent = sum(r["sent"] or 0 for r in rows)
    passed = sum(r["outcome"] == "passed" for r in rows)
    out += ["", f"{len(rows)} faults, {passed} passed; {sent} requests sent, **{total_lost} lost**."]
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("json")
    p.add_argument("--doc", help="markdown file whose marked section is replaced")
    args = p.parse_args()
    rows = json.loads(Path(args.json).read_text())
    table = render(rows)
    if args.doc:
        doc = Path(args.doc)
        text = doc.read_text()
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        if not rest:
            print(f"{doc}: no {BEGIN} marker", file=sys.stderr)
            return 1
        doc.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")
    else:
        print(table)
    return 0 if all(r["outcome"] == "passed" and not r["lost"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
