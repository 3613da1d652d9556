"""``kvsp instance --listen HOST:PORT --config FILE``: run an inference instance's control plane (prefetch, state) (kvsp-draft §6.3, §6.5).

:func:`register_cli` adds the subcommand to the ``kvsp`` parser (``kvsp_moq/cli/``). Once
listening, the command prints one line, ``kvsp instance: listening on URL``, and serves until
SIGINT or SIGTERM. The ``[instance]`` section of the configuration (docs/http-api.md "Inference Instance")
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
from .http import serve_instance

DEFAULT_LISTEN = "127.0.0.1:8473"


def register_cli(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    """Add ``instance`` to ``subparsers``; its handler is ``args.handler(args) -> int``."""
    parser = subparsers.add_parser(
        "instance",
        help="run an inference instance's control plane (prefetch, state)",
        description="Run the KVSP Inference Instance over HTTP (docs/http-api.md, section Inference Instance).",
    )
    parser.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                        help=f"address to listen on; port 0 picks a free port (default {DEFAULT_LISTEN})")
    parser.add_argument("--config", required=True, metavar="FILE", help="TOML configuration (principals, [instance])")
    parser.set_defaults(handler=run_instance)
    return parser


def run_instance(args: argparse.Namespace) -> int:
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
    async with await serve_instance(config, host, port) as server:
        print(f"kvsp instance: listening on {server.url}", flush=True)
        await stop.wait()
