"""What every ``kvsp <role> --listen HOST:PORT --config FILE`` command shares.

A role command loads the TOML configuration, starts its HTTP service (its ``serve.serve_*``),
prints one line ``kvsp <role>: listening on URL`` (the bound port, useful with port 0), and
serves until SIGINT or SIGTERM. A bad ``--listen`` or configuration exits 2 with the reason, one
line (``kvsp: cannot read config FILE: ...``, ``kvsp: invalid config FILE: KEY: ...``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .config import ControlConfig, load_config
from .errors import ConfigError

Handler = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class RoleCommand:
    """One role's subcommand: its name, texts, default address and service starter."""

    name: str
    help: str
    description: str
    default_listen: str
    section: str
    serve: Callable[[ControlConfig, str, int], Awaitable[Any]]


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT`` to (host, port); ``ValueError`` otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"--listen must be HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen port must be 0..65535, got {port!r}")
    return host, int(port)


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]", role: RoleCommand,
             handler: Handler) -> argparse.ArgumentParser:
    """Add ``role``'s subcommand; its handler is ``args.handler(args) -> int``."""
    parser = subparsers.add_parser(role.name, help=role.help, description=role.description)
    parser.add_argument("--listen", default=role.default_listen, metavar="HOST:PORT",
                        help=f"address to listen on; port 0 picks a free port (default {role.default_listen})")
    parser.add_argument("--config", required=True, metavar="FILE",
                        help=f"TOML configuration (principals, [{role.section}])")
    parser.set_defaults(handler=handler)
    return parser


def run(role: RoleCommand, args: argparse.Namespace) -> int:
    try:
        host, port = parse_listen(args.listen)
        config = load_config(args.config)
    except ValueError as exc:  # ConfigError too: one line, the file and the key at fault
        where = f"invalid config {args.config}: " if isinstance(exc, ConfigError) and exc.key else ""
        print(f"kvsp: {where}{exc}", file=sys.stderr)
        return 2
    asyncio.run(_serve(role, config, host, port))
    return 0


async def _serve(role: RoleCommand, config: ControlConfig, host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # not on Windows
            loop.add_signal_handler(sig, stop.set)
    async with await role.serve(config, host, port) as server:
        print(f"kvsp {role.name}: listening on {server.url}", flush=True)
        await stop.wait()
