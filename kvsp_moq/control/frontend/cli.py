"""``kvsp frontend --listen HOST:PORT --config FILE`` (kvsp-draft §6.8); see :mod:`.common.cli`."""

from __future__ import annotations

import argparse

from ..common import cli as cli_roles
from .serve import serve_frontend

ROLE = cli_roles.RoleCommand(
    name="frontend",
    help="run a front end (output tokens exactly once per index, sessions for clients)",
    description="Run the KVSP front end over HTTP (docs/http-api.md, section Front end).",
    default_listen="127.0.0.1:8474",
    section="frontend",
    serve=serve_frontend,
)
DEFAULT_LISTEN = ROLE.default_listen


def register_cli(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    """Add ``frontend`` to ``subparsers``; its handler is :func:`run_frontend`."""
    return cli_roles.register(subparsers, ROLE, run_frontend)


def run_frontend(args: argparse.Namespace) -> int:
    return cli_roles.run(ROLE, args)
