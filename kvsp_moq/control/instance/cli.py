"""``kvsp instance --listen HOST:PORT --config FILE`` (kvsp-draft §6.3, §6.5, §6.8 sessions on its model); see :mod:`.common.cli`."""

from __future__ import annotations

import argparse

from ..common import cli as cli_roles
from .serve import serve_model_instance

ROLE = cli_roles.RoleCommand(
    name="instance",
    help="run an inference instance (prefetch, state, sessions on its model)",
    description="Run the KVSP Inference Instance over HTTP (docs/http-api.md, section Inference Instance).",
    default_listen="127.0.0.1:8473",
    section="instance",
    serve=serve_model_instance,  # sessions on [instance.engine] (session_engine = "model")
)
DEFAULT_LISTEN = ROLE.default_listen


def register_cli(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    """Add ``instance`` to ``subparsers``; its handler is :func:`run_instance`."""
    return cli_roles.register(subparsers, ROLE, run_instance)


def run_instance(args: argparse.Namespace) -> int:
    return cli_roles.run(ROLE, args)
