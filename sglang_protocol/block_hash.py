"""SGLang's block hashes: SHA-256 chained over a page's token ids (uint32 little-endian), the
int64 of a digest's first 8 bytes as the event's block hash; and kvrouter's cache namespaces.
The KV-event codec that carries them is kv_events.py."""

from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Iterable, Optional, Sequence

from .kv_events import MEDIUM_GPU, BlockStored, TokenId


# --------------------------------------------------------------------------------------
# Block hashes (mem_cache/utils.py get_hash_str / hash_str_to_int64 /
# compute_node_hash_values; mem_cache/events.py)
# --------------------------------------------------------------------------------------


def _token_bytes(t: TokenId) -> bytes:
    try:
        if isinstance(t, tuple):
            return b"".join(e.to_bytes(4, "little", signed=False) for e in t)
        return t.to_bytes(4, "little", signed=False)
    except OverflowError as exc:
        raise ValueError(f"token id does not fit in uint32: {t!r}") from exc


def page_hash_hex(token_ids: Iterable[TokenId], prior_hash_hex: Optional[str] = None) -> str:
    """SHA-256 hex digest of one page, chained on the previous page's digest.

    sha256(bytes.fromhex(prior) + b"".join(uint32_le(t) for t in page)); bigram tokens
    hash both elements.
    """
    h = hashlib.sha256()
    if prior_hash_hex:
        h.update(bytes.fromhex(prior_hash_hex))
    for t in token_ids:
        h.update(_token_bytes(t))
    return h.hexdigest()


def hash_hex_to_int64(hash_hex: str) -> int:
    """Event block hash: first 16 hex chars (8 bytes, big-endian) as a signed int64."""
    v = int(hash_hex[:16], 16)
    return v - (1 << 64) if v >= (1 << 63) else v


def block_hash_chain_hex(
    token_ids: Sequence[TokenId],
    page_size: int,
    prior_hash_hex: Optional[str] = None,
    *,
    include_partial: bool = True,
) -> list[str]:
    """Hex digests of every page of ``token_ids``.

    SGLang hashes each page of a radix node chained on its parent's last page digest, so
    the digests of a root-anchored sequence do not depend on how the tree happens to be
    split into nodes. ``include_partial`` hashes a trailing short page too (as
    compute_node_hash_values does); the radix cache only stores full pages when
    page_size > 1, so routers usually want ``include_partial=False``.
    """
    if page_size <= 0:
        raise ValueError("page_size must be positive")
    out: list[str] = []
    prior = prior_hash_hex
    for start in range(0, len(token_ids), page_size):
        page = token_ids[start : start + page_size]
        if len(page) < page_size and not include_partial:
            break
        prior = page_hash_hex(page, prior)
        out.append(prior)
    return out


def token_block_hashes(
    token_ids: Sequence[TokenId],
    page_size: int,
    prior_hash_hex: Optional[str] = None,
    *,
    include_partial: bool = True,
) -> list[int]:
    """int64 block hashes SGLang publishes for ``token_ids`` stored from ``prior`` (root)."""
    return [
        hash_hex_to_int64(h)
        for h in block_hash_chain_hex(
            token_ids, page_size, prior_hash_hex, include_partial=include_partial
        )
    ]


def full_page_hashes(
    token_ids: Sequence[int], page_size: int, prior_hash_hex: Optional[str] = None
) -> list[int]:
    """:func:`block_hashes` of the full pages of plain int ids (``include_partial=False``),
    ~50x faster: the router hashes every request on its event loop.

    Raises OverflowError / TypeError for ids that are not uint32 ints.
    """
    if page_size <= 0:
        raise ValueError("page_size must be positive")
    words = array("I", token_ids)
    if sys.byteorder == "big":
        words.byteswap()  # SGLang hashes little-endian uint32
    data = words.tobytes()
    step = 4 * page_size
    prior = bytes.fromhex(prior_hash_hex) if prior_hash_hex else b""
    out = []
    for start in range(0, len(data) - step + 1, step):
        prior = hashlib.sha256(prior + data[start : start + step]).digest()
        out.append(int.from_bytes(prior[:8], "big", signed=True))
    return out


def block_stored_events(
    token_ids: Sequence[TokenId],
    page_size: int,
    *,
    prior_hash_hex: Optional[str] = None,
    medium: Optional[str] = MEDIUM_GPU,
    include_partial: bool = False,
) -> list[BlockStored]:
    """One BlockStored per page, parent-linked, as SGLang's recorder emits for one node.

    The first page's parent is None when storing from the root, else the int64 of
    ``prior_hash_hex`` (the parent node's last page). Current SGLang may coalesce a
    parent-linked run into one event with several block_hashes; consumers must accept both.
    """
    chain = block_hash_chain_hex(
        token_ids, page_size, prior_hash_hex, include_partial=include_partial
    )
    parent = hash_hex_to_int64(prior_hash_hex) if prior_hash_hex else None
    events = []
    for i, hx in enumerate(chain):
        page = list(token_ids[i * page_size : (i + 1) * page_size])
        bh = hash_hex_to_int64(hx)
        events.append(
            BlockStored(
                block_hashes=[bh],
                parent_block_hash=parent,
                token_ids=page,
                block_size=len(page),
                lora_id=None,
                medium=medium,
            )
        )
        parent = bh
    return events


# --------------------------------------------------------------------------------------
# Cache namespaces (kvrouter's scheme, shared by the simulated publisher and the router)
# --------------------------------------------------------------------------------------

#: Request fields that put a request in its own cache namespace (SGLang never shares across).
NAMESPACE_FIELDS = ("extra_key", "cache_salt", "lora_path")


def request_namespace(model: str, body: dict) -> str:
    """``model`` plus every set namespace field, as the simulated replica keys its cache."""
    parts = [model]
    for k in NAMESPACE_FIELDS:
        v = body.get(k)
        if v not in (None, ""):
            parts.append(f"{k}={v}")
    return "\x1f".join(parts)


def namespace_prior(namespace: str) -> str:
    """Digest seeding the hash chain of a non-default namespace.

    SGLang seeds such chains too, but its function was not found (docs/sglang-fidelity.md
    section 5), so this is kvrouter's own: the simulated publisher and the router's exact
    index agree on it; real SGLang hashes of namespaced requests will not match it.
    """
    return hashlib.sha256(b"kvrouter-sim-namespace\x00" + namespace.encode("utf-8")).hexdigest()
