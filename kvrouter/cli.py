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

    run(_router_config(args))
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrouter", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_serve, _add_check_config):
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
