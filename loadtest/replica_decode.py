"""Decode as analytic segments, and retraction: a mixin of
:class:`~kvrouter.loadtest.replica_model.ReplicaModel`.

A segment is a run of decode steps with a constant batch, ending at the next finish, after
MAX_SEGMENT_STEPS steps, or where KV would run out. A step's time is fixed for the segment from the
mean context at its start: context grows by accept_length per step, so the error over 64 steps is
below one step time (tested against a step-by-step reference). A submit (with a free slot) or an
abort cuts the segment at the first step boundary at or after `now`, exactly where SGLang's loop
would look at its queue again. KV growth is allocated, and finishes are processed, at segment ends.
If a decode step would not fit, requests are retracted (fewest output tokens first, then the
longest prompt) and go back to the queue.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from . import timing
from .replica_requests import DECODE, OP_DECODE, WAITING, ReqState

if TYPE_CHECKING:
    from .replica_model import ReplicaModel

MAX_SEGMENT_STEPS = 64


class DecodeMixin:
    def _start_segment(self: ReplicaModel, t: float) -> None:
        p = self.profile
        ps = self._ps
        retracted = 0
        while True:
            batch = self._decoding
            b = len(batch)
            room = (self._free_pages() + self.cache.dev_pages - self.cache.locked_pages - b) * ps
            kv_steps = math.floor(room / (b * p.spec_accept_length))
            if kv_steps >= 1 or b == 1:
                break  # (a lone request over capacity overcommits: SGLang would fail it)
            # retract_decode: fewest output tokens first, then the longest prompt
            self._retract(min(batch, key=lambda r: (r.gen, -r.sim.prompt_len)))
            retracted += 1
        self._seg_retracted = retracted > 0
        if retracted:
            batch = self._decoding
            self.num_retracted_reqs = retracted
            self._ratio.after_retraction(
                sum(r.gen for r in batch), sum(r.max_new for r in batch), len(batch)
            )
        steps = min(min(r.need - r.dsteps for r in batch), MAX_SEGMENT_STEPS)
        steps = max(1, min(steps, kv_steps))
        context = sum(r.sim.prompt_len + r.gen for r in batch) / b
        self._seg_batch = list(batch)
        self._seg_start = t
        self._seg_dt = timing.decode_step_time(p, b, context)
        self._seg_steps = steps
        self._seg_done = 0
        self._op = OP_DECODE
        self._op_end = t + steps * self._seg_dt
        self.gen_throughput = b * p.spec_accept_length / self._seg_dt

    def _cut_segment(self: ReplicaModel, now: float) -> None:
        k = math.ceil((now - self._seg_start) / self._seg_dt - 1e-9)
        k = min(max(k, 0), self._seg_steps)
        if k < self._seg_steps:
            self._seg_steps = k
            self._op_end = self._seg_start + k * self._seg_dt

    def _complete_segment(self: ReplicaModel, t: float) -> None:
        p = self.profile
        k = self._seg_steps
        # every decode step that needed no retraction decays the ratio (update_running_batch)
        self._ratio.decay(k - 1 if self._seg_retracted else k)
        self._seg_retracted = False
        finished = []
        est_sum = self._est_sum
        for r in self._seg_batch:
            if r.state != DECODE:
                continue
            est_sum -= self._estimate(r)
            r.dsteps += k
            before = r.gen
            r.gen = min(r.sim.output_len, timing.tokens_after_steps(p, r.base, r.dsteps))
            self.decode_tokens_total += r.gen - before
            self._grow(r, r.sim.prompt_len + r.gen)
            if r.dsteps >= r.need:
                finished.append(r)
            else:
                est_sum += self._estimate(r)
        self._est_sum = est_sum
        for r in finished:
            self._finish(r, t)
        if finished:
            self._decoding = [r for r in self._decoding if r.state == DECODE]
        self._seg_batch = []

    def _retract(self: ReplicaModel, r: ReqState) -> None:
        self._est_sum -= self._estimate(r)
        self._release(r)
        self._decoding.remove(r)
        r.state = WAITING
        r.ctx = r.sim.prompt_len + r.gen  # re-prefill prompt + output so far
        r.filled = 0
        r.retractions += 1
        self._waiting.append(r)  # _add_request_to_queue appends: the back of the queue
        self.num_retracted_reqs_total += 1
        self.num_retracted_input_tokens_total += r.sim.prompt_len
        self.num_retracted_output_tokens_total += r.gen
        # release_req: free retract_decode_steps tokens per remaining request at once
        want = len(self._decoding) * self.profile.retract_decode_steps
        self._ensure_room(-(-want // self._ps))
