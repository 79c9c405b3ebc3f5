"""The demo's settings: read by the command line's defaults and by the demo itself (a module
of its own so that building the command line imports none of the load tools)."""

# The demo: 4 replicas of the default profile (KV for ~2.7 sessions of 100k tokens each) and 16
# coding-agent users: 4 sessions per replica, more than its KV holds (so where a session lands
# decides whether its next turn is a ~0.2 s warm prefill or a ~3 s cold one) but a fleet sized for
# its load (TTFT p50 well under a second). Past ~6 users per replica the fleet is overloaded: at
# 48 the first token waits seconds, rounds differ more than policies do, and coding-agent is level
# with prefix_aware on cache hits (docs/routing.md, "The demo's load"; the simulator over 12
# seeds per load: benchmarks/demo_load.py). Each user's first session starts mid-life so prompts
# are ~100k tokens at once. One 60 s round per policy was too few requests: the verdict flipped
# from run to run. So the demo runs `DEMO_ROUNDS` rounds with different seeds and reports each
# policy's mean and range (loadtest/demo_summary.py). Time scale 8 keeps the ~7 ms of wall overhead
# per request at ~56 ms of model time (the same for every policy; see docs/compare/report.md,
# caveats); 25 s of wall per run = 3.3 model minutes, the first minute (ramp) not measured. The
# policies: the default, the strongest baseline (prefix_aware, the SGLang gateway's cache_aware rule)
# and consistent hashing. About 5 minutes wall on 2 cores in all (the estimate printed at the start).
DEMO_REPLICAS = 4
DEMO_PROFILE = "kimi-k2.6-b200-tp4"
DEMO_POLICIES = ("coding-agent", "prefix_aware", "consistent_hash")
DEMO_USERS = 16
DEMO_ROUNDS = 3
DEMO_DURATION_S = 25.0
DEMO_TIME_SCALE = 8.0
DEMO_RAMP_S = 60.0
DEMO_WARMUP_S = 60.0
DEMO_OUT_DIR = "kvrouter-demo"
