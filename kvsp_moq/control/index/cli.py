"""``kvsp index --listen HOST:PORT --config FILE`` (kvsp-draft §6.1, §6.2); see :mod:`.common.cli`."""

from __future__ import annotations

import argparse

from ..common import cli as cli_roles
from .serve import serve_index


ROLE = cli_roles.RoleCommand(
    name="index",
    help="run the Index Service (replica records, lookup)",
    description="Run the KVSP Index Service over HTTP (docs/http-api.md).",
    default_listen="127.0.0.1:8470",
    section="index",
    serve=serve_index,
)
DEFAULT_LISTEN = ROLE.default_listen


def register_cli(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    """Add ``index`` to ``subparsers``; its handler is :func:`run_index`."""
    return cli_roles.register(subparsers, ROLE, run_index)


def run_index(args: argparse.Namespace) -> int:
    return cli_roles.run(ROLE, args)
