"""The live sweep's disjoint session sets, and the fixed rule that chose sets 2 and up.

Set 1 is the reference set, the 15 files of ``benchmarks/traces/`` (12 of them replayable). Sets 2
and 3 are real Claude Code sessions of the same public corpus (kv-cache-tester @ 94f6046d,
Apache-2.0), chosen by :func:`replayable` with no look at any routing result:

- in trace-id order, every trace not already in set 1;
- its first ``max_requests`` (12) top-level requests all fit the replay's context limit
  (prompt + output <= 100k trace tokens), so the replay is exactly the trace's first 12 requests;
- no replayed request (sub-agents included, prompt + output) is larger than set 1's largest, so a
  set's "smallest capacity that holds the largest request" is never larger than set 1's;
- the first 12 such traces make set 2, the next 12 set 3.

Run ``python benchmarks/session_sets.py --git-dir MIRROR`` (a clone of kv-cache-tester, bare is
fine) to choose the sets again and write them, gzipped, to ``benchmarks/traces/setN/``. A file
whose content the clone lacks is skipped and named (the clone used lacked 29 of the 739; SOURCES.md
names those the rule passed over).
"""

from __future__ import annotations

import argparse
import gzip
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from kvrouter.loadtest.trace_claude_code import claude_code_arrivals, read_trace_file

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "benchmarks" / "traces"
MAX_REQUESTS = 12  # the sweep's --max-requests
MAX_CONTEXT_TOKENS = 100_000  # the sweep's --max-context
SET_SIZE = 12  # replayable sessions per set, as many as set 1 has
CORPUS_COMMIT = "94f6046d"


def set_dir(number: int) -> Path:
    """Folder of session set ``number``: set 1 is benchmarks/traces itself, set N its ``setN/``."""
    if number < 1:
        raise ValueError("session sets are numbered from 1")
    return TRACES if number == 1 else TRACES / f"set{number}"


def available_sets() -> list[int]:
    """Set numbers that have a folder, in order."""
    out = [1]
    while set_dir(out[-1] + 1).is_dir():
        out.append(out[-1] + 1)
    return out


def largest_request_tokens(paths: Iterable[Path]) -> int:
    """Largest prompt + output (trace tokens) of the replay of these files, as the sweep replays them."""
    arrivals = claude_code_arrivals(list(paths), max_requests=MAX_REQUESTS, max_context_tokens=MAX_CONTEXT_TOKENS)
    return max((r.prompt_tokens + r.max_tokens for _, s in arrivals for _, r in s.planned()), default=0)


def replayable(path: Path, largest_allowed: int) -> bool:
    """The selection rule for one trace file (see the module docstring)."""
    data = read_trace_file(path)
    top = [r for r in data.get("requests") or [] if r.get("type") != "subagent"]
    if len(top) < MAX_REQUESTS:
        return False
    if any(int(r["in"]) + int(r.get("out") or 0) > MAX_CONTEXT_TOKENS for r in top[:MAX_REQUESTS]):
        return False
    return largest_request_tokens([path]) <= largest_allowed


def choose(candidates: Iterable[Path], exclude: set[str], largest_allowed: int, sets: int) -> list[list[Path]]:
    """``sets`` disjoint sets of SET_SIZE files: the first replayable candidates (in the order given,
    names in ``exclude`` skipped), SET_SIZE per set; fewer if the candidates run out."""
    chosen: list[Path] = []
    for path in candidates:
        if len(chosen) == sets * SET_SIZE:
            break
        if path.name.split(".")[0] in exclude:
            continue
        if replayable(path, largest_allowed):
            chosen.append(path)
    return [chosen[i * SET_SIZE:(i + 1) * SET_SIZE] for i in range(sets)]


def _git_traces(git_dir: Path, commit: str, scratch: Path, absent: list[str]) -> Iterator[Path]:
    """Every ``traces/trace_*.json`` of the commit, in name order, written one by one to ``scratch``.
    A file whose content the clone lacks (a partial mirror) is skipped and its name added to ``absent``."""
    def git(*cmd: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["git", "-C", str(git_dir), *cmd], capture_output=True)

    names = git("ls-tree", "--name-only", commit, "traces/").stdout.decode().split()
    for name in sorted(n for n in names if Path(n).name.startswith("trace_") and n.endswith(".json")):
        shown = git("show", f"{commit}:{name}")
        if shown.returncode != 0:
            absent.append(Path(name).stem)
            continue
        out = scratch / Path(name).name
        out.write_bytes(shown.stdout)
        yield out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Choose the live sweep's extra session sets from kv-cache-tester")
    p.add_argument("--git-dir", required=True, help="a clone of callanjfox/kv-cache-tester (bare is fine)")
    p.add_argument("--commit", default=CORPUS_COMMIT)
    p.add_argument("--sets", type=int, default=2, help="extra sets to choose (sets 2..N+1)")
    args = p.parse_args(argv)
    reference = sorted(TRACES.glob("trace_*.json"))
    largest = largest_request_tokens(reference)
    exclude = {f.name.split(".")[0] for f in reference}
    absent: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        sets = choose(_git_traces(Path(args.git_dir), args.commit, Path(tmp), absent), exclude, largest, args.sets)
        for number, files in enumerate(sets, 2):
            folder = set_dir(number)
            folder.mkdir(parents=True, exist_ok=True)
            for f in files:
                # mtime 0: the same trace gzips to the same bytes on every run
                (folder / f"{f.name}.gz").write_bytes(gzip.compress(f.read_bytes(), compresslevel=9, mtime=0))
            print(f"set {number}: {' '.join(f.stem for f in files)}")
    print(f"largest request allowed: {largest} trace tokens (set 1's)")
    if absent:
        print(f"skipped, not in the clone: {' '.join(absent)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
