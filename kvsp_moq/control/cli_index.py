"""``kvsp index --listen HOST:PORT --config FILE``: run the Index Service (kvsp-draft §6.1, §6.2).

:func:`register_cli` adds the subcommand to the ``kvsp`` parser (``kvsp_moq/cli/``). Once
listening, the command prints one line, ``kvsp index: listening on URL``, with the bound port
(useful with port 0), and serves until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys

from .config import ControlConfig, load_config
from .errors import ConfigError
from .http import serve_index

DEFAULT_LISTEN = "127.0.0.1:8470"


def register_cli(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    """Add ``index`` to ``subparsers``; its handler is ``args.handler(args) -> int``."""
    parser = subparsers.add_parser(
        "index",
        help="run the Index Service (replica records, lookup)",
        description="Run the KVSP Index Service over HTTP (docs/http-api.md).",
    )
    parser.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                        help=f"address to listen on; port 0 picks a free port (default {DEFAULT_LISTEN})")
    parser.add_argument("--config", required=True, metavar="FILE", help="TOML configuration (principals, [index])")
    parser.set_defaults(handler=run_index)
    return parser


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


def run_index(args: argparse.Namespace) -> int:
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
    async with await serve_index(config, host, port) as server:
        print(f"kvsp index: listening on {server.url}", flush=True)
        await stop.wait()
