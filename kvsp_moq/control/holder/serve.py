"""Serving a holder (kvsp-draft §6.6, §6.7) over HTTP: :func:`serve_holder`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from ...storage import BlockStore
from ..client.http import HttpIndexClient
from ..client.publisher import IndexClient, ReplicaPublisher
from ..common.clock import Clock, MonotonicClock
from ..common.config import ControlConfig
from ..common.tiers import build_store
from ..http.server import BoundUrl, RunningServer, build_app, serve_app
from .leases import LeaseLimits, LeaseManager
from .routes import HolderRoutes
from .service import HolderService

__all__ = ["HOLDER_SERVICE", "serve_holder"]

log = logging.getLogger(__name__)

HOLDER_SERVICE = web.AppKey("kvsp_holder_service", HolderService)


async def serve_holder(
    config: ControlConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    clock: Clock | None = None,
    store: BlockStore | None = None,
    index_client: IndexClient | None = None,
) -> RunningServer:
    """Run a holder per ``config.holder`` on ``host:port``.

    ``store`` defaults to one built from the configured tiers on ``clock``; a store passed in
    must read the same clock (seconds = ``clock.now_ms() / 1000``), since leases and their
    pins must expire together. ``index_client`` defaults to :class:`HttpIndexClient` for
    ``index_url`` (none: no publication). The holder URL is ``url``, else the bound address.
    Records are refreshed in the background every ``refresh_ms / 4``; ``close()`` stops it.
    """
    hc = config.holder
    clock = clock if clock is not None else MonotonicClock()
    store = store if store is not None else build_store(hc.tiers, clock)
    owned_client: HttpIndexClient | None = None
    if index_client is None and hc.index_url is not None:
        index_client = owned_client = HttpIndexClient(hc.index_url, hc.index_token)
    url = BoundUrl(hc.url)
    publisher = ReplicaPublisher(
        store, index_client, holder_url=url, clock=clock, ttl_ms=hc.record_ttl_ms, refresh_ms=hc.refresh_ms,
        retry_ms=hc.withdraw_retry_ms, retry_max_ms=hc.withdraw_retry_max_ms,
    )
    limits = LeaseLimits(hc.max_lease_ttl_ms, hc.max_leased_octets, hc.max_leases, hc.max_lease_keys)
    service = HolderService(
        store, clock=clock, leases=LeaseManager(store, clock, limits), publisher=publisher, chunk_octets=hc.chunk_octets
    )
    app = build_app(auth=config.auth, routes=HolderRoutes(service, hc).routes())
    app[HOLDER_SERVICE] = service

    async def background(app: web.Application) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                await asyncio.sleep(max(hc.refresh_ms / 4, 10) / 1000)
                if url.url is None:
                    continue
                try:
                    service.leases.purge()
                    await publisher.refresh()
                except Exception:  # must not stop the loop
                    log.exception("refreshing the holder's replica records failed")

        task = asyncio.create_task(loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        try:  # withdrawals in flight: give them a moment, not the records' whole TTL
            await asyncio.wait_for(publisher.flush(), 5)
        except asyncio.TimeoutError:
            log.warning("closing with replica withdrawals still pending; the records expire at the index")
        publisher.close()
        if owned_client is not None:
            await owned_client.close()

    app.cleanup_ctx.append(background)
    server = await serve_app(app, host, port, base_path=hc.base_path)
    if url.url is None:
        url.url = server.url
    await publisher.refresh()  # replicas already in the store (recovered from disk)
    return server
