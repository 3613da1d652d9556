"""``kvsp pc --listen HOST:PORT --config FILE`` (kvsp-draft §6.3, §6.4, §6.5); see :mod:`.common.cli`."""

from __future__ import annotations

import argparse

from ..common import cli as cli_roles
from .serve import serve_pc

ROLE = cli_roles.RoleCommand(
    name="pc",
    help="run the Placement Controller (instance status, placement)",
    description="Run the KVSP Placement Controller over HTTP (docs/http-api.md, section Placement Controller).",
    default_listen="127.0.0.1:8472",
    section="pc",
    serve=serve_pc,
)
DEFAULT_LISTEN = ROLE.default_listen


def register_cli(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    """Add ``pc`` to ``subparsers``; its handler is :func:`run_pc`."""
    return cli_roles.register(subparsers, ROLE, run_pc)


def run_pc(args: argparse.Namespace) -> int:
    return cli_roles.run(ROLE, args)
