"""``kvsp pc --listen HOST:PORT --config FILE``: run the Placement Controller (instance status, placement) (kvsp-draft §6.3, §6.4, §6.5).

:func:`register_cli` adds the subcommand to the ``kvsp`` parser (``kvsp_moq/cli/``). Once
listening, the command prints one line, ``kvsp pc: listening on URL``, and serves until
SIGINT or SIGTERM. The ``[pc]`` section of the configuration (docs/http-api.md "Placement Controller")
sets it up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys

from .cli_index import parse_listen
from .config import ControlConfig, load_config
from .errors import ConfigError
from .http import serve_pc

DEFAULT_LISTEN = "127.0.0.1:8472"


def register_cli(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    """Add ``pc`` to ``subparsers``; its handler is ``args.handler(args) -> int``."""
    parser = subparsers.add_parser(
        "pc",
        help="run the Placement Controller (instance status, placement)",
        description="Run the KVSP Placement Controller over HTTP (docs/http-api.md, section Placement Controller).",
    )
    parser.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                        help=f"address to listen on; port 0 picks a free port (default {DEFAULT_LISTEN})")
    parser.add_argument("--config", required=True, metavar="FILE", help="TOML configuration (principals, [pc])")
    parser.set_defaults(handler=run_pc)
    return parser


def run_pc(args: argparse.Namespace) -> int:
    try:
        host, port = parse_listen(args.listen)
        config = load_config(args.config)
    except (ValueError, ConfigError) as exc:
        print(f"kvsp: {exc}", file=sys.stderr)
        return 2
    asyncio.run(_serve(config, host, port))
    return 0


async def _serve(config: ControlConfig, host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # not on Windows
            loop.add_signal_handler(sig, stop.set)
    async with await serve_pc(config, host, port) as server:
        print(f"kvsp pc: listening on {server.url}", flush=True)
        await stop.wait()
