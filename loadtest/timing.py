"""Roofline timing of one replica: pure functions of a Profile (seconds).

Prefill of n_new tokens after a cached prefix p (one forward):
    T = t_prefill_overhead + 2 N_active n_new / (G F_eff) + A n_new (p + n_new/2) / (G F_attn)
(GEMMs run at the NVFP4 rate F_eff, attention at its own rate F_attn; F_attn defaults to F_eff).
A chunked prefill is a sum of such forwards with p growing; the FLOP terms add up to the one-shot
formula, so chunking only adds overheads.

Decode: one step for B requests of mean context L. With speculative decoding each request verifies
`spec_verify_tokens` (q = B x verify) tokens in the target model and keeps `spec_accept_length`
of them on average; the wider verify is the price (more experts touched, more FLOPs), plus a
drafter forward `t_draft`:
    T = t_decode_overhead + t_draft + max(memory, compute)
    memory  = W_touched(q) / (G BW_eff) + B L kv_bytes / (kv_read_shards BW_eff)
    compute = 2 N_active q / (G F_eff) + A q L / (G F_attn)
W_touched(q) = dense_bytes x N_dense + bytes_per_param x N_routed x (1 - (1 - k/E)^q): the expected share of
routed experts hit by q tokens each picking k of E (uniform routing), so it grows from the active
weights (q = 1) toward all weights (q >> E/k). N_dense follows from N_active = N_dense + N_routed k/E;
its bytes per parameter (BF16 attention, shared experts, lm_head) may differ from the experts' (NVFP4).
MLA keeps one latent KV head, replicated on every TP rank, so each GPU reads the whole KV
(kv_read_shards = 1) while weights are split G ways.

Host (HiCache) load-back moves kv_bytes per token over each GPU's host link, in parallel.
"""

from __future__ import annotations

import math

from .profiles import Profile


def dense_params(p: Profile) -> float:
    share = p.experts_per_token / p.n_experts
    return (p.n_active_params - p.n_total_params * share) / (1.0 - share) if share < 1 else p.n_total_params


def touched_weight_bytes(p: Profile, n_tokens: int) -> float:
    dense = dense_params(p)
    routed = p.n_total_params - dense
    miss = (1.0 - p.experts_per_token / p.n_experts) ** max(n_tokens, 0)
    dense_bytes = p.dense_weight_bytes_per_param or p.weight_bytes_per_param
    return dense_bytes * dense + p.weight_bytes_per_param * routed * (1.0 - miss)


def attn_flops_eff(p: Profile) -> float:
    return p.attn_flops_eff_per_gpu or p.flops_eff_per_gpu


def prefill_flops(p: Profile, n_new: int, prefix: int) -> float:
    return 2.0 * p.n_active_params * n_new + p.attn_flops_per_token_pair * n_new * (prefix + n_new / 2.0)


def prefill_compute_time(p: Profile, n_new: int, prefix: int) -> float:
    """FLOP time of one request's part of a prefill forward (no overhead)."""
    gemm = 2.0 * p.n_active_params * n_new / p.flops_eff_per_gpu
    attn = p.attn_flops_per_token_pair * n_new * (prefix + n_new / 2.0) / attn_flops_eff(p)
    return (gemm + attn) / p.gpus


def prefill_forward_time(p: Profile, n_new: int, prefix: int) -> float:
    return p.t_prefill_overhead + prefill_compute_time(p, n_new, prefix)


def chunked_prefill_time(p: Profile, n_new: int, prefix: int = 0, load_back_tokens: int = 0) -> float:
    """A lone request's prefill: chunks of chunked_prefill_size (page-aligned), back to back."""
    total = load_back_time(p, load_back_tokens)
    done = 0
    chunk = max(p.chunked_prefill_size // p.page_size * p.page_size, p.page_size)
    while done < n_new:
        n = min(chunk, n_new - done)
        total += prefill_forward_time(p, n, prefix + done)
        done += n
    return total


def load_back_time(p: Profile, n_tokens: int) -> float:
    return n_tokens * p.kv_bytes_per_token / p.host_load_bw_per_gpu


def decode_step_time(p: Profile, batch: int, mean_context: float) -> float:
    if batch <= 0:
        return 0.0
    q = batch * p.spec_verify_tokens
    bw = p.hbm_bw_per_gpu * p.hbm_efficiency
    memory = touched_weight_bytes(p, q) / (p.gpus * bw) + batch * mean_context * p.kv_bytes_per_token / (
        p.kv_read_shards * bw
    )
    compute = (
        2.0 * p.n_active_params * q / p.flops_eff_per_gpu
        + p.attn_flops_per_token_pair * q * mean_context / attn_flops_eff(p)
    ) / p.gpus
    draft = p.t_draft if p.spec_verify_tokens > 1 else 0.0
    return p.t_decode_overhead + draft + max(memory, compute)


def tokens_after_steps(p: Profile, base: int, steps: int) -> int:
    """Output tokens after `steps` decode steps starting from `base` (whole tokens per step)."""
    return base + int(math.floor(steps * p.spec_accept_length + 1e-9))


def steps_to_reach(p: Profile, base: int, target: int) -> int:
    """Fewest decode steps after which tokens_after_steps(base, k) >= target."""
    if target <= base:
        return 0
    k = max(1, math.ceil((target - base) / p.spec_accept_length - 1e-9))
    while k > 1 and tokens_after_steps(p, base, k - 1) >= target:
        k -= 1
    while tokens_after_steps(p, base, k) < target:
        k += 1
    return k


def decode_tokens_per_s_per_user(p: Profile, batch: int, context: float) -> float:
    return p.spec_accept_length / decode_step_time(p, batch, context)
