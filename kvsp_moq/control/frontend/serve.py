"""Serving a front end (kvsp-draft §6.8) over HTTP: :func:`serve_frontend`."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from ..client.http import HttpClient, HttpPcClient
from ..common.config import ControlConfig, FrontEndConfig, pc_targets
from ..http.metrics import metrics_routes
from ..http.server import BoundUrl, RunningServer, build_app, serve_app
from .delivery import DeliveryStore, MemoryDeliveryStore
from .delivery_redis import RedisDeliveryStore
from .routes import FrontEndRoutes
from .service import FrontEnd

__all__ = ["FRONTEND_SERVICE", "serve_frontend"]

FRONTEND_SERVICE = web.AppKey("kvsp_frontend_service", FrontEnd)


async def serve_frontend(
    config: ControlConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    pc: HttpPcClient | None = None,
    store: DeliveryStore | None = None,
) -> RunningServer:
    """Run a front end per ``config.frontend`` (§6.8). ``pc`` defaults to :class:`HttpPcClient`
    for ``pc_url`` with ``pc_token`` (none: clients cannot start sessions, instances can still
    deliver to sessions registered in Python). Its URL is ``url``, else the bound address.
    The delivery state lives in ``store``, by default the one ``[frontend] store`` names
    (``memory``, or Redis: :mod:`.delivery_redis`, keeping each session's output ``retain_s``);
    the server closes it when it stops."""
    fc: FrontEndConfig = config.frontend
    owned: list[HttpClient] = []
    if pc is None and (fc.pc_url is not None or fc.pc_urls):
        pc = HttpPcClient(pc_targets(fc.pc_url, fc.pc_urls), fc.pc_token, failover_ms=fc.pc_failover_ms, tls=config.tls)
        owned.append(pc)
    url = BoundUrl(fc.url)
    if store is None:
        spec = fc.store_spec
        store = MemoryDeliveryStore() if spec.is_memory else RedisDeliveryStore(spec, retain_s=fc.retain_s)
    service = FrontEnd(config=fc, pc=pc, url=url, store=store)
    app = build_app(auth=config.auth, routes=[*FrontEndRoutes(service).routes(),
                                              *metrics_routes(fc.base_path, service.metrics, public=fc.metrics_public)])
    app[FRONTEND_SERVICE] = service

    async def end_streams(app: web.Application) -> None:
        service.close()  # open token streams would otherwise hold the shutdown

    app.on_shutdown.append(end_streams)

    async def close_clients(app: web.Application) -> AsyncIterator[None]:
        yield
        for client in owned:
            await client.close()
        await service.aclose()

    app.cleanup_ctx.append(close_clients)
    server = await serve_app(app, host, port, base_path=fc.base_path, ssl_context=config.tls.server_ssl_context())
    if url.url is None:
        url.url = server.url
    return server
