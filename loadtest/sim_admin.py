"""The simulated replica's info and control endpoints: health, model and server info, the model
list, ``/v1/loads`` (JSON or Prometheus text) and ``/get_load``, cache flush, aborts and
``/metrics``."""

from __future__ import annotations

import datetime as _dt
import time
from typing import Any

import orjson
from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .profiles import Profile
from .replica_signals import PublishedLoads
from .sim_replica import SimError, SimReplica
from .sim_requests import read_json
from .sim_responses import json_response, native_error

SIM_VERSION = "0.0.0+kvrouter.sim"
VALID_LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")

FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)


GIB = 1 << 30  # SGLang's memory figures are in GiB (its GB constant)


def loads_entry(
    snap: PublishedLoads, p: Profile, include: set[str] | None = None, disagg_mode: str = "null",
    dp_rank: int = 0,
) -> dict[str, Any]:
    """LoadSnapshot.to_dict: core keys in SGLang's order, no timestamp; sections that are None
    (no speculative decoding yet, no LoRA) are left out."""
    entry: dict[str, Any] = {
        "dp_rank": dp_rank,
        "num_running_reqs": snap.num_running_reqs,
        "num_waiting_reqs": snap.num_waiting_reqs,
        "num_waiting_uncached_tokens": snap.num_waiting_uncached_tokens,
        "num_used_tokens": snap.num_used_tokens,
        "num_total_tokens": snap.num_total_tokens,
        "max_total_num_tokens": p.max_total_num_tokens,
        "max_running_requests": p.max_running_requests,
        "token_usage": snap.token_usage,
        "gen_throughput": snap.gen_throughput,
        "cache_hit_rate": snap.cache_hit_rate,
        "utilization": snap.utilization,
    }
    if include == {"core"}:
        return entry
    every = include is None or "all" in include
    sections: list[tuple[str, str, dict[str, Any] | None]] = [
        ("memory", "memory", {
            "weight_gb": round(p.n_total_params * p.weight_bytes_per_param / p.gpus / GIB, 3),
            "kv_cache_gb": round(p.max_total_num_tokens * p.kv_bytes_per_token / p.gpus / GIB, 3),
            "graph_gb": 0.0,
            "token_capacity": p.max_total_num_tokens,
        }),
        ("speculative", "spec", None if snap.spec_accept_length is None else {
            "accept_length": snap.spec_accept_length,
            "accept_rate": snap.spec_accept_rate,
        }),
        ("lora", "lora", None),
        ("disaggregation", "disagg", {
            "mode": disagg_mode,
            "prefill_bootstrap_queue_reqs": 0,
            "prefill_inflight_queue_reqs": 0,
            "decode_prealloc_queue_reqs": 0,
            "decode_transfer_queue_reqs": 0,
            "decode_retracted_queue_reqs": 0,
            "kv_transfer_speed_gb_s": 0.0,
            "kv_transfer_latency_ms": 0.0,
        }),
        ("queues", "queues", {
            "waiting": snap.num_waiting_reqs, "grammar": 0, "paused": 0, "retracted": 0,
        }),
    ]
    for field, token, section in sections:
        if section is None or (not every and token not in include):  # type: ignore[operator]
            continue
        entry[field] = section
    return entry


class AdminHandlers:
    def __init__(self, sim: SimReplica) -> None:
        self.sim = sim

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        sim = self.sim
        return json_response(
            {
                "model_path": sim.served_model_name,
                "tokenizer_path": sim.served_model_name,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "kvrouter_sim",
                "architectures": ["KvrouterSimReplica"],
            }
        )

    def _server_args(self) -> dict[str, Any]:
        sim, p = self.sim, self.sim.profile
        return {
            "model_path": sim.served_model_name,
            "tokenizer_path": sim.served_model_name,
            "served_model_name": sim.served_model_name,
            "host": sim.host,
            "port": sim.port,
            "tp_size": p.gpus,
            "dp_size": 1,
            "attn_dp_size": sim.dp_size,  # sglang 0.5.23's name for DP-attention ranks
            "enable_dp_attention": sim.dp_size > 1,
            "pp_size": 1,
            "page_size": p.page_size,
            "max_running_requests": p.max_running_requests,
            "chunked_prefill_size": p.chunked_prefill_size,
            "context_length": sim.context_len,
            "max_total_tokens": p.max_total_num_tokens,
            "enable_cache_report": sim.enable_cache_report,
            "enable_metrics": sim.enable_metrics,
            "enable_hierarchical_cache": p.host_total_num_tokens > 0,
            "disable_radix_cache": False,
            "schedule_policy": "fcfs",
            "weight_version": "default",
            "decode_log_interval": p.decode_log_interval,
            "load_snapshot_publish_interval": p.load_snapshot_publish_interval,
            "disaggregation_mode": sim.disagg.mode,
            "disaggregation_bootstrap_port": sim.disagg.bootstrap_port,
            "kv_events_config": (
                orjson.dumps(sim.kv_events_config).decode() if sim.kv_events_config else None
            ),
            # simulator-only knobs
            "sim_profile": p.name,
            "sim_time_scale": sim.time_scale,
            "sim_seed": sim.seed,
        }

    async def server_info(self, request: web.Request) -> web.Response:
        sim, p = self.sim, self.sim.profile
        published = sim.published_metrics()  # last_gen_throughput moves at decode reports
        body = {
            **self._server_args(),
            "max_total_num_tokens": p.max_total_num_tokens,
            "max_req_input_len": sim.context_len - 1,
            "internal_states": [
                {
                    "dp_rank": 0,
                    "last_gen_throughput": published.gen_throughput,
                    "avg_spec_accept_length": published.spec_accept_length,
                    "memory_usage": {"token_capacity": p.max_total_num_tokens},
                }
            ],
            "version": SIM_VERSION,
            "kv_events": sim.publisher.descriptor() if sim.publisher is not None else None,
        }
        return json_response(body)

    def _model_card(self) -> dict[str, Any]:
        sim = self.sim
        return {
            "id": sim.served_model_name,
            "object": "model",
            "created": sim.created,
            "owned_by": "sglang",
            "root": sim.served_model_name,
            "max_model_len": sim.context_len,
        }

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [self._model_card()]})

    async def model_card(self, request: web.Request) -> web.Response:
        m = request.match_info["model"]
        if m != self.sim.served_model_name:
            return json_response(
                {"error": {"message": f"The model '{m}' does not exist",
                           "type": "invalid_request_error", "param": "model",
                           "code": "model_not_found"}},
                404,
            )
        return json_response(self._model_card())

    async def loads(self, request: web.Request) -> web.Response:
        # v1_loads.get_loads: no include (or "all") means every section.
        include = request.query.get("include")
        sections = {s.strip() for s in include.split(",") if s.strip()} if include else None
        bad = (sections or set()) - set(VALID_LOAD_SECTIONS)
        if bad:
            return json_response(
                {"detail": f"Invalid include sections: {sorted(bad)}. Valid: {list(VALID_LOAD_SECTIONS)}"},
                400,
            )
        sim = self.sim
        dp = request.query.get("dp_rank")
        ranks = list(range(sim.dp_size))
        if dp not in (None, ""):
            if not dp.isdigit() or int(dp) >= sim.dp_size:
                return json_response({"detail": f"dp_rank {dp} out of range"}, 400)
            ranks = [int(dp)]
        entries = [
            loads_entry(sim.published_loads(rank), sim.profile, sections, sim.disagg.mode, rank)
            for rank in ranks
        ]
        if request.query.get("format") == "prometheus":
            return web.Response(text=loads_prometheus(entries), content_type="text/plain")
        p = self.sim.profile
        return json_response(
            {
                "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(),
                "version": SIM_VERSION,
                "accelerator": None,
                "num_accelerators": p.gpus,
                "loads": entries,
            }
        )

    async def get_load(self, request: web.Request) -> web.Response:
        """The deprecated ``/get_load``: a projection of the same load snapshot."""
        snaps = [self.sim.published_loads(rank) for rank in range(self.sim.dp_size)]
        return json_response(
            [
                {
                    "dp_rank": rank,
                    "num_reqs": snap.num_running_reqs + snap.num_waiting_reqs,
                    "num_waiting_reqs": snap.num_waiting_reqs,
                    "num_tokens": snap.num_total_tokens,
                    "num_pending_tokens": snap.num_total_tokens - snap.num_used_tokens,
                    "ts_tic": time.perf_counter(),
                }
                for rank, snap in enumerate(snaps)
            ]
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        if not self.sim.flush_cache():
            return web.Response(status=400, text="Flush cache failed.\n")
        return web.Response(status=200, text=FLUSH_OK)

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
        except SimError as exc:
            return native_error(str(exc))
        if body.get("abort_all"):
            self.sim.abort_all()
        else:
            rid = body.get("rid")
            if isinstance(rid, str) and rid:
                self.sim.abort(rid)
            elif isinstance(rid, list):
                for r in rid:
                    if isinstance(r, str):
                        self.sim.abort(r)
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        data = self.sim.metrics_page.render()
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


def loads_prometheus(entries: list[dict[str, Any]]) -> str:
    """``/v1/loads?format=prometheus``: ``sglang_<field>{dp_rank}``, sections flattened, gauges."""
    series: dict[str, list[tuple[int, float]]] = {}
    sections = {"memory": "memory", "speculative": "spec", "disaggregation": "disagg", "queues": "queues"}
    for e in entries:
        dp = e["dp_rank"]
        for k, v in e.items():
            if k == "dp_rank":
                continue
            if isinstance(v, dict):
                prefix = sections.get(k, k)
                for sk, sv in v.items():
                    if isinstance(sv, (int, float)) and not isinstance(sv, bool):
                        series.setdefault(f"sglang_{prefix}_{sk}", []).append((dp, sv))
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                series.setdefault(f"sglang_{k}", []).append((dp, v))
    lines = []
    for name, rows in series.items():
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f'{name}{{dp_rank="{dp}"}} {v}' for dp, v in rows)
    return "\n".join(lines) + "\n"
