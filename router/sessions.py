"""The local session table: each session's home, in-flight count and last context size, plus the
per-replica totals policies read (homed sessions and their KV demand). Synchronous; the clock is
passed in, so the cluster simulator drives it in virtual time.

The table holds at most `max_sessions` entries (clients choose session ids, so without a cap they
choose the router's memory too). Entries are kept in least-recently-used order, a request moving
its session to the end, so making room evicts from the front in O(1) amortised. A session with a
request in flight is never evicted: it is moved to the end instead (it is in use), and if only
busy sessions are found within a few steps the table stays over the cap until the next insert."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from ..policies.domain import SessionView


@dataclass(slots=True)
class SessionEntry:
    home: str | None = None
    in_flight: int = 0
    tokens: int = 0  # last prompt size: the KV this session needs at home
    last_seen: float = 0.0


DEFAULT_MAX_SESSIONS = 1_000_000
# Entries looked at per insert when making room: busy ones are moved to the end, so this bounds
# the work per request when many sessions at the front are in flight (the cap is then exceeded
# until a later insert finds idle ones).
_EVICT_STEPS = 8


class SessionTable:
    def __init__(self, ttl_s: float = 3600.0, on_home_change: Callable[[str], None] | None = None,
                 *, max_sessions: int = DEFAULT_MAX_SESSIONS,
                 on_evict: Callable[[int], None] | None = None):
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._entries: OrderedDict[str, SessionEntry] = OrderedDict()  # least recently used first
        self.evicted = 0  # sessions dropped to stay under max_sessions
        self.on_evict = on_evict or (lambda n: None)
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
        entries = self._entries
        e = entries.get(key)
        if e is None:
            e = entries[key] = SessionEntry(last_seen=now)
            if len(entries) > self.max_sessions:
                self._make_room(key)
        else:
            entries.move_to_end(key)
        new_tokens = e.tokens if tokens is None else tokens
        if (home is not None and home != e.home) or new_tokens != e.tokens:
            self._account(e.home, -1, -e.tokens)
            if home is not None:
                e.home = home
            e.tokens = new_tokens
            self._account(e.home, 1, e.tokens)
        e.last_seen = now
        return e

    def _make_room(self, keep: str) -> None:
        """Evict least recently used idle sessions until the table is back under its cap, looking
        at `_EVICT_STEPS` entries at most; never `keep` (the session being added)."""
        entries = self._entries
        evicted = 0
        for _ in range(_EVICT_STEPS):
            if len(entries) <= self.max_sessions:
                break
            key, e = next(iter(entries.items()))
            if e.in_flight > 0 or key == keep:
                entries.move_to_end(key)  # in use: its turn comes again after the others
                continue
            del entries[key]
            self._account(e.home, -1, -e.tokens)
            evicted += 1
        if evicted:
            self.evicted += evicted
            self.on_evict(evicted)

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
            self._entries.move_to_end(key)

    def sessions_of(self, replica: str) -> list[tuple[str, SessionEntry]]:
        return [(k, e) for k, e in self._entries.items() if e.home == replica]

    def forget(self, key: str) -> None:
        e = self._entries.pop(key, None)
        if e is not None:
            self._account(e.home, -1, -e.tokens)

    def expire(self, now: float) -> int:
        """Forget idle sessions past their TTL; returns how many."""
        # Entries are in order of last use (touch and release move them to the end), so the walk
        # stops at the first one within the TTL: it costs what expires (plus requests in flight
        # since before the TTL, which are skipped), not the whole table, every second.
        dead = []
        for key, e in self._entries.items():
            if now - e.last_seen <= self.ttl_s:
                break
            if e.in_flight == 0:
                dead.append(key)
        for key in dead:
            self.forget(key)
        return len(dead)
