"""SGLang's output-length estimate for admission: the resolved max_new_tokens and new_token_ratio.

SGLang's scheduler never knows how long an answer will be. It admits against
min(max_new_tokens - generated, clip_max_new_tokens), scaled by new_token_ratio for requests
already running, and corrects itself by retracting (docs/sglang-fidelity.md, "Admission and
retraction"). Pure arithmetic over profile constants; the replica model does the bookkeeping.
"""

from __future__ import annotations

from .profiles import Profile


def resolve_max_new_tokens(profile: Profile, prompt_len: int, given: int | None, output_len: int) -> int:
    """max_new_tokens as SGLang's scheduler stores it (scheduler.py handle_generate_request /
    init_req_max_new_tokens): min(given, or unbounded when none is given, max_req_len - prompt - 1)
    with max_req_len = min(context_len - 1, max_total_num_tokens - 1) (tp_worker.py).
    Never below output_len: the driver decided the request generates that many."""
    limit = min(profile.context_len - 1, profile.max_total_num_tokens - 1) - prompt_len - 1
    return max(output_len, limit if given is None else min(given, limit))


class NewTokenRatio:
    """SGLang's NewTokenRatioTracker (scheduler_components/new_token_ratio_tracker.py): starts at
    init, decays linearly to init x min factor over decay_steps decode steps, resets to init when
    the scheduler is idle, and is re-estimated after a retraction (schedule_batch.retract_decode)."""

    __slots__ = ("init", "floor", "step", "current", "retract_steps")

    def __init__(self, profile: Profile) -> None:
        self.init = min(profile.new_token_ratio, 1.0)
        self.floor = min(self.init * profile.min_new_token_ratio_factor, 1.0)
        self.step = (self.init - self.floor) / profile.new_token_ratio_decay_steps
        self.current = self.init
        self.retract_steps = profile.retract_decode_steps

    def decay(self, steps: int) -> None:
        """`steps` decode steps that needed no retraction (update_running_batch's decay_step)."""
        if steps > 0:
            self.current = max(self.current - steps * self.step, self.floor)

    def reset(self) -> None:
        self.current = self.init

    def after_retraction(self, decoded: int, max_new_sum: int, running: int) -> None:
        """(tokens generated + retract_decode_steps x n) / sum(max_new_tokens) over the n requests
        still running, capped at 1: not floored (the next decay lifts it to the floor)."""
        if max_new_sum > 0:
            self.current = min(1.0, (decoded + self.retract_steps * running) / max_new_sum)
