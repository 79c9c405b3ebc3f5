"""Each Kimi profile's capacity and fixed costs follow from its stated inputs (docs/profiles.md), and
the router's default capacity, the reference deployment and the profile state the same number."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvrouter.loadtest import derivation, timing
from kvrouter.loadtest.profiles import Profile, _read, list_profiles, load_profile
from kvrouter.policies.cost import DEFAULT_CAPACITY_TOKENS

ROOT = Path(__file__).resolve().parent.parent
KIMI = [n for n in list_profiles() if n.startswith("kimi-")]
REFERENCE = "kimi-k2.6-b200-tp4-fp8kv-hicache"  # deploy/sglang/kimi-k2.6-b200-tp4.yaml


@pytest.mark.parametrize("name", KIMI)
def test_kimi_profiles_state_their_derived_values(name):
    p = load_profile(name)
    assert derivation.has_capacity_inputs(p) and p.n_layers == 61 and p.t_layer is not None
    assert p.max_total_num_tokens == derivation.derived_max_total_num_tokens(p)
    assert p.t_decode_overhead == pytest.approx(p.n_layers * p.t_layer)
    assert p.t_prefill_overhead == pytest.approx(p.n_layers * p.t_layer)
    assert p.t_draft == pytest.approx(derivation.derived_t_draft(p), rel=5e-3)
    if p.host_total_num_tokens:  # --hicache-ratio 2
        assert p.host_total_num_tokens == 2 * p.max_total_num_tokens


def test_capacity_is_sglangs_formula_step_by_step():
    p = load_profile(REFERENCE)
    gib = 1 << 30
    slack = 175.34 * (1 - 0.918)  # pre-load free memory x (1 - mem_fraction_static)
    budget = 175.34 - 140.61 - 2.05 - slack - 0.0977
    cell = 61 * (512 + 64) * 1 + 8 // 4 * (128 + 128) * 6 * 1  # FP8 target latent + FP8 drafter
    assert cell == 38_208 == derivation.cell_bytes_per_token(p)
    assert derivation.kv_budget_gib(p) == pytest.approx(budget)
    assert p.max_total_num_tokens == int(budget * gib // cell) // 64 * 64 == 511_552


@pytest.mark.parametrize(
    "field, value",
    [
        ("mem_fraction_static", 0.93),
        ("weight_gib_per_gpu", 138.5),
        ("draft_kv_bytes_per_token", 0.0),
        ("kv_bytes_per_token", 70272),
        ("t_layer", 2.0e-4),
        ("hbm_efficiency", 0.5),  # moves the drafter's weight read
    ],
)
def test_editing_one_input_without_its_result_fails_at_load(field, value):
    data = _read("kimi-k2.6-b200-tp4-fp8kv")
    data["name"] = "edited"
    Profile.model_validate(data)  # as stated: consistent
    data[field] = value
    with pytest.raises(ValueError, match="disagrees with its derivation"):
        Profile.model_validate(data)


def test_router_default_capacity_is_the_reference_deployments():
    ref = load_profile(REFERENCE)
    assert DEFAULT_CAPACITY_TOKENS == ref.max_total_num_tokens
    agent = yaml.safe_load((ROOT / "policies" / "coding-agent.yaml").read_text())
    assert agent["params"]["cost"]["default_capacity_tokens"] == DEFAULT_CAPACITY_TOKENS


def test_reference_deployment_states_the_profiles_inputs_and_result():
    engine_text = (ROOT / "deploy" / "sglang" / "kimi-k2.6-b200-tp4.yaml").read_text()
    engine = yaml.safe_load(engine_text)
    ref = load_profile(REFERENCE)
    assert engine["mem-fraction-static"] == ref.mem_fraction_static
    assert engine["chunked-prefill-size"] == ref.chunked_prefill_size
    assert engine["max-running-requests"] == ref.max_running_requests
    assert engine["page-size"] == ref.page_size
    assert f"{ref.max_total_num_tokens:,}" in engine_text  # the comment's derived figure
    assert " GB " not in engine_text.replace("GB/s", "")  # GiB throughout (bandwidths in GB/s)


def test_write_through_unique_capacity_is_the_host_pool():
    ref = load_profile(REFERENCE)
    assert ref.hicache_write_through
    from kvrouter.loadtest.replica_model import ReplicaModel

    cache = ReplicaModel(ref).cache
    assert cache.unique_capacity_tokens == ref.host_total_num_tokens  # not device + host


def test_speed_sits_between_the_old_constants_and_published_b200_figures():
    p = load_profile()
    cold = timing.chunked_prefill_time(p, 100_000, 0)
    warm = timing.chunked_prefill_time(p, 2_000, 98_000)
    assert 3.0 < cold < 3.4 and 0.10 < warm < 0.12  # was 4.83 s / 0.171 s with 1 PF/s and 15 ms
    assert 380 < timing.decode_tokens_per_s_per_user(p, 1, 100_000) < 430  # was 186


def test_t_layer_reproduces_the_trtllm_deepseek_r1_b200_record():
    """The same roofline and t_layer applied to DeepSeek-R1 NVFP4 on 8 x B200 with 3 MTP layers
    (TRT-LLM min-latency, 1k in / 2k out) gives its published ~368 tok/s per user at an accept
    length of 3 (docs/profiles.md)."""
    p = load_profile()
    ds = p.model_copy(update=dict(
        gpus=8, n_active_params=37e9, n_total_params=671e9, n_experts=256, experts_per_token=8,
        kv_bytes_per_token=61 * 576 * 2, attn_flops_per_token_pair=61 * 128 * 2 * (192 + 128),
        spec_verify_tokens=4, spec_accept_length=3.0, t_draft=0.0,
    ))
    lm_head_read = 129_280 * 7168 * 2 / 8 / (ds.hbm_bw_per_gpu * ds.hbm_efficiency)
    mtp = 3 * (ds.t_layer + lm_head_read)  # three sequential one-layer MTP forwards
    per_user = 3.0 / (timing.decode_step_time(ds, 1, 2000) + mtp)
    assert per_user == pytest.approx(368, rel=0.05)
