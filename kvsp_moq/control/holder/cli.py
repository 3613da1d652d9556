"""``kvsp holder --listen HOST:PORT --config FILE`` (kvsp-draft §6.1, §6.6, §6.7); see :mod:`.common.cli`."""

from __future__ import annotations

import argparse

from ..common import cli as cli_roles
from .serve import serve_holder

ROLE = cli_roles.RoleCommand(
    name="holder",
    help="run a holder (block storage and retrieval, leases)",
    description="Run a KVSP holder over HTTP (docs/http-api.md, section Holder).",
    default_listen="127.0.0.1:8471",
    section="holder",
    serve=serve_holder,
)
DEFAULT_LISTEN = ROLE.default_listen


def register_cli(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    """Add ``holder`` to ``subparsers``; its handler is :func:`run_holder`."""
    return cli_roles.register(subparsers, ROLE, run_holder)


def run_holder(args: argparse.Namespace) -> int:
    return cli_roles.run(ROLE, args)
