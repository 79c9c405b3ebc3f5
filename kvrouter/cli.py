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
        base, host=args.host, port=args.port, replicas=args.replica, policy=args.policy
    )
    if not config.replicas:
        raise ConfigError("replicas: at least one replica is needed (--replica URL or a config file)")
    return config


def cmd_serve(args: argparse.Namespace) -> int:
    from kvrouter.router.serve import run

    # SIGHUP re-reads the same file with the same flags on top.
    run(_router_config(args), reader=lambda: _router_config(args) if args.config else None)
    return 0


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
    p.add_argument("--enable-cache-report", dest="enable_cache_report", action="store_true", default=True,
                   help="usage.prompt_tokens_details.cached_tokens (default on)")
    p.add_argument("--disable-cache-report", dest="enable_cache_report", action="store_false")
    p.add_argument("--enable-metrics", dest="enable_metrics", action="store_true", default=True,
                   help="serve /metrics (default on)")
    p.add_argument("--disable-metrics", dest="enable_metrics", action="store_false")
    p.add_argument("--kv-events-config", help='JSON, e.g. \'{"publisher":"zmq","topic":"kv-events","endpoint":"tcp://*:5557"}\'')
    p.set_defaults(func=cmd_sim_replica)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrouter", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_serve, _add_check_config, _add_sim_replica):
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
