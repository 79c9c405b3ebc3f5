"""What the router learns from the usage each replica reports (router/usage.py), on its control
side: fed by `Placement.reported` after a response, read when a request is summarized.

- Calibration: bytes of the prompt (as the router renders it, router/prefix.py) per reported
  prompt token, per model (the request's prompt size) and per replica (the shadow index's block
  size in tokens, hence its capacity in blocks). Starts at 4, a guess that the first report
  replaces (averaged in as a report, it kept a model at 8 bytes per token at 6 after one report
  and 7.6 after ten, while a fleet's first sessions were placed); then the running mean of the
  reports until `ewma_weight` takes over, clamped to [1, 16], so one odd prompt cannot throw it.
  A replica's own estimate starts from its model's (counted as one report once the model has
  some) and is used once it has MIN_OWN_REPORTS reports; until then the replica follows the
  model's, so prompt sizes and index matches share one unit.
- Index correction: a replica that reports fewer cached tokens than the index predicted evicted
  them, so it keeps less than the index holds for it: without a reported `max_total_num_tokens`,
  its effective capacity is learned (what the index holds minus what the engine had dropped; held
  plus the surplus when it reports more) and the index, shrunk to it, drops that replica's oldest
  entries as an LRU engine did. The request's own prompt is not trimmed: the engine has just
  cached it again.
- Eviction order: the index trims a conversation from its end, as SGLang's radix cache evicts
  leaves. An engine keeping a plain LRU of pages touched root first evicts it from its root, and
  nothing past the root matches then. A reported hit clearly short of the index's match votes
  (`ShadowKVIndex.match_split`): the conversation's first blocks without its end is a leaf-first
  engine's answer; only what other conversations hold of the prompt (a shared system prompt) a
  root-first one's, counted only where the index had begun to evict that conversation itself
  (trimmed it) and still matched at least half of it (a conversation it held whole that the
  engine lost says the engine holds less than the index thinks, whatever its order). With
  ROOT_FIRST_MIN_VOTES root-first votes and ROOT_FIRST_MAJORITY times as many as leaf-first
  ones the index evicts that replica's conversations whole from then on (such a miss is not
  taken for a smaller capacity); LEAF_FIRST_SETTLED leaf-first votes, at least as many as
  root-first ones, settle it leaf-first (no more asking). A report that lost most of what other
  conversations hold (a flush, a restart) starts the learning anew.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .summary import BYTES_PER_TOKEN
from .usage import UsageReport

if TYPE_CHECKING:
    from ..metrics.router_metrics import RouterMetrics
    from .kv_index_shadow import ShadowKVIndex

log = logging.getLogger("kvrouter.learning")

DEFAULT_BYTES_PER_TOKEN = float(BYTES_PER_TOKEN)  # the summary's estimate until reports come
MIN_BYTES_PER_TOKEN, MAX_BYTES_PER_TOKEN = 1.0, 16.0
# Shorter prompts are mostly chat template: their ratio says little about the tokenizer.
MIN_CALIBRATION_BYTES = 256
# A replica's own ratio is trusted once it has this many reports. Until then its block size
# follows its model's ratio, which every replica's reports feed: while the two converge at
# different speeds the prompt size (model ratio) and what the index says a replica holds (the
# replica's ratio) would be in different units, and a home still holding a session would look
# as if it had lost it (coding_agent's `rehome_evicted`).
MIN_OWN_REPORTS = 16
# Replicas following their model's ratio get its new value when it moved by more than this.
FOLLOW_STEP = 0.01
# Votes that make a replica's engine root-first. A leaf-first engine evicting the rest of a
# conversation at once (a large prompt needing the room) would vote root-first too, so few
# leaf-first votes may come with them: a root-first engine never keeps a conversation's start
# without its end (but where a sibling conversation holds the start). Live, the simulated radix
# replica's shortfalls were all leaf-first, the minimal replica's all root-first.
ROOT_FIRST_MIN_VOTES = 3
ROOT_FIRST_MAJORITY = 4
LEAF_FIRST_SETTLED = 16
ORDER_MIN_FILL = 0.5
# A shortfall votes only past this share of the match (and two blocks): the calibrated block
# size is off by a percent or so, which is many blocks of a long prompt.
ORDER_SHORTFALL = 0.02
# A vote needs this many times that slack of the conversation's own matched blocks (room for
# either answer), and a report of less than this share of what other conversations hold is a
# flush or a restart, not an eviction (a root-first engine keeps what is in use).
ORDER_MIN_OWN = 4
FLUSH_KEPT = 0.5
# A root-first vote needs the index to have matched at least this share of the conversation's
# own blocks in the prompt.
ROOT_VOTE_KEPT = 0.5


class _Ewma:
    __slots__ = ("value", "count", "reports")

    def __init__(self, value: float, weight_of_start: int = 1) -> None:
        self.value = value
        self.count = weight_of_start  # observations the starting value counts as (0: a guess)
        self.reports = 0

    def add(self, x: float, weight: float) -> float:
        self.count += 1
        self.reports += 1
        w = max(weight, 1.0 / self.count)  # a running mean until the EWMA weight takes over
        self.value += w * (x - self.value)
        return self.value


def _ratio_estimate(table: dict[str, _Ewma], key: str) -> _Ewma:
    est = table.get(key)
    if est is None:
        est = table[key] = _Ewma(DEFAULT_BYTES_PER_TOKEN, weight_of_start=0)
    return est


class UsageLearner:
    def __init__(
        self,
        *,
        block_chars: int,
        weight: float = 0.1,
        calibrate: bool = True,
        index: ShadowKVIndex | None = None,
        metrics: RouterMetrics | None = None,
        learn_order: bool = True,
    ) -> None:
        self.block_chars = block_chars
        self.learn_order = learn_order  # learn each replica's eviction order (off: leaf first)
        self.weight = weight
        self.calibrate = calibrate
        self.index = index  # the shadow index (None with the exact one: it counts real tokens)
        self.metrics = metrics
        self._per_model: dict[str, _Ewma] = {}
        self._per_replica: dict[str, _Ewma] = {}
        self._capacity: dict[str, _Ewma] = {}  # learned effective KV capacity, tokens
        # Replicas with fewer than MIN_OWN_REPORTS reports -> their model (they use its ratio),
        # and the model ratio last given to their index entries.
        self._following: dict[str, str] = {}
        self._followed_value: dict[str, float] = {}
        self._order_votes: dict[str, list[int]] = {}  # replica -> [root-first, leaf-first] votes
        self._order_settled: set[str] = set()  # replicas found leaf-first

    # -- read side -----------------------------------------------------------------------------
    def bytes_per_token(self, model: str | None) -> float:
        est = self._per_model.get(model or "")
        return est.value if est is not None else DEFAULT_BYTES_PER_TOKEN

    def replica_bytes_per_token(self, replica: str) -> float:
        """The replica's own estimate once it has MIN_OWN_REPORTS reports; before, its model's."""
        model = self._following.get(replica)
        if model is not None:
            return self.bytes_per_token(model)
        est = self._per_replica.get(replica)
        return est.value if est is not None else DEFAULT_BYTES_PER_TOKEN

    def learns_order(self, replica: str) -> bool:
        """Whether a request's `match_split` (~10 us for a 100k-token prompt) is worth taking
        for `replica`: the shadow index only, until the replica is settled leaf-first (a
        root-first one is still asked: a flush or restart learns its order again), and while
        the index holds at least ORDER_MIN_FILL of its capacity (an engine evicts only with its
        pool full; the index's idea of it is seldom far below)."""
        index = self.index
        return (self.learn_order and index is not None and replica not in self._order_settled
                and index.fill(replica) >= ORDER_MIN_FILL)

    def match_split(self, replica: str, prefix_blocks: Sequence[int]) -> tuple[int, int, bool] | None:
        assert self.index is not None
        return self.index.match_split(replica, prefix_blocks)

    def order_votes(self, replica: str) -> tuple[int, int]:
        """(root-first, leaf-first) votes the replica's reports cast so far."""
        root, leaf = self._order_votes.get(replica, (0, 0))
        return root, leaf

    def learned_capacity(self, replica: str) -> int | None:
        est = self._capacity.get(replica)
        return int(est.value) if est is not None else None

    # -- write side ----------------------------------------------------------------------------
    def ignored(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.count(self.metrics.usage_ignored, (reason,))

    def observe(
        self,
        replica: str,
        model: str | None,
        report: UsageReport,
        *,
        prompt_bytes: int,
        predicted_cached: int | None,
        prefix_blocks: Sequence[int],
        match_split: tuple[int, int, bool] | None = None,
    ) -> None:
        """One response's usage. `prompt_bytes`: the prompt text's size (0 when the prompt was
        token ids or tokenized exactly: nothing to calibrate); `predicted_cached`: the index's
        cached-token estimate for this replica when the request was placed (None: none made);
        `match_split`: the index's `match_split` of the prompt when the replica took it."""
        if self.calibrate and prompt_bytes >= MIN_CALIBRATION_BYTES and report.prompt_tokens > 0:
            self._calibrate(replica, model, prompt_bytes / report.prompt_tokens)
        if report.cached_tokens is None:
            self.ignored("no_cache_report")
            return
        if predicted_cached is None:
            return
        m = self.metrics
        if m is not None:  # deferred counts (RouterMetrics.count): a dict add each
            m.count(m.cached_predicted, (replica,), predicted_cached)
            m.count(m.cached_reported, (replica,), report.cached_tokens)
            if report.prompt_tokens:
                m.observe(m.cache_prediction_error, (),
                          (report.cached_tokens - predicted_cached) / report.prompt_tokens)
        if self.index is not None and prefix_blocks:
            if match_split is not None and self._vote_order(replica, report.cached_tokens, match_split,
                                                            len(prefix_blocks)):
                return  # the miss is the eviction order's, not a smaller capacity's
            self._correct(replica, report, predicted_cached)

    def _calibrate(self, replica: str, model: str | None, ratio: float) -> None:
        ratio = min(MAX_BYTES_PER_TOKEN, max(MIN_BYTES_PER_TOKEN, ratio))
        key = model or ""
        model_est = _ratio_estimate(self._per_model, key)
        own = self._per_replica.get(replica)
        if own is None:  # a new replica starts from what its model's replicas report, not 4
            own = self._per_replica[replica] = _Ewma(model_est.value, weight_of_start=min(1, model_est.count))
        value = model_est.add(ratio, self.weight)
        if self.metrics is not None:
            self.metrics.child(self.metrics.bytes_per_token, key).set(value)
        own.add(ratio, self.weight)
        if own.reports < MIN_OWN_REPORTS:
            self._following[replica] = key
        else:
            self._following.pop(replica, None)
        if self.index is not None:
            self.index.set_block_tokens(replica, self.block_chars / self.replica_bytes_per_token(replica))
            self._move_followers(key, value)

    def _move_followers(self, model: str, value: float) -> None:
        """Replicas still on their model's ratio take its new value (once it moved by more than
        FOLLOW_STEP: only while replicas are new, and rarely then)."""
        last = self._followed_value.get(model)
        if last is not None and abs(value - last) <= FOLLOW_STEP * last:
            return
        self._followed_value[model] = value
        assert self.index is not None
        for replica, followed in self._following.items():
            if followed == model:
                self.index.set_block_tokens(replica, self.block_chars / value)

    def _vote_order(self, replica: str, reported: int, match_split: tuple[int, int, bool],
                    prompt_blocks: int) -> bool:
        """A reported hit short of the index's match (`matched` blocks, `others` of them held by
        other conversations; the conversation the match ends in `trimmed` by the index) votes
        for the engine's eviction order. True if the miss is not the engine holding less than
        the index thinks: a root-first vote, or a flush."""
        index = self.index
        assert index is not None
        block = index.block_tokens_of(replica)
        matched, others, trimmed = match_split
        if others >= 2 and reported < FLUSH_KEPT * others * block:
            # It lost even most of what other, recently used conversations hold: a flush or a
            # restart, which tells nothing of the order (and may be another engine now).
            log.info("replica %s lost even its shared prefixes (flushed or restarted): its "
                     "eviction order is learnt again", replica)
            self.forget_order(replica)
            return True
        # Blocks the calibrated block size and page rounding can be off by: a vote needs a
        # shortfall past them, and room for either answer within the conversation's own blocks.
        slack = max(2.0, ORDER_SHORTFALL * matched)
        own = matched - others  # the matched blocks only the conversation the match ends in held
        if own < ORDER_MIN_OWN * slack or reported > (matched - slack) * block:
            return False
        votes = self._order_votes.setdefault(replica, [0, 0])
        if reported <= (others + slack) * block:  # nothing past what others hold
            if not trimmed or own < ROOT_VOTE_KEPT * (prompt_blocks - others):
                return False  # held whole by the index, or mostly gone from it too: either order
            votes[0] += 1
            if (not index.root_first(replica) and votes[0] >= ROOT_FIRST_MIN_VOTES
                    and votes[0] >= ROOT_FIRST_MAJORITY * votes[1]):
                self._set_root_first(replica, True)
                log.info("replica %s evicts conversations from their root (%d votes to %d): its "
                         "index entries follow", replica, votes[0], votes[1])
            return True
        if reported >= (others + 2 * slack) * block:  # its start kept, its end gone: leaf first
            votes[1] += 1
            if votes[1] >= LEAF_FIRST_SETTLED and votes[1] >= votes[0]:
                self._order_settled.add(replica)
                if index.root_first(replica):  # it was wrong: back to what the index assumes
                    self._set_root_first(replica, False)
        return False

    def _set_root_first(self, replica: str, root_first: bool) -> None:
        assert self.index is not None
        self.index.set_root_first(replica, root_first)
        if self.metrics is not None:
            self.metrics.child(self.metrics.kv_root_first, replica).set(int(root_first))

    def forget_order(self, replica: str) -> None:
        """Start learning the replica's eviction order anew (it was flushed, restarted or
        removed), leaf first until its reports show otherwise."""
        self._order_votes.pop(replica, None)
        self._order_settled.discard(replica)
        if self.index is not None and self.index.root_first(replica):
            self._set_root_first(replica, False)

    def _correct(self, replica: str, report: UsageReport, predicted: int) -> None:
        """Learn the replica's effective capacity from a cache hit the index got wrong by a
        block or more (used by the index only if the replica reports no capacity of its own)."""
        index = self.index
        assert index is not None and report.cached_tokens is not None
        block = index.block_tokens_of(replica)
        diff = report.cached_tokens - predicted
        if abs(diff) < block:
            return
        held = index.cached_tokens(replica)
        estimate = max(held + diff, report.prompt_tokens, block)
        est = self._capacity.get(replica)
        current = est.value if est is not None else index.capacity_tokens(replica)
        if diff < 0 and est is None:
            current = min(current, held)  # it evicted while holding less than the index does
        if (diff < 0) != (estimate < current):
            return  # a miss never raises the estimate, a surplus never lowers it
        if est is None:
            est = self._capacity[replica] = _Ewma(current)
        index.set_learned_capacity(replica, int(est.add(estimate, self.weight)))
