"""The ``kvsp`` command: argument parsing and dispatch. Each subcommand lives in its own module.

A bad flag prints the usage of the (sub)command it was given to, not the top-level one
(:class:`_Parser`); every failure of a handler is one ``kvsp: ...`` line (cli/errors.py).
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from typing import Sequence


from ..control.frontend import cli as cli_frontend
from ..control.holder import cli as cli_holder
from ..control.index import cli as cli_index
from ..control.instance import cli as cli_instance
from ..control.pc import cli as cli_pc
from . import bench, core, dashboard, demo, errors, moq, relay_cmd, soak


def _version() -> str:
    """The installed distribution's version (pyproject.toml), as ``pip show kvsp-moq``."""
    try:
        return metadata.version("kvsp-moq")
    except metadata.PackageNotFoundError:  # a checkout that is not installed
        return "unknown (not installed)"


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose unrecognized arguments are an error of the parser that was
    given them. argparse lets a sub-command's parser pass them up to the top-level one,
    which then prints its own usage (``kvsp demo --jsn`` showed ``usage: kvsp COMMAND``);
    sub-parsers are made with the class of their parent, so every level is a ``_Parser``."""

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = _Parser(prog="kvsp", description="KV Cache Storage Protocol over MOQT")
    parser.add_argument("--version", action="version", version=f"kvsp {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    core.register(sub)
    bench.register(sub)
    demo.register(sub)
    soak.register(sub)
    dashboard.register(sub)
    moq.register(sub)
    cli_index.register_cli(sub)
    cli_holder.register_cli(sub)
    cli_pc.register_cli(sub)
    cli_instance.register_cli(sub)
    cli_frontend.register_cli(sub)
    relay_cmd.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["relay"]:
        return relay_cmd.run(args_list[1:])
    parser = build_parser()
    args = parser.parse_args(args_list)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("kvsp: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # every failure: one line, with the hint it needs
        errors.print_traceback(exc)
        message, status = errors.describe(exc)
        print(f"kvsp: {message}", file=sys.stderr)
        return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
