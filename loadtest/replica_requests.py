"""What the replica model takes and gives: the request a driver submits, the events it gets
back, the load gauges, and the scheduler's per-request state (`ReqState`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A request's scheduler state (ReqState.state).
WAITING, PREFILL, DECODE, DONE = range(4)
# The scheduler's current forward op (0: none).
OP_PREFILL, OP_DECODE, OP_WAKE = 1, 2, 3


@dataclass(slots=True)
class SimRequest:
    rid: str
    prompt_len: int  # tokens
    output_len: int  # tokens this request will generate (the driver decides, <= max_new_tokens)
    page_keys: Sequence[int]  # chained keys of the full pages of prompt+output
    token_ids: Sequence[int] | None = None  # only forwarded to the kv_sink
    # the request's max_new_tokens as the client sent it; None = none given (SGLang then allows
    # up to the context length). The scheduler's admission estimate comes from this, never
    # from output_len.
    max_new_tokens: int | None = None
    # the prompt's KV arrives from a prefill server (PD decode side): admitted as usual, but
    # its prefill forward computes nothing
    kv_transferred: bool = False


@dataclass(slots=True, frozen=True)
class FirstToken:
    rid: str
    time: float
    cached_tokens: int
    cached_device: int
    cached_host: int
    queue_time: float
    ttft: float  # time - submit time


@dataclass(slots=True, frozen=True)
class Finished:
    rid: str
    time: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    retractions: int = 0  # times the request was retracted (meta_info total_retractions)


ModelEvent = FirstToken | Finished


@dataclass(slots=True, frozen=True)
class ReplicaLoad:
    num_running_reqs: int
    num_queue_reqs: int
    num_used_tokens: int
    max_total_num_tokens: int
    token_usage: float
    cache_hit_rate: float
    gen_throughput: float
    kv_available_tokens: int
    kv_evictable_tokens: int
    host_used_tokens: int
    host_total_tokens: int
    spec_accept_length: float


class ReqState:
    """The scheduler's state of one submitted request (queue, prefill progress, decode phase,
    pages it holds)."""

    __slots__ = (
        "sim", "arrival", "state", "ctx", "filled", "gen", "base", "dsteps", "need",
        "tree_pages", "own_pages", "admitted", "cached_dev", "cached_host", "first_sent",
        "max_new", "retractions",
    )

    def __init__(self, sim: SimRequest, arrival: float, max_new: int) -> None:
        self.sim = sim
        self.max_new = max_new  # resolved max_new_tokens (the scheduler's only output bound)
        self.retractions = 0
        self.arrival = arrival
        self.state = WAITING
        self.ctx = sim.prompt_len  # tokens to (re)prefill
        self.filled = 0  # tokens with KV
        self.gen = 0  # output tokens out
        self.base = 0  # gen when the current decode phase began
        self.dsteps = 0  # decode steps in the current phase
        self.need = 0  # decode steps needed in the current phase
        self.tree_pages = 0  # keys[:tree_pages] are cache pages locked by this request
        self.own_pages = 0  # private pages (partial page, uninserted output)
        self.admitted: float | None = None
        self.cached_dev = 0
        self.cached_host = 0
        self.first_sent = False
