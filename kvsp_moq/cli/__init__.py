"""The ``kvsp`` command: argument parsing and dispatch. Each subcommand lives in its own module.

A bad flag prints the usage of the (sub)command it was given to, not the top-level one
(:class:`_Parser`); every failure of a handler is one ``kvsp: ...`` line (cli/errors.py).
Only the module of the subcommand that is run is imported (cli/commands.py): ``kvsp --version``
and ``kvsp --help`` import none of them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Collection
from importlib import metadata
from typing import Sequence

from . import relay_cmd
from .commands import GROUPS


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


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``kvsp`` parser. With ``commands``, only the modules of those subcommands are
    imported and registered; every other subcommand is a stub with its name and help line,
    enough for ``kvsp --help`` and for argparse to refuse an unknown command."""
    parser: argparse.ArgumentParser = _Parser(prog="kvsp", description="KV Cache Storage Protocol over MOQT")
    parser.add_argument("--version", action="version", version=f"kvsp {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        if commands is None or not set(group.names).isdisjoint(commands):
            group.load()(sub)
        else:
            group.add_stubs(sub)
    return parser


def _command_of(args: Sequence[str]) -> set[str]:
    """The subcommand named in ``args``: the first word that is not an option (the top-level
    options take no value). Empty when there is none, or when ``--help`` or ``--version``
    comes first: argparse answers that before it reaches any subcommand."""
    for arg in args:
        if arg in ("-h", "--help", "--version"):
            return set()
        if not arg.startswith("-"):
            return {arg}
    return set()


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["relay"]:
        return relay_cmd.run(args_list[1:])
    parser = build_parser(_command_of(args_list))
    args = parser.parse_args(args_list)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("kvsp: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # every failure: one line, with the hint it needs
        from . import errors  # imports the MOQT stack: only once a handler has failed

        errors.print_traceback(exc)
        message, status = errors.describe(exc)
        print(f"kvsp: {message}", file=sys.stderr)
        return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
