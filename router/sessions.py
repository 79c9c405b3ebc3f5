"""The local session table: each session's home, in-flight count and last context size, plus the
per-replica totals policies read (homed sessions and their KV demand). Synchronous; the clock is
passed in, so the cluster simulator drives it in virtual time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..policies.base import SessionView


@dataclass(slots=True)
class SessionEntry:
    home: str | None = None
    in_flight: int = 0
    tokens: int = 0  # last prompt size: the KV this session needs at home
    last_seen: float = 0.0


class SessionTable:
    def __init__(self, ttl_s: float = 3600.0, on_home_change: Callable[[str], None] | None = None):
        self.ttl_s = ttl_s
        self._entries: dict[str, SessionEntry] = {}
        self.homed_sessions: dict[str, int] = {}
        self.homed_tokens: dict[str, int] = {}
        # Called with a replica whenever its homed totals change (the engine mirrors them).
        self.on_home_change = on_home_change or (lambda replica: None)

    def __len__(self) -> int:
        return len(self._entries)

    def view(self, key: str) -> SessionView:
        e = self._entries.get(key)
        if e is None:
            return SessionView(key)
        return SessionView(key, e.home, e.in_flight)

    def entry(self, key: str) -> SessionEntry | None:
        return self._entries.get(key)

    def _account(self, home: str | None, sessions: int, tokens: int) -> None:
        if home is None:
            return
        self.homed_sessions[home] = self.homed_sessions.get(home, 0) + sessions
        self.homed_tokens[home] = self.homed_tokens.get(home, 0) + tokens
        self.on_home_change(home)

    def touch(self, key: str, now: float, *, home: str | None = None, tokens: int | None = None) -> SessionEntry:
        """Record a request of `key`: a new home (if given) and its context size."""
        e = self._entries.get(key)
        if e is None:
            e = self._entries[key] = SessionEntry(last_seen=now)
        new_tokens = e.tokens if tokens is None else tokens
        if (home is not None and home != e.home) or new_tokens != e.tokens:
            self._account(e.home, -1, -e.tokens)
            if home is not None:
                e.home = home
            e.tokens = new_tokens
            self._account(e.home, 1, e.tokens)
        e.last_seen = now
        return e

    def begin(self, key: str, home: str | None, *, force: bool, tokens: int, now: float) -> str | None:
        """A request of `key` is dispatched: `assign`, and count it in flight."""
        assigned = self.assign(key, home, force=force, tokens=tokens, now=now)
        self._entries[key].in_flight += 1
        return assigned

    def acquire(self, key: str, now: float) -> None:
        """Count a request of `key` in flight before its replica is chosen (see `assign`)."""
        self.touch(key, now).in_flight += 1

    def assign(self, key: str, home: str | None, *, force: bool, tokens: int, now: float) -> str | None:
        """A request of `key` goes to a replica: set the session's home unless it already has one
        (or `force`, a rehome) and note its context size. Returns the session's home."""
        entry = self._entries.get(key)
        keep = entry is not None and entry.home is not None and not force
        return self.touch(key, now, home=None if keep else home, tokens=tokens).home

    def set_home(self, key: str, home: str, now: float) -> None:
        self.touch(key, now, home=home)

    def release(self, key: str, now: float) -> None:
        e = self._entries.get(key)
        if e is not None:
            e.in_flight = max(0, e.in_flight - 1)
            e.last_seen = now

    def sessions_of(self, replica: str) -> list[tuple[str, SessionEntry]]:
        return [(k, e) for k, e in self._entries.items() if e.home == replica]

    def forget(self, key: str) -> None:
        e = self._entries.pop(key, None)
        if e is not None:
            self._account(e.home, -1, -e.tokens)

    def expire(self, now: float) -> int:
        """Forget idle sessions past their TTL; returns how many."""
        dead = [k for k, e in self._entries.items() if e.in_flight == 0 and now - e.last_seen > self.ttl_s]
        for key in dead:
            self.forget(key)
        return len(dead)
