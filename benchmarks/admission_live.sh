#!/usr/bin/env bash
# Admission control measured live: `kvrouter loadtest` against `kvrouter serve` in front of
# simulated replicas (docs/admission.md). Writes docs/admission/live-*.json.
#   benchmarks/admission_live.sh [DURATION_WALL_S]
# Times: the replicas run TIME_SCALE model seconds per wall second; loadtest reports model time,
# while the router's SLO is in wall seconds (SLO_WALL_S = SLO_MODEL_S / TIME_SCALE).
set -euo pipefail
cd "$(dirname "$0")/.."
KV=${KV:-.venv/bin/kvrouter}
DURATION=${1:-60}
TIME_SCALE=5
SLO_MODEL_S=10
SLO_WALL_S=$(python3 -c "print($SLO_MODEL_S / $TIME_SCALE)")
OUT=docs/admission
BASE=${BASE_PORT:-47310}
REPLICAS=(http://127.0.0.1:$((BASE + 1)) http://127.0.0.1:$((BASE + 2)))
ROUTER=http://127.0.0.1:$((BASE))
TMP=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$TMP"; }
trap cleanup EXIT
mkdir -p "$OUT"

for i in 1 2; do
  "$KV" sim-replica --host 127.0.0.1 --port $((BASE + i)) --profile kimi-k2.6-b200-tp4 \
    --time-scale $TIME_SCALE --seed $i \
    >"$TMP/replica-$i.log" 2>&1 &
  PIDS+=($!)
done

sha() { printf %s "$1" | sha256sum | cut -d' ' -f1; }
STEADY=$(sha steady-key); BURST=$(sha burst-key)

# $1: name, $2: admission section (YAML flow), $3: policy params
start_router() {
  cat >"$TMP/$1.yaml" <<YAML
server: {host: 127.0.0.1, port: $BASE, replica_header: true}
replicas: [${REPLICAS[0]}, ${REPLICAS[1]}]
policy: {name: coding-agent, params: $3}
admission: $2
YAML
  "$KV" serve --config "$TMP/$1.yaml" >"$TMP/router-$1.log" 2>&1 &
  ROUTER_PID=$!
  for _ in $(seq 100); do curl -sf "$ROUTER/ready" >/dev/null && return; sleep 0.2; done
  echo "router $1 did not become ready" >&2; cat "$TMP/router-$1.log" >&2; exit 1
}
stop_router() {
  local m
  m=$(curl -s "$ROUTER/metrics" | grep '^kvrouter_admission' | grep -v '_created' || true)
  if [ -n "$m" ]; then echo "$m" >"$OUT/live-$1.metrics.txt"; fi
  kill "$ROUTER_PID"; wait "$ROUTER_PID" 2>/dev/null || true
}
flush() { for r in "${REPLICAS[@]}"; do curl -sf -X POST "$r/flush_cache" >/dev/null || true; done; }
load() {  # $1: json out, $2: users, $3: seed, rest: extra loadtest flags (they win)
  local out=$1 users=$2 seed=$3; shift 3
  "$KV" loadtest --target "$ROUTER" --users "$users" --duration "$DURATION" --seed "$seed" \
    --time-scale $TIME_SCALE --warm-start --ramp 30 --warmup 30 --drain-timeout 120 \
    --replica-metrics "${REPLICAS[@]}" --json "$out" "$@" >"$TMP/$(basename "$out").log" 2>&1
}

# 1. Overload: 24 users on 2 replicas, without admission, then with the queue and a TTFT SLO.
for run in no_admission queue_slo; do
  flush
  if [ $run = no_admission ]; then start_router $run "{}" "{}"
  else start_router $run "{queue: true, ttft_slo_s: $SLO_WALL_S}" "{}"; fi
  load "$OUT/live-overload-$run.json" 24 0
  stop_router $run
done

# 2. Two tenants (API keys): 4 steady users, then a third of the way in 48 users of the other
# tenant all at once, with the router holding the backlog (replica_max_running 4). Both keys one
# tenant (arrival order), then two. The steady tenant is measured from the burst on.
PARAMS="{replica_max_running: 4}"
BURST_AT=$((DURATION / 3))
for run in arrival_order fair_share; do
  flush
  if [ $run = arrival_order ]; then
    start_router $run "{queue: true, tenants: {all: {api_key_sha256: [$STEADY, $BURST]}}}" "$PARAMS"
  else
    start_router $run "{queue: true, tenants: {steady: {api_key_sha256: [$STEADY]}, burst: {api_key_sha256: [$BURST]}}}" "$PARAMS"
  fi
  load "$OUT/live-tenants-$run-steady.json" 4 1 --header "Authorization: Bearer steady-key" \
    --warmup $((BURST_AT * TIME_SCALE)) &
  STEADY_LOAD=$!
  sleep $BURST_AT
  DURATION=$((DURATION - BURST_AT)) load "$OUT/live-tenants-$run-burst.json" 48 2 \
    --header "Authorization: Bearer burst-key" --ramp 0 --warmup 0
  wait $STEADY_LOAD
  stop_router $run
done
echo "results in $OUT/live-*.json"
