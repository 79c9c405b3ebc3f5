#!/bin/sh
# The cluster-simulator runs behind the "Simulated" table of docs/disaggregation.md.
# Same seeded coding-agent traffic, 50 servers of kimi-k2.6-b200-tp4 in each fleet.
kvrouter simulate --replicas 50 --sessions 250 --duration 600 --seed 1 --json docs/disaggregation/sim-colocated.json
kvrouter simulate --replicas 50 --sessions 250 --duration 600 --seed 1 --layout pd --json docs/disaggregation/sim-pd.json
kvrouter simulate --replicas 50 --sessions 250 --duration 600 --seed 1 --layout pd --decode-servers 15 --json docs/disaggregation/sim-pd-35p15d.json
# FP8 KV, and DP attention: 50 replicas of 4 ranks (the same 200 GPUs)
kvrouter simulate --replicas 50 --sessions 250 --duration 600 --seed 1 --profile kimi-k2.6-b200-tp4-fp8kv --json docs/disaggregation/sim-fp8kv-colocated.json
kvrouter simulate --replicas 50 --sessions 250 --duration 600 --seed 1 --profile kimi-k2.6-b200-tp4-fp8kv --layout pd --json docs/disaggregation/sim-fp8kv-pd.json
kvrouter simulate --replicas 50 --sessions 250 --duration 600 --seed 1 --profile kimi-k2.6-b200-tp4-dp4-fp8kv --layout dp --dp-size 4 --json docs/disaggregation/sim-fp8kv-dp4.json
