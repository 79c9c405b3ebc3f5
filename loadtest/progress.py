"""Progress lines of a load run on stderr: rewritten in place on a TTY, every few lines otherwise."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

__all__ = ["ProgressFn", "StderrProgress"]

#: Receives one status line about every second; may also have ``finish(line)`` for the last one.
ProgressFn = Callable[[str], None]


class StderrProgress:
    """Default progress output: one ``\\r``-rewritten line on a TTY, else a line every ``every`` calls."""

    def __init__(self, stream: TextIO | None = None, every: int = 10) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every
        self._calls = 0
        self._width = 0

    def __call__(self, line: str) -> None:
        self._calls += 1
        if self.tty:
            self._width = max(self._width, len(line))
            self.stream.write("\r" + line.ljust(self._width))
        elif self._calls % self.every == 1 or self.every <= 1:
            self.stream.write(line + "\n")
        self.stream.flush()

    def finish(self, line: str) -> None:
        self.stream.write(("\r" + line.ljust(self._width) if self.tty else line) + "\n")
        self.stream.flush()
