"""Refuse, before any load is sent, a workload whose prompts cannot fit the replicas.

A simulated replica rejects a request it can never hold (loadtest/sim_server.py and
loadtest/replica_model.py): the prompt must be shorter than the context length, prompt + max_tokens
must not exceed it, and prompt + min(max_tokens, clip_max_new_tokens) must stay below the KV pool
(``max_total_num_tokens``). Sending such a workload anyway makes almost every request fail with a
400, which a comparison would report as a slow policy rather than a wrong setup.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .profiles import load_profile
from .workload import make_session
from .workload_config import WorkloadConfig

DEFAULT_CONTEXT_LEN = 262_144  # the simulated replica's default (loadtest/sim_server.py)
SESSIONS_CHECKED = 64  # first requests of this many sessions (a few ms to draw)


@dataclass(frozen=True)
class ReplicaLimits:
    """What one replica enforces per request, in tokens; ``source`` names where it came from."""

    source: str
    max_total_num_tokens: int
    context_len: int = DEFAULT_CONTEXT_LEN
    clip_max_new_tokens: int | None = None

    def fits(self, prompt_tokens: int, max_tokens: int) -> bool:
        if prompt_tokens >= self.context_len or prompt_tokens + max_tokens > self.context_len:
            return False
        kept = max_tokens if self.clip_max_new_tokens is None else min(max_tokens, self.clip_max_new_tokens)
        return prompt_tokens + kept < self.max_total_num_tokens

    def describe(self) -> str:
        if self.max_total_num_tokens <= self.context_len:
            return (f"{self.source} holds {self.max_total_num_tokens:,} KV tokens (max_total_num_tokens): "
                    f"prompt + output of one request must stay below that")
        return f"{self.source} has a context length of {self.context_len:,} tokens (prompt + output)"


def limits_for_profile(name_or_path: str, context_len: int = DEFAULT_CONTEXT_LEN) -> ReplicaLimits:
    p = load_profile(name_or_path)
    return ReplicaLimits(f"profile {p.name!r}", p.max_total_num_tokens, context_len, p.clip_max_new_tokens)


def limits_from_metrics(text: str, source: str) -> ReplicaLimits | None:
    """Limits read from an SGLang ``/metrics`` page (``max_total_num_tokens`` and ``context_len``
    gauges); None when the page does not carry them."""
    from ..sglang_protocol import metric_names as sg

    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        short = name.split(":", 1)[-1]
        if short in (sg.MAX_TOTAL_NUM_TOKENS, sg.CONTEXT_LEN) and short not in values:
            try:
                values[short] = float(line.rsplit(" ", 1)[-1])
            except ValueError:
                continue
    if sg.MAX_TOTAL_NUM_TOKENS not in values:
        return None
    return ReplicaLimits(source, int(values[sg.MAX_TOTAL_NUM_TOKENS]),
                         int(values.get(sg.CONTEXT_LEN, DEFAULT_CONTEXT_LEN)))


def refusal(workload: WorkloadConfig, limits: ReplicaLimits, seed: int = 0,
            sessions: int = SESSIONS_CHECKED) -> str | None:
    """One line saying why ``workload`` cannot run on replicas with ``limits``, or None.

    A session's first request is its smallest (prompts only grow until compaction), so when the
    median session cannot even send its first request, most of the run would fail."""
    firsts = [make_session(workload, seed, i).next_requests(None)[0] for i in range(sessions)]
    misfits = [r for r in firsts if not limits.fits(r.prompt_tokens, r.max_tokens)]
    if len(misfits) * 2 <= len(firsts):
        return None
    median = int(statistics.median(r.prompt_tokens for r in firsts))
    smallest = min(r.prompt_tokens for r in firsts)
    return (f"workload {workload.name!r} cannot fit: its sessions start with prompts of {median:,} tokens "
            f"(median first request, smallest {smallest:,}; {len(misfits)} of {len(firsts)} sessions "
            f"cannot send even their first request), and {limits.describe()}")
