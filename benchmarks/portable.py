"""Commands as saved in benchmark JSON: no path of the machine that ran them; and the commit a
run measured.

The interpreter becomes ``python``, paths inside the repository become repo-relative, and any other
absolute path (a scratch file, another virtualenv's program) keeps only its file name.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_ABSOLUTE = re.compile(r"(?<![\w.:/])/[^\s'\"]+")  # not the // or /path of a URL


def _relative(match: re.Match[str]) -> str:
    path = Path(match.group(0))
    if path.parent.name == "bin" and path.name.startswith("python"):
        return "python"
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return path.name


def portable(text: str) -> str:
    """``text`` (a command line or one argument) with every absolute path made portable."""
    return _ABSOLUTE.sub(_relative, text)


def portable_command(argv: Iterable[str]) -> str:
    return portable(" ".join(shlex.quote(a) for a in argv))


def machine_facts(load_before: tuple[float, float, float]) -> dict[str, object]:
    """The interpreter, the CPUs and the 1-minute load average at the start (`load_before`, from
    `os.getloadavg()`) and now: the machine may be shared, so a run says how busy it was."""
    return {"python": sys.version.split()[0], "cpus": os.cpu_count(),
            "load_average_1m": {"start": round(load_before[0], 2), "end": round(os.getloadavg()[0], 2)}}


def code_version() -> dict[str, object] | None:
    """The commit a run measures and whether the checkout had changes not committed to it (None
    outside a git checkout), saved with the run's results so that every figure names its code."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "--no-optional-locks", "-C", str(ROOT), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        commit = git("rev-parse", "--short=7", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no") != ""
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "uncommitted_changes": changed}
