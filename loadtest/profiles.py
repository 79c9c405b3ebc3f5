"""Replica profiles: every constant of the simulated replica, loaded from `profiles/*.yaml`.

A YAML file may say `base: <other profile>`; its keys then override the base's (one level, no
deep merge: every field is a scalar). Units are SI: seconds, bytes, FLOP/s, bytes/s, tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

PROFILE_DIR = Path(__file__).with_name("profiles")
DEFAULT_PROFILE = "kimi-k2.6-b200-tp4"


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""

    # --- capacity and scheduler (SGLang server args) ---
    gpus: int = Field(gt=0)
    page_size: int = Field(gt=0)
    max_total_num_tokens: int = Field(gt=0)
    host_total_num_tokens: int = Field(default=0, ge=0)  # HiCache host pool; 0 = off
    max_running_requests: int = Field(gt=0)
    chunked_prefill_size: int = Field(gt=0)
    # --- admission and retraction (SGLang environ.py / server_args defaults) ---
    # initial new_token_ratio: SGLANG_INIT_NEW_TOKEN_RATIO x schedule_conservativeness (1.0)
    new_token_ratio: float = Field(default=0.7, gt=0, le=1)
    min_new_token_ratio_factor: float = Field(default=0.14, gt=0, le=1)  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
    new_token_ratio_decay_steps: int = Field(default=600, gt=0)  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
    retract_decode_steps: int = Field(default=20, ge=0)  # SGLANG_RETRACT_DECODE_STEPS
    clip_max_new_tokens: int = Field(default=4096, gt=0)  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
    context_len: int = Field(default=262144, gt=1)  # bounds max_new_tokens when a request gives none

    # --- model ---
    n_active_params: float = Field(gt=0)
    n_total_params: float = Field(gt=0)
    n_experts: int = Field(ge=1)
    experts_per_token: int = Field(ge=1)
    weight_bytes_per_param: float = Field(gt=0)
    kv_bytes_per_token: float = Field(gt=0)
    kv_read_shards: int = Field(default=1, ge=1)  # GPUs the KV read is split over
    attn_flops_per_token_pair: float = Field(gt=0)

    dense_weight_bytes_per_param: float | None = Field(default=None, gt=0)  # None: weight_bytes_per_param

    # --- hardware (per GPU) ---
    flops_eff_per_gpu: float = Field(gt=0)  # GEMM FLOP/s (the 2 N_active part)
    attn_flops_eff_per_gpu: float | None = Field(default=None, gt=0)  # attention; None: flops_eff
    hbm_bw_per_gpu: float = Field(gt=0)
    hbm_efficiency: float = Field(gt=0, le=1)
    host_load_bw_per_gpu: float = Field(gt=0)

    # --- fixed costs ---
    t_prefill_overhead: float = Field(ge=0)
    t_decode_overhead: float = Field(ge=0)

    # --- speculative decoding (accept_length 1 and verify_tokens 1 = off) ---
    spec_accept_length: float = Field(default=1.0, ge=1)
    spec_verify_tokens: int = Field(default=1, ge=1)
    t_draft: float = Field(default=0.0, ge=0)

    # --- HiCache: write_through keeps a host copy of every device page (SGLang's default policy) ---
    hicache_write_through: bool = True

    # --- derivation inputs (docs/profiles.md, loadtest/derivation.py); when given, the derived
    # capacity and fixed costs must equal the values above, so no constant drifts on its own ---
    gpu_free_gib: float | None = Field(default=None, gt=0)  # free per GPU before weights load
    mem_fraction_static: float | None = Field(default=None, gt=0, lt=1)
    weight_gib_per_gpu: float | None = Field(default=None, gt=0)
    draft_weight_gib_per_gpu: float = Field(default=0.0, ge=0)
    draft_kv_bytes_per_token: float = Field(default=0.0, ge=0)
    reserve_gib: float = Field(default=0.0, ge=0)  # other reservations out of the KV budget
    n_layers: int | None = Field(default=None, gt=0)
    t_layer: float | None = Field(default=None, gt=0)  # fixed cost per layer per forward
    draft_layers: int = Field(default=0, ge=0)

    # --- signal cadence (SGLang server args and scheduler constants; docs/sglang-fidelity.md) ---
    decode_log_interval: int = Field(default=40, ge=1)  # /metrics refresh every N decode steps
    load_snapshot_publish_interval: int = Field(default=15, ge=1)  # /v1/loads every N steps
    idle_metrics_interval_s: float = Field(default=30.0, gt=0)  # idle /metrics refresh
    # sglang:utilization needs this; SGLang sets none by default, so the gauge stays 0
    max_running_requests_under_slo: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _check(self) -> Profile:
        if self.n_active_params > self.n_total_params:
            raise ValueError("n_active_params > n_total_params")
        if self.experts_per_token > self.n_experts:
            raise ValueError("experts_per_token > n_experts")
        if self.spec_accept_length > self.spec_verify_tokens:
            raise ValueError("spec_accept_length cannot exceed spec_verify_tokens")
        if self.chunked_prefill_size < self.page_size:
            raise ValueError("chunked_prefill_size must hold at least one page")
        from .derivation import check_derivation  # late import: derivation reads Profile fields

        check_derivation(self)
        return self


def _read(name_or_path: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.exists()):
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        known = ", ".join(list_profiles())
        raise FileNotFoundError(f"unknown profile {name_or_path!r} (known: {known})")
    if str(path) in seen:
        raise ValueError(f"profile inheritance loop at {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a profile must be a mapping")
    base = data.pop("base", None)
    if base is None:
        return data
    merged = _read(base, (*seen, str(path)))
    merged.update(data)
    return merged


def load_profile(name_or_path: str = DEFAULT_PROFILE) -> Profile:
    data = _read(name_or_path)
    path = Path(name_or_path)
    # the file name, never inherited from a base ("kimi-k2.6-..." has dots: no Path.stem)
    data["name"] = path.stem if path.suffix in (".yaml", ".yml") else name_or_path
    return Profile.model_validate(data)


def list_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def scale_profile(profile: Profile, *, speed: float = 1.0, capacity: float = 1.0) -> Profile:
    """`profile` with every compute and memory-traffic time divided by `speed` (FLOP/s, HBM and
    host-link bandwidth up, fixed overheads down: a prefill, a decode step and a load-back all
    take 1/speed as long) and the device KV pool scaled by `capacity` (rounded down to whole
    pages). The profile's own constants are left as loaded."""
    if speed <= 0 or capacity <= 0:
        raise ValueError("speed and capacity must be > 0")
    if speed == 1.0 and capacity == 1.0:
        return profile
    pages = int(profile.max_total_num_tokens * capacity) // profile.page_size
    tokens = max(pages * profile.page_size, profile.page_size)
    return profile.model_copy(update={
        "name": f"{profile.name}*speed={speed:g},capacity={capacity:g}",
        "flops_eff_per_gpu": profile.flops_eff_per_gpu * speed,
        "attn_flops_eff_per_gpu": (None if profile.attn_flops_eff_per_gpu is None
                                   else profile.attn_flops_eff_per_gpu * speed),
        "hbm_bw_per_gpu": profile.hbm_bw_per_gpu * speed,
        "host_load_bw_per_gpu": profile.host_load_bw_per_gpu * speed,
        "t_prefill_overhead": profile.t_prefill_overhead / speed,
        "t_decode_overhead": profile.t_decode_overhead / speed,
        "t_draft": profile.t_draft / speed,
        "t_layer": None if profile.t_layer is None else profile.t_layer / speed,
        "max_total_num_tokens": tokens,
    })


def rank_profile(profile: Profile, dp_size: int) -> Profile:
    """One DP-attention rank's profile: the profile's numbers are per rank (KV pool, scheduler),
    and a rank's attention runs on its own GPU (attention TP 1), so the attention FLOP/s of the
    replica's ``gpus`` are divided between its ``dp_size`` ranks. The MoE and dense GEMMs and the
    weight reads are the whole replica's, shared by all ranks: taken at full speed for each rank
    (optimistic when several ranks prefill at once). KV reads are per rank already."""
    if dp_size == 1:
        return profile
    attn = profile.attn_flops_eff_per_gpu or profile.flops_eff_per_gpu
    return profile.model_copy(update={"attn_flops_eff_per_gpu": attn / dp_size})
