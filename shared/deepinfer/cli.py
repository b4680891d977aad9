"""The `deepinfer` command: a registry of subcommands, each importing what it needs only when it runs.

`deepinfer --help` and `deepinfer config` never import torch. A later subcommand (`serve`, `up`, `generate`)
is one more `Subcommand` in `SUBCOMMANDS` whose `run` function imports its heavy modules inside.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    """One `deepinfer <name>` command: its arguments and the function that runs it (returns the exit code)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    from deepinfer.config import SERVICE_SETTINGS

    parser.add_argument("--json", action="store_true", help="machine-readable output (a JSON list of settings)")
    parser.add_argument(
        "--service", choices=["common", *SERVICE_SETTINGS], help="only the settings of this group"
    )


def _config_run(args: argparse.Namespace) -> int:
    from deepinfer.config import ALL_SETTINGS, describe_settings, load_settings
    from deepinfer.config.renamed import deprecated_env_names, removed_env_names

    loaded = [load_settings(cls) for cls in ALL_SETTINGS]  # exits 2 with one line on a bad env value
    rows = describe_settings(loaded)
    known = {row.env for row in rows}
    known |= {old for cls in ALL_SETTINGS for old in deprecated_env_names(cls)}  # read, with a warning of their own
    known |= {old for cls in ALL_SETTINGS for old in removed_env_names(cls)}  # reported as having no effect
    for name in sorted(os.environ):
        if name.startswith("DEEPINFER_") and name not in known:  # most likely a typo
            print(f"deepinfer: warning: unknown setting {name} is ignored", file=sys.stderr)
    rows = [row for row in rows if args.service in (None, row.group)]
    if args.json:
        print(json.dumps([row.to_dict() for row in rows], indent=2))
        return 0
    table = [("ENV", "TYPE", "DEFAULT", "VALUE", "DESCRIPTION")]
    table += [(r.env, r.type, r.default, r.value or "", r.description) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(4)]
    for line in table:
        cells = [cell.ljust(width) for cell, width in zip(line[:4], widths, strict=True)]
        print("  ".join([*cells, line[4]]).rstrip())
    return 0


#: Services `deepinfer serve` runs: `services.<name>.main:main`.
SERVICE_NAMES = ("gateway", "scheduler", "prefill", "decode", "kvcache")


def _generate_arguments(parser: argparse.ArgumentParser) -> None:
    from deepinfer.engine.cli_generate import add_arguments

    add_arguments(parser)


def _generate_run(args: argparse.Namespace) -> int:
    from deepinfer.engine.cli_generate import run

    return run(args)


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "service", choices=SERVICE_NAMES, help="the service to run (settings from the environment)"
    )


def _serve_run(args: argparse.Namespace) -> int:
    import importlib

    module_name = f"services.{args.service}.main"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name not in (module_name, f"services.{args.service}"):
            raise
        print(f"deepinfer: service {args.service!r} is not available in this installation", file=sys.stderr)
        return 2
    return module.main()


def _prepare_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # settings only: DEEPINFER_MODEL and DEEPINFER_MODEL_CACHE_DIR


def _prepare_run(args: argparse.Namespace) -> int:
    from deepinfer.config import CommonSettings, load_settings
    from deepinfer.model_store import resolve_model

    common = load_settings(CommonSettings)  # exits 2 with one line on a bad env value
    try:
        model_dir = resolve_model(common.model, common.model_cache_dir, progress=False)
    except (ValueError, FileNotFoundError) as exc:
        print(f"deepinfer: {exc}", file=sys.stderr)
        return 2
    print(model_dir)
    return 0


def _up_arguments(parser: argparse.ArgumentParser) -> None:
    from deepinfer.up.cli import add_arguments

    add_arguments(parser)


def _up_run(args: argparse.Namespace) -> int:
    from deepinfer.up.cli import run

    return run(args)


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    from deepinfer.bench.cli import add_arguments

    add_arguments(parser)


def _bench_run(args: argparse.Namespace) -> int:
    from deepinfer.bench.cli import run

    return run(args)


#: Every subcommand, by name.
SUBCOMMANDS: dict[str, Subcommand] = {
    command.name: command
    for command in (
        Subcommand(
            name="bench",
            help="`run` a load sweep against an OpenAI-compatible server; `compare` two results (exit 1 if worse)",
            add_arguments=_bench_arguments,
            run=_bench_run,
        ),
        Subcommand(
            name="config",
            help="print every setting (env name, type, default, current value) and validate the environment",
            add_arguments=_config_arguments,
            run=_config_run,
        ),
        Subcommand(
            name="generate",
            help="generate text offline with the engine in this process (no services)",
            add_arguments=_generate_arguments,
            run=_generate_run,
        ),
        Subcommand(
            name="prepare",
            help="prepare DEEPINFER_MODEL into DEEPINFER_MODEL_CACHE_DIR once (an init step) and print its directory",
            add_arguments=_prepare_arguments,
            run=_prepare_run,
        ),
        Subcommand(
            name="serve",
            help="run one service (gateway, scheduler, prefill, decode, kvcache) until SIGTERM",
            add_arguments=_serve_arguments,
            run=_serve_run,
        ),
        Subcommand(
            name="up",
            help="run a private nats-server and every service on this machine until Ctrl-C",
            add_arguments=_up_arguments,
            run=_up_run,
        ),
    )
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every registered subcommand."""
    from deepinfer import __version__

    parser = argparse.ArgumentParser(prog="deepinfer", description="Prefix-cache-first, disaggregated LLM serving.")
    parser.add_argument("--version", action="version", version=f"deepinfer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in SUBCOMMANDS.values():
        sub_parser = sub.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `deepinfer` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    return args._run(args)


if __name__ == "__main__":
    sys.exit(main())
