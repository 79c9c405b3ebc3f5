"""One request's routing lifecycle, shared by the live relay and the cluster simulator.

`RoutingEngine.place` decides and, in the same synchronous step, reserves the chosen replica's
in-flight slot (registry, in-flight gauge, decisions counter): the next decision, even one made
while this request still waits on the affinity store, sees it. Then, in order:

1. `confirm_home` (async store) or `confirm_home_now` (the synchronous in-memory store): record the
   session's home. A new session's first home goes to the first writer, a rehome overwrites, a
   retry placed elsewhere moves the home; if another request or router already gave the session a
   healthy home, the request follows it (the reservation moves with it).
2. `accepted()`: the replica answered; it will cache the prompt (KV index, cached-token metrics).
3. `done()`: the slot is released, exactly once; call it from a `finally` right after `place`.

`retry()` places the request again, away from every replica tried so far. The session's home is
claimed once per request (on its first placement); a retry that lands elsewhere moves it.

Outcome calls keep the replica's health and the retry counters with the routing, so the relay
only sends, retries and streams: `unreachable(kind)` (never got the request), `broke(kind)`
(it got the request, then timed out or broke off: never retried),
`answered()` (a response head came back), `refused(status)` (a 502/503 that goes elsewhere),
`reported(usage)` (the usage the replica reported with its answer, for the engine's learner).
`RequestRoute` (from `RoutingEngine.route`) wraps a request's placements in its session:
acquired on entry, ended exactly once on exit.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..policies.domain import Decision, Policy, RequestSummary, SessionView, Snapshot
from ..policies.predict import Prediction
from ..policies.slots import slot_setters
from .usage import UsageReport

if TYPE_CHECKING:
    from .decode_pool import DecodeSlot
    from .engine import RoutingEngine

log = logging.getLogger("kvrouter.placement")

# What deferred notes are worked out from: the decision's snapshot, the request, the decision and
# the shadow policies asked about it (`RoutingEngine.notes`).
PendingNotes = tuple[Snapshot, RequestSummary, Decision, tuple[tuple[str, Policy], ...]]


class HomeStore(Protocol):
    """The affinity store's home calls, as `router/affinity.py` stores implement them (async)."""

    async def begin(self, key: str, home: str | None, *, force: bool, tokens: int) -> str | None: ...
    async def move(self, key: str, home: str) -> None: ...


class SessionStore(HomeStore, Protocol):
    """The affinity store's per-request session calls (`RequestRoute`)."""

    async def acquire(self, key: str) -> SessionView: ...
    async def end(self, key: str) -> None: ...


class HomeStoreNow(Protocol):
    """The same calls, synchronous: the in-memory store (`affinity.LocalAffinity`)."""

    def begin(self, key: str, home: str | None, *, force: bool, tokens: int) -> str | None: ...
    def move(self, key: str, home: str) -> None: ...


@dataclass(frozen=True, slots=True)
class HomeClaim:
    """The request's first placement: the store's `begin` (set the home unless there is one, or
    `force`; note the context size; the stored home comes back)."""

    key: str
    home: str | None
    force: bool
    tokens: int


@dataclass(frozen=True, slots=True)
class HomeMove:
    """A retry put the session's KV on another replica: the store's `move`."""

    key: str
    home: str


@dataclass(frozen=True, slots=True, init=False)
class DecisionNotes:
    """What a decision predicted (`chosen`) and, per shadow policy, its name, its decision (None:
    no replica) and that decision's prediction: for the decision log, tracing and shadow metrics."""

    policy: str
    chosen: Prediction
    shadows: tuple[tuple[str, Decision | None, Prediction | None], ...] = ()
    candidates: int = 0  # replicas the policy could choose from (healthy, not tried yet)

    def __init__(self, policy: str, chosen: Prediction,
                 shadows: tuple[tuple[str, Decision | None, Prediction | None], ...] = (),
                 candidates: int = 0) -> None:
        # Made for every decision noted: see `slot_setters`.
        _set_policy(self, policy)
        _set_chosen(self, chosen)
        _set_shadows(self, shadows)
        _set_candidates(self, candidates)


_set_policy, _set_chosen, _set_shadows, _set_candidates = slot_setters(
    DecisionNotes, "policy", "chosen", "shadows", "candidates")


class Placement:
    """One attempt of one request on one replica. Built by `RoutingEngine.place`, which has
    already reserved the replica's in-flight slot. What happened to it (time to first byte, the
    usage reported, why it broke off) is kept for the decision log and tracing."""

    __slots__ = ("engine", "summary", "session", "decision", "url", "target", "tried", "notes",
                 "ttfb_s", "usage", "error", "predicted_ttft_s",
                 "rank", "decode", "_claimed_home", "_began", "_claim_pending", "_held", "_accepted",
                 "_counted", "_registration", "_prefill_tokens", "sent_at", "_pending_notes",
                 "_defer_notes", "_match_split")

    def __init__(
        self,
        engine: RoutingEngine,
        summary: RequestSummary,
        session: SessionView | None,
        decision: Decision,
        *,
        target: str | None = None,
        retry_of: Placement | None = None,
        notes: DecisionNotes | None = None,
    ) -> None:
        self.engine = engine
        self.notes = notes  # with engine.explain on or the shadows asked about this decision; else None
        # (snapshot, summary, decision, shadows asked) of notes not worked out yet (`settle_notes`);
        # whether this attempt's retries defer theirs too
        self._pending_notes: PendingNotes | None = None
        self._defer_notes = False
        self.ttfb_s: float | None = None  # dispatch to the replica's first response byte
        self.sent_at: float | None = None  # when the relay sent it (its clock), once it did
        self.usage: UsageReport | str | None = None  # as reported (or why not)
        self.error: str | None = None  # why this attempt failed (unreachable or broke off)
        self.summary = summary  # with the KV-index match filled in
        self.session = session  # as read before the request's first placement
        self.decision = decision
        self.url = decision.replica  # where the request goes (confirm_home may change it)
        self.target = target  # a routing hint: one attempt, no policy
        # Replicas earlier attempts of this request went to; whether one of them claimed the
        # session's home already, and the home that claim left in the store.
        self.tried: frozenset[str] = frozenset()
        self._began = False
        self._claimed_home: str | None = None
        if retry_of is not None:
            self.tried = retry_of.tried | {retry_of.url}
            self._began, self._claimed_home = retry_of._began, retry_of._claimed_home
        self._claim_pending = summary.session_key is not None
        self._held = False
        self._accepted = False
        self._match_split: tuple[int, int, bool] | None = None  # see `accepted`
        # The request's prompt is in the prompt-token counters already: a PD pair whose prefill
        # half served it, then failed on its decode half, is retried without counting it again.
        self._counted = retry_of._counted if retry_of is not None else False
        # The cost model's TTFT for this attempt, when admission control predicted one: compared
        # with the first byte's time (`first_byte`) to calibrate its predictions.
        self.predicted_ttft_s: float | None = None
        self.rank: int | None = None  # DP-attention rank on the replica (routing.dp_size > 1)
        self.decode: DecodeSlot | None = None  # PD: the decode server this attempt was paired with
        self._reserve(self.url)

    # -- in-flight slot ----------------------------------------------------------------------------
    def _reserve(self, url: str) -> None:
        self._registration = self.engine.registry.registration(url)
        self._prefill_tokens = self._uncached_tokens(url)
        self.engine.registry.dispatched(url, self.summary.prompt_tokens, self._prefill_tokens)
        ranks = self.engine.ranks
        if ranks is not None:  # the rank follows the replica (a home found elsewhere moves both)
            self.rank = ranks.choose(url, self.summary.prefix_blocks)
            ranks.dispatched(url, self.rank)
        m = self.engine.metrics
        if m is not None:
            m.count(m.in_flight, (url,), 1)
        self._held = True

    def _release(self, url: str, served: bool = True) -> None:
        registry, m = self.engine.registry, self.engine.metrics
        if registry.registration(url) == self._registration:
            registry.completed(url, self.summary.prompt_tokens, self._prefill_tokens)
            if self.engine.ranks is not None and self.rank is not None:
                self.engine.ranks.completed(url, self.rank)
            if m is not None:
                m.count(m.in_flight, (url,), -1)
        elif m is not None and url not in registry:  # removed while this request ran: drop
            m.forget_children(url)  # the series it recreated since
        # else removed and added back: the slot was on the old registration, gone with it
        self._held = False
        self._prefill_tokens = 0
        if self.engine.on_release is not None:  # served to its end, or a slot freed otherwise
            self.engine.on_release(url, self._accepted and served)

    def _uncached_tokens(self, url: str) -> int:
        """The prompt tokens the KV index does not see cached on `url`: the prefill this attempt
        puts on it (pending until its first byte). None for an answer that is not streamed:
        its first byte comes at its end, long after its prefill."""
        summary = self.summary
        if not summary.streamed:
            return 0
        cached = summary.cached_tokens.get(url, 0) if summary.cached_tokens else 0
        on_host = summary.host_cached_tokens.get(url, 0) if summary.host_cached_tokens else 0
        return max(0, summary.prompt_tokens - cached - on_host)

    def prefill_answered(self) -> None:
        """The replica answered this attempt's first byte: its prefill is no longer work ahead
        of the next request there (`ReplicaView.pending_prefill_tokens`). Idempotent."""
        tokens, self._prefill_tokens = self._prefill_tokens, 0
        registry = self.engine.registry
        if tokens and self._held and registry.registration(self.url) == self._registration:
            registry.prefill_answered(self.url, tokens)

    def defer_notes(self, pending: PendingNotes | None) -> None:
        """`RoutingEngine.commit(defer_notes=True)`: the decision's notes are worked out by
        `settle_notes` (`pending`: what they are worked out from; None: no notes to make), and
        this attempt's retries defer theirs too."""
        self._pending_notes = pending
        self._defer_notes = True

    def settle_notes(self) -> None:
        """Work out deferred notes now (counting the shadow metrics). Idempotent. A fault here
        is logged, never the request's: the notes are only observability."""
        pending, self._pending_notes = self._pending_notes, None
        if pending is not None:
            try:
                self.notes = self.engine.notes(*pending)
            except Exception:
                log.exception("decision notes for %s failed", self.url)

    @property
    def held(self) -> bool:
        """The replica's in-flight slot is still reserved for this attempt."""
        return self._held

    def done(self, served: bool = True) -> None:
        """The attempt is over (answered, failed or cancelled): release the slot. Idempotent.
        `served=False`: whatever it accepted, it did not serve the request (a PD prefill half
        whose decode half failed), so admission counts no completion."""
        self.settle_notes()  # (a no-op unless deferred, and the attempt never got as far as sending)
        if self._held:
            self._release(self.url, served)

    # -- the session's home ------------------------------------------------------------------------
    def home_claim(self) -> HomeClaim | HomeMove | None:
        """What the affinity store must record now, or None (no session, or nothing new)."""
        if not self._claim_pending:
            return None
        key = self.summary.session_key
        assert key is not None
        home = self.decision.home
        if not self._began:
            # A session without a home gets the replica of its first request (policies that do
            # not assign homes too, so sessions per replica can be counted for every policy); a
            # decision naming a new home replaces an old one (rehome, or a fallback away from an
            # unusable home); a brand-new session's home goes to the first writer.
            current = self.session.home if self.session is not None else None
            return HomeClaim(key, home or (self.url if self.target is None else None),
                             force=self.decision.replaces_home(current), tokens=self.summary.prompt_tokens)
        if home is not None and home != self._claimed_home:
            return HomeMove(key, home)  # its KV will live there, so its home too
        return None

    def home_recorded(self, claim: HomeClaim | HomeMove, stored: str | None) -> None:
        """The store recorded `claim` and now holds `stored` as the session's home. If another
        request or router set a healthy home first, this request follows it there."""
        self._claim_pending = False
        self._began = True
        self._claimed_home = stored
        if self.engine.on_home is not None and stored is not None:
            self.engine.on_home(claim.key, stored, None if isinstance(claim, HomeMove) else claim.tokens)
        if isinstance(claim, HomeMove):
            return
        if (self.decision.home is not None and stored not in (None, self.url)
                and self.engine.registry.healthy(stored) and self._held):
            self._release(self.url)
            self.url = stored
            self._reserve(stored)

    @property
    def home_pending(self) -> bool:
        """The session's home may still need recording (`confirm_home` has something to do)."""
        return self._claim_pending

    async def confirm_home(self, store: HomeStore) -> None:
        """Record the session's home in an async affinity store (one round trip at most)."""
        claim = self.home_claim()
        if claim is None:
            return
        self._began = True  # even if the call is cancelled: the home is claimed once per request
        if isinstance(claim, HomeMove):
            await store.move(claim.key, claim.home)
            self.home_recorded(claim, claim.home)
        else:
            self.home_recorded(claim, await store.begin(claim.key, claim.home, force=claim.force,
                                                        tokens=claim.tokens))

    def confirm_home_now(self, store: HomeStoreNow) -> None:
        """`confirm_home` for the synchronous in-memory store (the simulator)."""
        claim = self.home_claim()
        if claim is None:
            return
        if isinstance(claim, HomeMove):
            store.move(claim.key, claim.home)
            self.home_recorded(claim, claim.home)
        else:
            self.home_recorded(claim, store.begin(claim.key, claim.home, force=claim.force,
                                                  tokens=claim.tokens))

    # -- outcome -------------------------------------------------------------------------------------
    def unreachable(self, kind: str) -> None:
        """The replica never got the request (`kind`: connect, connect_timeout): a failure
        against its health, an upstream error and a retry (counted even on the last attempt)."""
        self.error = kind
        self.engine.registry.record_failure(self.url)
        self._count_error(kind, retried=True)

    def broke(self, kind: str) -> None:
        """The replica got the request, then the exchange failed: a timeout (header, idle,
        total), a body cut off, an SSE event past the cap. An upstream error; never retried (it
        may still be working on it) and never held against its health."""
        self.error = kind
        self._count_error(kind, retried=False)

    def answered(self) -> None:
        """The replica sent a response head: it is reachable (any status)."""
        self.engine.registry.record_success(self.url)

    def refused(self, status: int) -> None:
        """It answered a retryable status (502/503) before a byte reached the client, and the
        request goes elsewhere: an upstream error and a retry."""
        self._count_error(f"http_{status}", retried=True)

    def _count_error(self, kind: str, *, retried: bool) -> None:
        m = self.engine.metrics
        if m is not None:
            m.child(m.upstream_errors, self.url, kind).inc()
            if retried:
                m.child(m.retries, kind).inc()

    def first_byte(self, seconds: float, streamed: bool = True) -> None:
        """The answer's first body bytes came `seconds` after the request was sent. Only a
        streamed answer's first byte is its time to first token (a plain body comes whole at the
        end), so only that one calibrates admission's TTFT predictions."""
        self.ttfb_s = seconds
        self.prefill_answered()
        hook = self.engine.on_first_byte
        if streamed and hook is not None and self.predicted_ttft_s is not None:
            hook(self.predicted_ttft_s, seconds)

    def accepted(self) -> None:
        """The replica is serving the request (a 2xx answer): it will cache the prompt."""
        if self._accepted:
            return
        self._accepted = True
        summary, url = self.summary, self.url
        if summary.prefix_blocks:
            learner = self.engine.learner
            if learner is not None and self.target is None and learner.learns_order(url):
                # Before the record takes the prompt's blocks: whose they were tells, with the
                # reported hit, the engine's eviction order (a hinted target has no prediction
                # to compare the hit with).
                self._match_split = learner.match_split(url, summary.prefix_blocks)
            self.engine.index.record(url, summary.prefix_blocks)
            if self.engine.on_record is not None:
                self.engine.on_record(url, summary.prefix_blocks)
        if self.engine.ranks is not None and self.rank is not None:
            self.engine.ranks.served(url, self.rank, summary.prefix_blocks)
        m = self.engine.metrics
        counted, self._counted = self._counted, True
        if m is not None and summary.prompt_tokens and not counted:
            m.count(m.prompt_tokens, (), summary.prompt_tokens)
            cached = min(summary.prompt_tokens, summary.cached_tokens.get(url, 0))
            if cached:
                m.count(m.est_cached_tokens, (), cached)

    def reported(self, usage: UsageReport | str, prompt_bytes: int = 0) -> None:
        """The replica's usage for this request (router/usage.py), or why there is none: the
        engine's learner calibrates and corrects the KV index from it. `prompt_bytes`: the
        prompt text's size (0: nothing to calibrate)."""
        self.usage = usage
        learner = self.engine.learner
        if learner is None:
            return
        if isinstance(usage, str):
            learner.ignored(usage)
            return
        url = self.url
        # A hinted target skipped the index match: there is no prediction to compare with.
        predicted = None if self.target is not None else min(
            usage.prompt_tokens, self.summary.cached_tokens.get(url, 0))
        learner.observe(url, self.summary.model, usage, prompt_bytes=prompt_bytes,
                        predicted_cached=predicted, prefix_blocks=self.summary.prefix_blocks,
                        match_split=self._match_split)

    def again(self) -> Placement | None:
        """Release this attempt and place the request on the same replica once more (PD: the
        other half of its pair failed; this replica did its part and holds the prompt's KV).
        None if the replica is no longer healthy. The same decision: its notes (decision log,
        tracing) and admission's TTFT prediction carry over."""
        self.done(served=False)
        if not self.engine.registry.healthy(self.url):
            return None
        again = Placement(self.engine, self.summary, self.session, self.decision,
                          target=self.target, retry_of=self, notes=self.notes)
        again.predicted_ttft_s = self.predicted_ttft_s
        return again

    def retry(self) -> Placement | None:
        """Release this attempt and place the request again, away from every replica tried so
        far; None if nothing is left (or the request was pinned to a hinted target)."""
        self.done(served=False)
        if self.target is not None:
            return None
        summary = dataclasses.replace(self.summary, exclude=self.tried | {self.url})
        return self.engine.place(summary, self.session, retry_of=self, defer_notes=self._defer_notes)


class RequestRoute:
    """One request's routing, as an async context manager: entering reads the session and counts
    the request in it (`acquire`), leaving ends it there, exactly once. In between, `place()`
    gives the first placement and `Placement.retry()` the next ones.

    If `acquire` is cancelled it counts nothing and raises, and `async with` then never calls
    `__aexit__`: a session is ended only if it was acquired. Requests without a session key
    touch the store only to confirm nothing."""

    __slots__ = ("engine", "store", "summary", "target", "session", "last", "_key")

    def __init__(
        self, engine: RoutingEngine, store: SessionStore, summary: RequestSummary, target: str | None
    ) -> None:
        self.engine = engine
        self.store = store
        self.summary = summary
        self.target = target
        self.session: SessionView | None = None
        self.last: Placement | None = None  # the latest attempt the transport made (logging)
        self._key: str | None = None  # set while the store counts this request

    async def __aenter__(self) -> RequestRoute:
        key = self.summary.session_key
        if key is not None:
            self.session = await self.store.acquire(key)
            self._key = key
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        key, self._key = self._key, None
        if key is not None:
            await self.store.end(key)

    def place(self, *, defer_notes: bool = False) -> Placement | None:
        """The request's first placement (its slot reserved), or None if no replica can take it.
        `defer_notes`: see `RoutingEngine.commit`."""
        return self.engine.place(self.summary, self.session, self.target, defer_notes=defer_notes)
