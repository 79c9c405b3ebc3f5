"""`kvrouter simulate`'s command line, apart from the simulator (loadtest/simulate.py), so that
building the console script's parser imports none of it."""

from __future__ import annotations

import argparse


def _run(args: argparse.Namespace) -> int:
    from .simulate import run

    return run(args)


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("simulate", help="discrete-event cluster simulation of routing policies")
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--profile", default="kimi-k2.6-b200-tp4")
    p.add_argument("--workload", default="coding-agent", help="workload YAML file or built-in name")
    p.add_argument("--trace", help="replay a trace (Mooncake JSONL, Claude Code JSON, a folder, or a "
                   "router decision log)")
    p.add_argument("--policy", "--policies", dest="policy", default="coding-agent",
                   help="comma-separated policies, each run on the same seeded traffic")
    p.add_argument("--duration", type=float, default=600.0, help="simulated seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sessions", type=int, help="concurrent sessions (default 5 per replica)")
    p.add_argument("--scale", action="append", help="scale event T:+K | T:-K | T:-name,name")
    p.add_argument("--poll-interval", type=float, default=0.25, help="signal poll interval (s)")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds not measured at the start")
    p.add_argument("--ramp", type=float, help="model seconds over which the sessions start, evenly "
                   "(as kvrouter compare's --ramp; default 60, or a quarter of --duration if shorter)")
    p.add_argument("--eos-median", type=int,
                   help="replies end at an EOS drawn as kvrouter sim-replica draws it without ignore_eos "
                        "(lognormal of this median, capped by max_tokens; 256 in kvrouter compare and "
                        "demo); default: every reply is its max_tokens long")
    p.add_argument("--warm-start-as-driver", action="store_true",
                   help="make, number and warm-start each user's first session as kvrouter compare's and "
                        "demo's load driver does for the same seed (default: the simulator's own draw); "
                        "with --ramp and --eos-median, the traffic of a live run of that seed (as live, "
                        "which sessions start warm can differ by policy)")
    p.add_argument("--cold-start", action="store_true",
                   help="sessions start at turn 1 instead of a random point of their life")
    p.add_argument("--page-tokens", type=int,
                   help="simulation resolution: model page size in tokens (default: the profile's; "
                        "512 halves the run time of large fleets, see docs/simulation.md)")
    p.add_argument("--world-perturb", action="append", metavar="SPEC",
                   help="run in a world unlike the policy's model; repeat for several worlds, each "
                        "with every policy on the same seeded traffic. SPEC: comma-separated "
                        "speed=F (prefill/decode F x the profile's speed), capacity=F (true KV pool "
                        "F x the profile's; replicas report it, the policy's default is unchanged), "
                        "signal-lag=S (polled signals reach the router S s late), or nominal. "
                        "E.g. --world-perturb speed=0.5 --world-perturb capacity=0.7,signal-lag=2")
    p.add_argument("--layout", choices=("colocated", "pd", "dp"), default="colocated",
                   help="fleet layout: colocated replicas; pd: the --replicas servers split into "
                        "prefill servers (the routed pool) and decode servers; dp: replicas of "
                        "--dp-size attention DP ranks (docs/disaggregation.md)")
    p.add_argument("--decode-servers", type=int,
                   help="with --layout pd: how many of the servers decode (default half)")
    p.add_argument("--dp-size", type=int,
                   help="with --layout dp: DP-attention ranks per replica (e.g. 4 with --profile "
                        "kimi-k2.6-b200-tp4-dp4-fp8kv)")
    p.add_argument("--json", help="write the schema-1 JSON here")
    p.set_defaults(func=_run)
