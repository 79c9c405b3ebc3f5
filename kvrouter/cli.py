"""The `kvrouter` console script: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from kvrouter.router.config import ConfigError, RouterConfig, load_config, with_overrides

Command = Callable[[argparse.Namespace], int]


def _router_config(args: argparse.Namespace) -> RouterConfig:
    base = load_config(args.config) if args.config else RouterConfig()
    config = with_overrides(
        base, host=args.host, port=args.port, replicas=args.replica, policy=args.policy,
        prefill=args.prefill, decode=args.decode,
    )
    if not config.replicas and not config.discovery.enabled:
        raise ConfigError(
            "replicas: at least one replica is needed (--replica URL, a config file or discovery)"
        )
    return config


def _reread(args: argparse.Namespace) -> RouterConfig | None:
    """SIGHUP re-reads the same file with the same flags on top (None: no file to re-read).
    A module-level function (with functools.partial), so --workers can hand it to each worker."""
    return _router_config(args) if args.config else None


def cmd_serve(args: argparse.Namespace) -> int:
    import functools

    from kvrouter.router.serve import run

    return run(_router_config(args), reader=functools.partial(_reread, args), workers=args.workers)


def cmd_check_config(args: argparse.Namespace) -> int:
    config = load_config(args.file)
    print(f"{args.file}: ok ({len(config.replicas)} replicas, policy {config.policy.name})")
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="run the router")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--replica", action="append", help="replica base URL (repeatable)")
    p.add_argument("--host", help="bind address")
    p.add_argument("--port", type=int, help="data port")
    p.add_argument("--policy", help="routing policy name")
    p.add_argument("--prefill", action="append", metavar="URL[=BOOTSTRAP_PORT]",
                   help="prefill server of a PD-disaggregated fleet (repeatable; port default 8998)")
    p.add_argument("--decode", action="append", metavar="URL",
                   help="decode server of a PD-disaggregated fleet (repeatable)")
    p.add_argument("--workers", type=int, default=1,
                   help="worker processes sharing the port (SO_REUSEPORT); > 1 needs affinity.store: redis")
    p.set_defaults(func=cmd_serve)


def _add_check_config(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("check-config", help="validate a config file without serving")
    p.add_argument("file")
    p.set_defaults(func=cmd_check_config)


def cmd_sim_replica(args: argparse.Namespace) -> int:
    from kvrouter.loadtest.sim_server import run

    return run(args)


def _add_sim_replica(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("sim-replica", help="run one simulated SGLang replica (HTTP + metrics + KV events)")
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, required=True, help="HTTP port")
    p.add_argument("--profile", default="tiny", help="replica profile name or YAML path")
    p.add_argument("--time-scale", type=float, default=1.0, help="model seconds per wall second")
    p.add_argument("--seed", type=int, default=0)
    # SGLang's own flag names
    p.add_argument("--served-model-name", help="model name reported by the API (default: profile name)")
    p.add_argument("--max-running-requests", type=int)
    p.add_argument("--page-size", type=int)
    p.add_argument("--context-length", type=int)
    p.add_argument("--chars-per-token", type=float, default=4.0,
                   help="prompt bytes per token of the simulated tokenizer (default 4; e.g. 1.5 for CJK-like, 8)")
    p.add_argument("--enable-cache-report", dest="enable_cache_report", action="store_true", default=True,
                   help="usage.prompt_tokens_details.cached_tokens (default on)")
    p.add_argument("--disable-cache-report", dest="enable_cache_report", action="store_false")
    p.add_argument("--enable-metrics", dest="enable_metrics", action="store_true", default=True,
                   help="serve /metrics (default on)")
    p.add_argument("--disable-metrics", dest="enable_metrics", action="store_false")
    p.add_argument("--kv-events-config", help='JSON, e.g. \'{"publisher":"zmq","topic":"kv-events","endpoint":"tcp://*:5557"}\'')
    p.add_argument("--dp-size", type=int, default=1,
                   help="DP-attention ranks: one radix cache, KV pool and load per rank")
    p.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default="null",
                   help="prefill/decode disaggregation role (SGLang's flag; null = colocated)")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998,
                   help="prefill side: port of its bootstrap server (SGLang's default 8998)")
    p.add_argument("--disaggregation-bootstrap-timeout", type=float, default=300.0,
                   help="decode side: wall seconds to wait for the prefill half of a request")
    p.add_argument("--disaggregation-transfer-gbps", type=float, default=50.0,
                   help="KV transfer bandwidth prefill -> decode in GB/s (model time)")
    p.set_defaults(func=cmd_sim_replica)


def cmd_loadtest(args: argparse.Namespace) -> int:
    from kvrouter.loadtest.commands import cmd_loadtest as run

    return run(args)


def _add_loadtest(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("loadtest", help="drive an OpenAI-compatible endpoint with coding-agent sessions")
    p.add_argument("--target", required=True, help="base URL of the router or replica under test")
    p.add_argument("--workload", default="coding-agent", help="workload YAML file or built-in name (coding-agent, tiny)")
    p.add_argument("--users", type=int, help="concurrent closed-loop users")
    p.add_argument("--arrival-rate", type=float, help="new sessions per model-second (Poisson) instead of --users")
    p.add_argument("--duration", type=float, required=True, help="wall seconds during which turns start")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-scale", type=float, default=1.0, help="the replicas' --time-scale (reports model time)")
    p.add_argument("--replica-metrics", action="extend", nargs="+", metavar="URL",
                   help="replica base or /metrics URLs sampled for load imbalance")
    p.add_argument("--json", metavar="OUT", help="write the results contract (schema 1) here")
    p.add_argument("--contender", default="target", help="name of the target in the results")
    p.add_argument("--model", default="default", help="model field of every request")
    p.add_argument("--header", action="append", default=[], metavar="'NAME: VALUE'",
                   help="header sent with every request (repeatable), e.g. an API key or x-priority")
    _add_load_shape(p)
    p.add_argument("--trace", metavar="FILE", help="replay a trace (Mooncake .jsonl, Claude Code .json, a folder, a router decision log, or a bundled sample name) instead of --users")
    p.set_defaults(func=cmd_loadtest)


def _add_load_shape(p: argparse.ArgumentParser) -> None:
    """Options shared by loadtest and compare: how the load starts, ends and is measured."""
    p.add_argument("--drain-timeout", type=float, default=30.0, help="wall seconds in-flight requests get after --duration")
    p.add_argument("--ramp", type=float, default=0.0, help="model seconds over which the users start (default: all at once)")
    p.add_argument("--warm-start", action="store_true",
                   help="start each user's first session mid-life (steady-state contexts, cold caches)")
    p.add_argument("--warmup", type=float, default=0.0, help="model seconds at the start left out of the results")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _name_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def cmd_compare(args: argparse.Namespace) -> int:
    from kvrouter.loadtest.commands import cmd_compare as run

    return run(args)


def _add_compare(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("compare", help="compare routing policies and external routers on simulated replicas")
    p.add_argument("--replicas", type=int, default=8, help="simulated replicas (started once)")
    p.add_argument("--profile", default="kimi-k2.6-b200-tp4", help="replica profile name or YAML path")
    p.add_argument("--workload", default="coding-agent", help="workload YAML file or built-in name")
    p.add_argument("--policies", type=_name_list, default=["coding-agent", "consistent_hash", "round_robin", "prefix_aware"],
                   help="comma-separated kvrouter policies, each run as its own router (empty: none)")
    p.add_argument("--external", action="append", metavar="'NAME=COMMAND TEMPLATE'",
                   help="another router: {port}, {worker_urls} (space-separated), {worker_url_flags} "
                        "(--replica URL ...), {python} are substituted (repeatable)")
    p.add_argument("--users", type=_int_list, default=[8], help="comma-separated users levels, e.g. 2,4,8,16")
    p.add_argument("--duration", type=float, required=True, help="wall seconds of load per run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-scale", type=float, default=1.0, help="model seconds per wall second on the replicas")
    _add_load_shape(p)
    p.add_argument("--json", metavar="OUT", help="results JSON (default OUT_DIR/results.json)")
    p.add_argument("--out-dir", default="kvrouter-compare", help="report.md, results.json and charts (default ./kvrouter-compare)")
    p.set_defaults(func=cmd_compare)


def cmd_demo(args: argparse.Namespace) -> int:
    from kvrouter.loadtest.commands import cmd_demo as run

    return run(args)


def _add_demo(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvrouter.loadtest import demo_settings as c

    p = sub.add_parser("demo", help="the main job: coding-agent routing vs baselines on simulated replicas")
    p.add_argument("--out-dir", default=c.DEMO_OUT_DIR, help=f"report and charts (default ./{c.DEMO_OUT_DIR})")
    p.add_argument("--replicas", type=int, default=c.DEMO_REPLICAS)
    p.add_argument("--users", type=int, default=c.DEMO_USERS)
    p.add_argument("--rounds", type=int, default=c.DEMO_ROUNDS,
                   help="comparisons with seeds SEED, SEED+1, ...: the report shows each policy's mean and range")
    p.add_argument("--duration", type=float, default=c.DEMO_DURATION_S, help="wall seconds of load per policy and round")
    p.add_argument("--time-scale", type=float, default=c.DEMO_TIME_SCALE)
    p.add_argument("--ramp", type=float, default=c.DEMO_RAMP_S, help="model seconds over which the users start")
    p.add_argument("--warmup", type=float, default=c.DEMO_WARMUP_S, help="model seconds left out of the results")
    p.add_argument("--seed", type=int, default=0, help="the first round's seed")
    p.set_defaults(func=cmd_demo)


def _add_config_schema(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvrouter.router.schema import add_parser

    add_parser(sub)


def _add_simulate(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvrouter.loadtest.simulate_args import add_parser

    add_parser(sub)


def _add_profile_traffic(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvrouter.loadtest.traffic_profile import add_parser

    add_parser(sub)


def _add_report(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvrouter.loadtest.shadow_report import add_parser

    add_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrouter", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_serve, _add_check_config, _add_sim_replica, _add_loadtest, _add_compare, _add_demo,
                _add_simulate, _add_config_schema, _add_profile_traffic,
                _add_report):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    func: Command = args.func
    try:
        return func(args)
    except ConfigError as err:
        print(f"kvrouter: config error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
