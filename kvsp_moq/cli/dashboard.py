"""``kvsp dashboard``: the live dashboard page for a running cluster (docs/dashboard.md).

It serves one HTML page and the JSON it polls every second on ``--listen`` (default
127.0.0.1:8090), and fills that JSON by calling the PC (and, when given, the IS, the front end,
holders and the relay's metrics endpoint) with ``--token`` / ``--token-file``: the token stays
in this process, the browser never sees it. Prints ``kvsp dashboard: open URL`` once it serves,
then runs until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

from ..control.common.cli import parse_listen
from ..control.common.errors import ConfigError
from ..control.common.tls import TlsConfig
from ..control.dashboard.collect import DashboardSources
from ..control.dashboard.serve import serve_dashboard

__all__ = ["keep_up_with_dashboard", "register", "sources_of"]

DEFAULT_LISTEN = "127.0.0.1:8090"


def _base(url: str) -> str:
    return url if url.endswith("/") else url + "/"


def sources_of(args: argparse.Namespace) -> DashboardSources:
    return DashboardSources(
        pc=_base(args.pc), index=_base(args.index) if args.index else None,
        frontend=_base(args.frontend) if args.frontend else None, relay_metrics=args.relay_metrics,
        holders=tuple(_base(h) for h in args.holder or ()))


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as f:
            token = f.read().strip()
        if not token:
            raise ValueError(f"--token-file {args.token_file}: the file is empty")
        return token
    return args.token or None


async def _serve(sources: DashboardSources, token: str | None, host: str, port: int, tls: TlsConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with await serve_dashboard(sources, token, host, port, tls=tls) as server:
        print(f"kvsp dashboard: open {server.url}", flush=True)
        await stop.wait()


def cmd_dashboard(args: argparse.Namespace) -> int:
    try:
        host, port = parse_listen(args.listen)
        token = _token(args)
        tls = TlsConfig(ca_file=args.ca, insecure=args.insecure)
    except (ValueError, ConfigError) as exc:
        print(f"kvsp: {exc}", file=sys.stderr)
        return 2
    asyncio.run(_serve(sources_of(args), token, host, port, tls))
    return 0


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("dashboard", help="serve a live dashboard page of a running cluster",
                       description="Serve a live dashboard of a running cluster (docs/dashboard.md): instances, "
                                   "sessions, where prompt blocks are, the relay's fan-out, hit ratio and TTFT over "
                                   "time. The roles are called with the token from this process; the page holds none.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--pc", required=True, metavar="URL", help="the Placement Controller's base URL")
    p.add_argument("--index", metavar="URL", help="the Index Service's base URL (replica records, the prefix picture)")
    p.add_argument("--frontend", metavar="URL", help="the front end's base URL (tokens delivered, duplicates)")
    p.add_argument("--relay-metrics", metavar="URL", help="the relay's metrics URL (relay --metrics: http://HOST:PORT/metrics)")
    p.add_argument("--holder", action="append", metavar="URL",
                   help="a holder's base URL (repeatable; holders named by replica records are found by themselves)")
    token = p.add_mutually_exclusive_group()
    token.add_argument("--token", metavar="T", help="bearer token for the roles (any principal's reads the metrics; "
                                                     "its scopes and instances bound what the listings show)")
    token.add_argument("--token-file", metavar="F", help="read the token from this file (keeps it out of `ps`)")
    p.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                   help="where the page is served (plain HTTP, no token: keep it on loopback or behind a proxy)")
    p.add_argument("--ca", metavar="FILE", help="trust anchors for HTTPS roles (PEM)")
    p.add_argument("--insecure", action="store_true", help="do not verify HTTPS roles' certificates")
    p.set_defaults(handler=cmd_dashboard)


async def keep_up_with_dashboard(stack: AsyncExitStack, cluster: Any, progress: Callable[[str], None]) -> None:
    """``kvsp demo --dashboard``: serve the dashboard of the demo's ``cluster`` (a
    ``demo.cluster.Cluster``: its PC, IS, front end, holder and relay) with the demo client's
    token, print its URL, and wait until cancelled (Ctrl-C); ``stack`` closes it with the rest."""
    sources = DashboardSources(pc=cluster.pc.url, index=cluster.index.url, frontend=cluster.frontend.url,
                               relay_metrics=cluster.relay.metrics_url, holders=(cluster.holder.url,))
    server = await stack.enter_async_context(await serve_dashboard(sources, cluster.tokens["client"]))
    progress(f"dashboard      {server.url} (the cluster stays up; Ctrl-C stops everything)")
    print(f"kvsp demo: dashboard on {server.url}", flush=True)
    await asyncio.Event().wait()
