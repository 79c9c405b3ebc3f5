#!/usr/bin/env bash
# Start one SGLang replica for kvrouter: Kimi K2.6 NVFP4 on 4 x B200 (TP4), FP8 KV, DFlash, HiCache.
#
#   DRAFT_MODEL_PATH=/models/kimi-k2.6-dflash deploy/sglang/launch.sh [extra sglang flags...]
#
# Environment:
#   DRAFT_MODEL_PATH   required: the DFlash drafter checkpoint (local dir or Hugging Face repo id)
#   SGLANG_CONFIG      engine config (default: kimi-k2.6-b200-tp4.yaml beside this script)
#   HICACHE_DIR        L3 `file` storage directory on local NVMe (default /mnt/hicache)
#   KV_EVENTS=1        publish KV events for kvrouter's exact index (kv_events.enabled: true)
#   KV_EVENTS_PORT     PUB port (default 5557 = kvrouter's kv_events.port)
#   KV_EVENTS_REPLAY_PORT  replay port (default 5558 = kvrouter's kv_events.replay_port)
# Flags given on the command line override the config file (SGLang: CLI > config > defaults).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
config="${SGLANG_CONFIG:-$here/kimi-k2.6-b200-tp4.yaml}"
: "${DRAFT_MODEL_PATH:?set DRAFT_MODEL_PATH to the DFlash drafter checkpoint (dir or HF repo id)}"

export SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR="${HICACHE_DIR:-/mnt/hicache}"
mkdir -p "$SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"

args=(--config "$config" --speculative-draft-model-path "$DRAFT_MODEL_PATH")
if [[ "${KV_EVENTS:-0}" == "1" ]]; then
  kv_port="${KV_EVENTS_PORT:-5557}"
  replay_port="${KV_EVENTS_REPLAY_PORT:-5558}"
  args+=(--kv-events-config
         "{\"publisher\":\"zmq\",\"topic\":\"kv-events\",\"endpoint\":\"tcp://*:${kv_port}\",\"replay_endpoint\":\"tcp://*:${replay_port}\"}")
fi

exec python3 -m sglang.launch_server "${args[@]}" "$@"
