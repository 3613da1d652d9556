"""Serving the dashboard: :func:`serve_dashboard` (docs/dashboard.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from ..common.auth import Authorizer
from ..common.tls import TlsConfig
from ..http.server import RunningServer, build_app, serve_app
from .collect import Collector, DashboardSources
from .routes import DashboardRoutes

__all__ = ["DASHBOARD_COLLECTOR", "serve_dashboard"]

DASHBOARD_COLLECTOR = web.AppKey("kvsp_dashboard_collector", Collector)


async def serve_dashboard(sources: DashboardSources, token: str | None, host: str = "127.0.0.1", port: int = 0, *,
                          tls: TlsConfig | None = None) -> RunningServer:
    """Serve the page and its JSON on ``host:port`` (plain HTTP: the page carries no secret;
    the roles are called with ``token`` under ``tls``'s client rules) until the server closes."""
    collector = Collector(sources, token, tls=tls or TlsConfig())
    app = build_app(auth=Authorizer.from_tokens({}), routes=DashboardRoutes(collector).routes())
    app[DASHBOARD_COLLECTOR] = collector

    async def close_clients(app: web.Application) -> AsyncIterator[None]:
        yield
        await collector.close()

    app.cleanup_ctx.append(close_clients)
    return await serve_app(app, host, port)
