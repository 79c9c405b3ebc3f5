"""A pure model of one SGLang replica: radix cache + FCFS scheduler + roofline timing.

No I/O, no clock, no randomness: drivers call `submit`/`abort`/`advance` with their own `now`
(non-decreasing) and read `next_event_time` to know when to come back. A submit to an idle
replica sets next_event_time() to `now`: the prefill starts at the next advance(now), so requests
submitted at the same instant share one prefill batch, as SGLang batches what it received together.

Scheduler (after `managers/scheduler.py` and `schedule_policy.PrefillAdder`, default flags):
- FCFS waiting queue. At each forward boundary a prefill batch is built if anything can be
  admitted; it runs instead of decode (no mixed chunks), so running decodes pause meanwhile.
- Admission (PrefillAdder.add_one_req) never looks at the true output length: the queue head
  needs a free slot (< max_running_requests) and
  uncached + host-hit + min(max_new_tokens - generated, clip) + page < free + evictable - offset,
  where offset = new_token_ratio x sum over decoding requests of min(max_new_tokens - generated,
  clip), plus what this batch already took (paged extend + unscaled estimate + a page each).
  The head blocks the queue when it does not fit (no skipping). The decoding sum is a running
  total kept at segment ends, so a check is O(1). max_new_tokens and new_token_ratio: admission.py.
- A prefill batch holds at most chunked_prefill_size new tokens; a longer prompt is cut to a
  page-aligned chunk and continues first in the next batch (one chunked request at a time).
  Each chunk's full pages are inserted into the cache and stay locked (cache_unfinished_req), so a
  concurrent request with the same prefix hits them.
- The prefill forward samples the first token (FirstToken at the end of the last chunk); then
  all decoding requests step together, each step emitting spec_accept_length tokens per request
  (whole tokens: base + floor(k x accept)). Finish inserts the full pages of
  prompt + output - 1 tokens (the last sampled token has no KV yet), then unlocks.
- KV growth is allocated at segment ends. If a decode step would not fit, the request with the
  fewest output tokens (then the longest prompt) is retracted (at least one, then until the rest
  fit the next step): its private pages are freed, its cached prefix unlocked (it stays in the
  tree until evicted; retract_decode_steps x remaining tokens are made free at once), and it
  joins the back of the queue, to be re-prefilled from prompt + output so far.

Decode runs as analytic segments of steps with a constant batch (replica_decode); gauges that
change inside a segment (num_used_tokens) are updated at its end. Request, event and load types:
replica_requests.

`load()` is the instant state; what SGLang *publishes* (the /metrics gauges, the /v1/loads
snapshot, KV-event flushes) changes only at SGLang's own points: `published_metrics()`,
`published_loads()` (replica_publishing, replica_signals).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence

from . import timing
from .admission import NewTokenRatio, resolve_max_new_tokens
from .profiles import Profile
from .radix_cache import KVSink, RadixCache
from .replica_decode import MAX_SEGMENT_STEPS, DecodeMixin
from .replica_publishing import DECODE_STATE, PublishingMixin
from .replica_requests import (
    DECODE, DONE, OP_DECODE, OP_PREFILL, OP_WAKE, PREFILL, WAITING, Finished, FirstToken,
    ModelEvent, ReplicaLoad, ReqState, SimRequest,
)
from .replica_signals import DeferredKVSink, SignalState

__all__ = [
    "MAX_SEGMENT_STEPS", "Finished", "FirstToken", "ModelEvent", "ReplicaLoad", "ReplicaModel",
    "SimRequest",
]

assert DECODE == DECODE_STATE  # the publishing mixin reads request states too



class RequestTooLarge(ValueError):
    """Prompt plus the admission estimate can never fit the KV pool: SGLang refuses such a
    request up front (a 400), it does not queue it forever."""

class ReplicaModel(DecodeMixin, PublishingMixin):
    def __init__(self, profile: Profile, *, kv_sink: KVSink | None = None,
                 publish_loads: bool = True) -> None:
        """`publish_loads=False`: no ``/v1/loads`` snapshot is kept (`published_loads` refuses),
        for a driver that reads only ``/metrics``, as the cluster simulator's poller does."""
        self.profile = profile
        # KV events wait in the deferred sink until SGLang would flush them (replica_signals).
        self._kv = DeferredKVSink(kv_sink) if kv_sink is not None else None
        self.cache = RadixCache(
            profile.page_size, profile.max_total_num_tokens, profile.host_total_num_tokens, self._kv,
            write_through=profile.hicache_write_through,
        )
        self._ps = profile.page_size
        self._cap_pages = profile.max_total_num_tokens // profile.page_size
        self._own_pages = 0
        self._reqs: dict[str, ReqState] = {}
        self._waiting: deque[ReqState] = deque()
        self._active: dict[str, ReqState] = {}  # admitted: prefilling or decoding
        self._decoding: list[ReqState] = []
        self._chunked: ReqState | None = None
        self._done: OrderedDict[str, int] = OrderedDict()
        self._pending: list[ModelEvent] = []
        self._now = 0.0
        # current forward op
        self._op = 0
        self._op_end = 0.0
        self._prefill_items: list[tuple[ReqState, int]] = []
        self._seg_batch: list[ReqState] = []
        self._seg_start = 0.0
        self._seg_dt = 0.0
        self._seg_steps = 0
        self._seg_retracted = False  # the segment's first step retracted (no ratio decay)
        # admission estimate: the ratio, and sum of _estimate(r) over decoding requests
        self._ratio = NewTokenRatio(profile)
        self._est_sum = 0
        # gauges and counters (names follow SGLang's /metrics)
        self.cache_hit_rate = 0.0
        self.gen_throughput = 0.0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_requests_total = 0
        self.num_aborted_requests_total = 0
        self.cached_tokens_device_total = 0
        self.cached_tokens_host_total = 0
        self.load_back_tokens_total = 0
        self.num_retracted_reqs_total = 0
        self.num_retracted_reqs = 0  # retracted by the last retraction (SGLang gauge)
        self.num_retracted_input_tokens_total = 0
        self.num_retracted_output_tokens_total = 0
        # published signals (SGLang's cadence): see replica_signals
        self.decode_tokens_total = 0
        self._batch_hit_rate = 0.0
        self._prefill_running = 0
        self._seg_done = 0  # steps of the current segment already seen by the signals
        self.signals = SignalState(profile, self._pool_state(0), self._kv, publish_loads=publish_loads)

    # ---- public API ----------------------------------------------------------------------------
    def submit(self, req: SimRequest, now: float) -> None:
        self._run_until(now, inclusive=False)
        p = self.profile
        if req.rid in self._reqs:
            raise ValueError(f"duplicate rid {req.rid!r}")
        if req.prompt_len < 1 or req.output_len < 1:
            raise ValueError("prompt_len and output_len must be >= 1")
        max_new = resolve_max_new_tokens(p, req.prompt_len, req.max_new_tokens, req.output_len)
        if req.prompt_len + min(max_new, p.clip_max_new_tokens) + self._ps >= p.max_total_num_tokens:
            raise RequestTooLarge(f"request {req.rid!r} can never fit in {p.max_total_num_tokens} KV tokens")
        r = ReqState(req, self._now, max_new)
        self._reqs[req.rid] = r
        self._waiting.append(r)
        if not self._op:
            # Schedule at `now`, but only once every request submitted at `now` is in the queue:
            # SGLang receives simultaneous requests together and batches their prefill.
            self._op, self._op_end = OP_WAKE, self._now
        elif self._op == OP_DECODE and len(self._active) < p.max_running_requests:
            self._cut_segment(self._now)

    def abort(self, rid: str, now: float) -> bool:
        self._run_until(now, inclusive=False)
        r = self._reqs.get(rid)
        if r is None:
            return False
        if r.state == WAITING:
            self._waiting.remove(r)
        else:
            if r is self._chunked:
                self._chunked = None
            was_decoding = r.state == DECODE
            self._release(r)
            if was_decoding:
                self._est_sum -= self._estimate(r)
                self._decoding.remove(r)
            if self._op == OP_DECODE:
                self._cut_segment(self._now)  # the batch shrinks from the next step
        r.state = DONE
        del self._reqs[rid]
        self.num_aborted_requests_total += 1
        self._note_idle(self._now)
        return True

    def next_event_time(self) -> float | None:
        return self._op_end if self._op else None

    def advance(self, now: float) -> list[ModelEvent]:
        self._run_until(now)
        events, self._pending = self._pending, []
        return events

    def progress(self, rid: str, now: float) -> int:
        r = self._reqs.get(rid)
        if r is None:
            return self._done.get(rid, 0)
        if r.state == DECODE and self._op == OP_DECODE:
            k = math.floor((now - self._seg_start) / self._seg_dt + 1e-9)
            k = min(max(k, 0), self._seg_steps)
            return min(r.sim.output_len, timing.tokens_after_steps(self.profile, r.base, r.dsteps + k))
        return r.gen

    def flush_cache(self) -> bool:
        if self._reqs:
            return False
        self.cache.flush()
        self.signals.idle(self._now, self._pool_state(0))  # idle: the clear is published at once
        return True

    def requests(self) -> int:
        """Running plus queued requests as of the last processed event: `load()`'s
        num_running_reqs + num_queue_reqs without building the rest of it."""
        return len(self._active) + len(self._waiting)

    def load(self, now: float) -> ReplicaLoad:
        """Gauges as of the last processed event (call advance(now) first)."""
        p = self.profile
        ps = self._ps
        available = self._free_pages() * ps
        evictable = self.cache.evictable_tokens
        used = p.max_total_num_tokens - available - evictable  # SGLang _get_token_info
        return ReplicaLoad(
            num_running_reqs=len(self._active),
            num_queue_reqs=len(self._waiting),
            num_used_tokens=used,
            max_total_num_tokens=p.max_total_num_tokens,
            token_usage=used / p.max_total_num_tokens,
            cache_hit_rate=self.cache_hit_rate,
            gen_throughput=self.gen_throughput if self._active else 0.0,
            kv_available_tokens=available,
            kv_evictable_tokens=evictable,
            host_used_tokens=self.cache.host_tokens,
            host_total_tokens=p.host_total_num_tokens,
            spec_accept_length=p.spec_accept_length,
        )

    @property
    def new_token_ratio(self) -> float:
        return self._ratio.current

    @property
    def evicted_tokens_total(self) -> int:
        return self.cache.evicted_pages_total * self._ps

    @property
    def cached_tokens_total(self) -> int:
        return self.cached_tokens_device_total + self.cached_tokens_host_total

    # ---- event loop ----------------------------------------------------------------------------
    def _run_until(self, now: float, inclusive: bool = True) -> None:
        """Process ops ending before `now` (and at `now` if inclusive: submit/abort are not, so
        that a request arriving exactly at a step boundary is seen by that boundary's scheduling)."""
        now = max(now, self._now)
        while self._op and (self._op_end < now or (inclusive and self._op_end == now)):
            end = self._op_end
            if self._op == OP_PREFILL:
                self._complete_prefill(end)
            elif self._op == OP_DECODE:
                self._catch_up(end)
                self._complete_segment(end)
            self._schedule(end)
            self._note_idle(end)
        if self._op == OP_DECODE:
            self._catch_up(now)
        self._now = now
        self._settle_idle(now)

    def _schedule(self, t: float) -> None:
        self._op = 0
        if self._start_prefill(t):
            return
        if self._decoding:
            self._start_segment(t)
        elif not self._active and not self._waiting:
            self._ratio.reset()  # self_check_during_idle: a fully idle scheduler starts over

    def _estimate(self, r: ReqState) -> int:
        """Tokens the scheduler still expects a request to generate: min(max_new - gen, clip)."""
        left = r.max_new - r.gen
        clip = self.profile.clip_max_new_tokens
        return clip if left > clip else (left if left > 0 else 0)

    # ---- memory --------------------------------------------------------------------------------
    def _free_pages(self) -> int:
        return self._cap_pages - self.cache.dev_pages - self._own_pages

    def _ensure_room(self, n_pages: int, protect: Sequence[int] = ()) -> None:
        deficit = n_pages - self._free_pages()
        if deficit > 0:
            self.cache.evict(deficit * self._ps, protect)

    def _grow(self, r: ReqState, kv_tokens: int) -> None:
        delta = -(-kv_tokens // self._ps) - r.tree_pages - r.own_pages
        if delta > 0:
            self._ensure_room(delta)
            r.own_pages += delta
            self._own_pages += delta

    def _release(self, r: ReqState) -> None:
        """Free a request's slot and private pages and unlock its path (no insert)."""
        self.cache.unlock(r.sim.page_keys, 0, r.tree_pages)
        self._own_pages -= r.own_pages
        r.tree_pages = r.own_pages = 0
        del self._active[r.sim.rid]

    # ---- prefill -------------------------------------------------------------------------------
    def _start_prefill(self, t: float) -> bool:
        p = self.profile
        ps = self._ps
        cache = self.cache
        budget = p.chunked_prefill_size
        clip = p.clip_max_new_tokens
        items: list[tuple[ReqState, int]] = []
        # PrefillAdder's offset: running requests' scaled estimate, then what this batch takes
        offset = self._ratio.current * self._est_sum
        r = self._chunked
        if r is not None:
            n = r.ctx - r.filled
            if n > budget:
                n = budget // ps * ps
            else:
                self._chunked = None
                offset += min(r.max_new, clip)  # add_chunked_req: the last chunk reserves output
            items.append((r, n))
            budget -= n
            offset += -(-n // ps) * ps + ps
        hits = new = load_tokens = 0
        while (
            self._waiting
            and self._chunked is None
            and budget >= ps
            and len(self._active) < p.max_running_requests
        ):
            r = self._waiting[0]
            keys = r.sim.page_keys
            dev, host = cache.match(keys, min(len(keys), (r.ctx - 1) // ps), t)
            cache.lock(keys, 0, dev)
            matched = (dev + host) * ps
            extend = r.ctx - matched
            room = (self._free_pages() + cache.dev_pages - cache.locked_pages) * ps
            need = extend + host * ps + self._estimate(r) + ps
            if need >= room - offset:
                cache.unlock(keys, 0, dev)
                break
            if extend > budget:
                n = budget // ps * ps
                self._chunked = r
                offset += n + ps  # a truncated chunk reserves no output yet
            else:
                n = extend
                offset += -(-n // ps) * ps + min(r.max_new, clip) + ps
            self._waiting.popleft()
            if host:  # HiCache load-back: host pages come back to the device before the forward
                self._ensure_room(host, keys[dev : dev + host])
                cache.insert(keys, dev, dev + host, t, lock=True, token_ids=r.sim.token_ids)
                load_tokens += host * ps
            r.state = PREFILL
            r.tree_pages = dev + host
            r.own_pages = 0
            r.filled = matched
            self._active[r.sim.rid] = r
            if r.admitted is None:
                r.admitted = t
                r.cached_dev, r.cached_host = dev * ps, host * ps
            hits += matched
            new += extend
            items.append((r, n))
            budget -= n
        if not items:
            return False
        if hits + new:
            self.cache_hit_rate = hits / (hits + new)
        computed = sum(n for _, n in items)  # log_input_tokens: what this batch computes
        self._batch_hit_rate = hits / (hits + computed) if hits + computed else 0.0
        self._prefill_running = len(self._decoding)
        self.load_back_tokens_total += load_tokens
        seconds = p.t_prefill_overhead + timing.load_back_time(p, load_tokens)
        for r, n in items:
            self._grow(r, r.filled + n)
            if not r.sim.kv_transferred:
                seconds += timing.prefill_compute_time(p, n, r.filled)
        self._prefill_items = items
        self._op = OP_PREFILL
        self._op_end = t + seconds
        return True

    def _complete_prefill(self, t: float) -> None:
        ps = self._ps
        left = sum(r.ctx - r.filled - n for r, n in self._prefill_items if r is self._chunked)
        self.signals.prefill_result(t, lambda: self._pool_state(len(self._decoding), chunk_left=left))
        for r, n in self._prefill_items:
            if r.state != PREFILL:
                continue  # aborted meanwhile
            r.filled += n
            keys = r.sim.page_keys
            full = min(r.filled // ps, len(keys))
            if full > r.tree_pages:  # cache_unfinished_req: insert and keep locked
                self.cache.insert(keys, r.tree_pages, full, t, lock=True, token_ids=r.sim.token_ids)
                moved = full - r.tree_pages
                r.own_pages -= moved
                self._own_pages -= moved
                r.tree_pages = full
            if r.filled < r.ctx:
                continue
            r.gen += 1  # the prefill forward samples one token
            if not r.first_sent:
                r.first_sent = True
                admitted = r.admitted if r.admitted is not None else t
                self._pending.append(
                    FirstToken(
                        r.sim.rid, t, r.cached_dev + r.cached_host, r.cached_dev, r.cached_host,
                        admitted - r.arrival, t - r.arrival,
                    )
                )
            if r.gen >= r.sim.output_len:
                self._finish(r, t)
            else:
                r.state = DECODE
                r.base, r.dsteps = r.gen, 0
                r.need = timing.steps_to_reach(self.profile, r.gen, r.sim.output_len)
                self._decoding.append(r)
                self._est_sum += self._estimate(r)
        self._prefill_items = []
        self.signals.prefill_report(t, self._pool_state(self._prefill_running), self._batch_hit_rate)

    def _finish(self, r: ReqState, t: float) -> None:
        sim = r.sim
        keys = sim.page_keys
        n_insert = min(len(keys), (sim.prompt_len + sim.output_len - 1) // self._ps)
        if n_insert > r.tree_pages:  # cache_finished_req: output pages join the tree, unlocked
            self.cache.insert(keys, r.tree_pages, n_insert, t, token_ids=sim.token_ids)
        self._release(r)
        r.state = DONE
        del self._reqs[sim.rid]
        self._done[sim.rid] = sim.output_len
        if len(self._done) > 4096:
            self._done.popitem(last=False)
        self.prompt_tokens_total += sim.prompt_len
        self.generation_tokens_total += sim.output_len
        self.num_requests_total += 1
        self.cached_tokens_device_total += r.cached_dev
        self.cached_tokens_host_total += r.cached_host
        self._pending.append(
            Finished(
                sim.rid, t, sim.prompt_len, sim.output_len, r.cached_dev + r.cached_host,
                r.retractions,
            )
        )
