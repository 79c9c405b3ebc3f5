"""The exact KV index: which SGLang blocks each replica holds, learned from its KV events.

Blocks are SGLang's event block hashes (sglang_protocol/block_hash.py), so a request's blocks are the
hashes of its token ids per page, which the router gets from a pluggable tokenizer
(router/tokenizers.py). Device (GPU) blocks give `cached_tokens`; blocks only on the HiCache
host tier (CPU_PINNED) give `host_cached_tokens`, the part of the prefix a replica can load back
instead of recomputing. DISK/EXTERNAL tiers are ignored.
Synchronous and lock-free: the event loop is the only writer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..sglang_protocol.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from ..sglang_protocol.block_hash import (
    NAMESPACE_FIELDS,
    full_page_hashes,
    namespace_prior,
    request_namespace,
)
from .block_holders import BlockHolders, match_prefix
from .tokenizers import Tokenizer

log = logging.getLogger("kvrouter")

_DEVICE, _HOST = 1, 2  # tier bits of a block on one replica
_TIER = {MEDIUM_GPU: _DEVICE, None: _DEVICE, MEDIUM_CPU: _HOST}  # None: pre-`medium` SGLang


class ExactKVIndex:
    def __init__(self, page_size: int = 64) -> None:
        self.block_tokens = page_size
        self._device = BlockHolders()  # block -> replicas holding it on the GPU
        self._any = BlockHolders()  # block -> replicas holding it on GPU or host
        self._tiers: dict[str, dict[int, int]] = {}  # replica -> block -> tier bits
        self._warned: set[str] = set()

    # -- the engine's interface -------------------------------------------------------------------
    def match(self, blocks: Sequence[int], limit: int | None = None) -> dict[str, int]:
        return match_prefix(self._device, blocks, limit, self.block_tokens)

    def match_host(self, blocks: Sequence[int], limit: int | None = None) -> dict[str, int]:
        """Prefix tokens past the device match that a replica holds on its host tier."""
        if not blocks or not self._any.mask(blocks[0]):
            return {}
        device = self.match(blocks, limit)
        both = match_prefix(self._any, blocks, limit, self.block_tokens)
        return {r: t - device.get(r, 0) for r, t in both.items() if t > device.get(r, 0)}

    def record(self, replica: str, blocks: Sequence[int]) -> None:
        pass  # the replica announces what it caches; dispatch is no evidence

    def set_capacity(self, replica: str, max_total_num_tokens: int) -> None:
        pass  # evictions arrive as BlockRemoved

    def forget(self, replica: str) -> None:
        for block, bits in self._tiers.pop(replica, {}).items():
            if bits & _DEVICE:
                self._device.discard(block, replica)
            self._any.discard(block, replica)

    def cached_tokens(self, replica: str) -> int:
        tiers = self._tiers.get(replica, {})
        return sum(1 for bits in tiers.values() if bits & _DEVICE) * self.block_tokens

    def host_cached_tokens(self, replica: str) -> int:
        tiers = self._tiers.get(replica, {})
        return sum(1 for bits in tiers.values() if bits & _HOST) * self.block_tokens

    # -- events -----------------------------------------------------------------------------------
    def apply(self, replica: str, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if ev.block_size != self.block_tokens and replica not in self._warned:
                    self._warned.add(replica)  # its hashes cannot match ours: say so once
                    log.warning("kv events: %s publishes block_size %d, kv_events.page_size is %d",
                                replica, ev.block_size, self.block_tokens)
                self._store(replica, ev.block_hashes, _TIER.get(ev.medium, 0))
            elif isinstance(ev, BlockRemoved):
                self._remove(replica, ev.block_hashes, _TIER.get(ev.medium, 0))
            elif isinstance(ev, AllBlocksCleared):
                self.forget(replica)

    def _store(self, replica: str, blocks: list[int], bit: int) -> None:
        if not bit:
            return
        tiers = self._tiers.setdefault(replica, {})
        for block in blocks:
            bits = tiers.get(block, 0)
            if bits & bit:
                continue
            tiers[block] = bits | bit
            if bit == _DEVICE:
                self._device.add(block, replica)
            if not bits:
                self._any.add(block, replica)

    def _remove(self, replica: str, blocks: list[int], bit: int) -> None:
        tiers = self._tiers.get(replica)
        if tiers is None or not bit:
            return
        for block in blocks:
            bits = tiers.get(block, 0)
            if not bits & bit:
                continue  # never stored (e.g. before we subscribed)
            bits &= ~bit
            if bit == _DEVICE:
                self._device.discard(block, replica)
            if bits:
                tiers[block] = bits
            else:
                del tiers[block]
                self._any.discard(block, replica)


def request_blocks(
    tokenize: Tokenizer, route: str, body: dict[str, Any], page_size: int
) -> tuple[int, tuple[int, ...]] | None:
    """(prompt tokens, SGLang block hashes of its full pages), or None if `tokenize` cannot tell.

    A request with extra_key/cache_salt/lora_path starts its chain from kvrouter's namespace
    seed (sglang_protocol/block_hash.py), as the simulated publisher does.
    """
    try:
        ids = tokenize(route, body)
    except Exception:  # a plug-in bug must cost prefix information, not the request
        log.warning("kv events: tokenizer failed on a %s request", route, exc_info=True)
        return None
    if ids is None:
        return None
    prior = None
    if any(body.get(k) not in (None, "") for k in NAMESPACE_FIELDS):
        model = body.get("model")
        prior = namespace_prior(request_namespace(model if isinstance(model, str) else "", body))
    try:
        return len(ids), tuple(full_page_hashes(ids, page_size, prior))
    except (OverflowError, TypeError):
        return None  # not uint32 token ids: no prefix information rather than a wrong one
