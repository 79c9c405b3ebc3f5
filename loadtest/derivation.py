"""Where a profile's capacity and fixed costs come from: SGLang's memory plan and a per-layer cost.

KV capacity follows SGLang's pool sizing (sglang 0.5.23, `mem_cache/kv_cache_configurator.py`
`_profile_available_bytes` and `model_executor/pool_configurator.py`), per GPU, in GiB:

    budget = free_before_load - weights - draft_weights - free_before_load x (1 - mem_fraction_static)
             - other reservations
    max_total_num_tokens = floor(budget x 2^30 / (kv_bytes_per_token + draft_kv_bytes_per_token)),
                           rounded down to whole pages

(the DFlash drafter's KV pool holds one slot per target token, so its bytes join the target's cell
size: `scale_kv_cell_size_per_token_for_dflash`). The fixed cost of one forward is a cost per
layer (kernel boundaries inside a CUDA graph plus the layer's two tensor-parallel all-reduces):

    t_decode_overhead = t_prefill_overhead = n_layers x t_layer
    t_draft = draft_layers x t_layer + draft weights per GPU / (hbm_bw x hbm_efficiency)

A profile that states these inputs must state the values they give (checked at load), so editing
one constant without the other fails loudly instead of silently breaking the derivation.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .profiles import Profile

GIB = 1 << 30


def has_capacity_inputs(p: Profile) -> bool:
    return p.gpu_free_gib is not None and p.mem_fraction_static is not None and p.weight_gib_per_gpu is not None


def kv_budget_gib(p: Profile) -> float:
    """GiB per GPU left for the target's and the drafter's KV pools."""
    assert p.gpu_free_gib is not None and p.mem_fraction_static is not None and p.weight_gib_per_gpu is not None
    slack = p.gpu_free_gib * (1.0 - p.mem_fraction_static)  # activations, CUDA graphs, NCCL
    return p.gpu_free_gib - p.weight_gib_per_gpu - p.draft_weight_gib_per_gpu - slack - p.reserve_gib


def cell_bytes_per_token(p: Profile) -> float:
    return p.kv_bytes_per_token + p.draft_kv_bytes_per_token


def derived_max_total_num_tokens(p: Profile) -> int:
    tokens = math.floor(kv_budget_gib(p) * GIB / cell_bytes_per_token(p))
    return max(tokens, 0) // p.page_size * p.page_size


def derived_forward_overhead(p: Profile) -> float:
    assert p.n_layers is not None and p.t_layer is not None
    return p.n_layers * p.t_layer


def derived_t_draft(p: Profile) -> float:
    assert p.t_layer is not None
    read = p.draft_weight_gib_per_gpu * GIB / (p.hbm_bw_per_gpu * p.hbm_efficiency)
    return p.draft_layers * p.t_layer + read


def check_derivation(p: Profile) -> None:
    """Raise ValueError when a profile's stated values disagree with its own derivation inputs."""
    problems: list[str] = []
    if has_capacity_inputs(p):
        want = derived_max_total_num_tokens(p)
        if p.max_total_num_tokens != want:
            problems.append(f"max_total_num_tokens {p.max_total_num_tokens} != derived {want}")
    if p.n_layers is not None and p.t_layer is not None:
        want_t = derived_forward_overhead(p)
        for field in ("t_decode_overhead", "t_prefill_overhead"):
            if not math.isclose(getattr(p, field), want_t, rel_tol=1e-6):
                problems.append(f"{field} {getattr(p, field)} != derived {want_t:.6g}")
        if p.spec_verify_tokens > 1 and p.draft_layers:
            want_d = derived_t_draft(p)
            if not math.isclose(p.t_draft, want_d, rel_tol=5e-3):
                problems.append(f"t_draft {p.t_draft} != derived {want_d:.4g}")
    if problems:
        raise ValueError(f"profile {p.name!r} disagrees with its derivation: " + "; ".join(problems))
