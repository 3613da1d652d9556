"""Serving an Index Service (kvsp-draft §6.1, §6.2) over HTTP: :func:`serve_index`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from ..common.clock import Clock
from ..common.config import ControlConfig
from ..common.errors import StoreUnavailable
from ..http.metrics import metrics_routes
from ..http.server import RunningServer, build_app, serve_app
from .routes import IndexRoutes
from .service import IndexService
from .redis_store import RedisIndexStore
from .status_table import DEFAULT_SYNC_MS, InstanceStatusTable, SharedStatusTable
from .store import IndexStore

__all__ = ["INDEX_SERVICE", "serve_index"]

log = logging.getLogger(__name__)

INDEX_SERVICE = web.AppKey("kvsp_index_service", IndexService)


async def _purge_periodically(app: web.Application) -> AsyncIterator[None]:
    """Reclaim expired records in the background (reads never return them anyway)."""
    service = app[INDEX_SERVICE]

    async def loop() -> None:
        while True:
            await asyncio.sleep(service.config.purge_interval_ms / 1000)
            try:
                await service.purge()
            except StoreUnavailable as exc:  # Redis down: reads fail with 503 meanwhile
                log.warning("purge of the index failed: %s", exc)
            except Exception:  # a failing store must not stop the loop
                log.exception("purge of the index failed")

    task = asyncio.create_task(loop())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _sync_statuses(table: SharedStatusTable) -> Callable[[web.Application], AsyncIterator[None]]:
    """Read every process's instance statuses from the store every :data:`DEFAULT_SYNC_MS`."""

    async def ctx(_: web.Application) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                try:
                    await table.sync()
                except Exception as exc:  # the store away: the last view stays, estimates go on
                    log.warning("instance statuses not read from the store: %s", exc)
                await asyncio.sleep(DEFAULT_SYNC_MS / 1000)

        task = asyncio.create_task(loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await table.close()

    return ctx


async def serve_index(
    config: ControlConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    clock: Clock | None = None,
    store: IndexStore | None = None,
) -> RunningServer:
    """Run an Index Service per ``config`` on ``host:port`` (0: any free port, reported in
    the result). ``store`` defaults to the one ``[index] store`` names: the embedded store
    ("memory"), or Redis (``redis_store.RedisIndexStore``, closed with the server); ``clock``
    drives every TTL of the embedded store (Redis keeps its own time) and of the instance
    statuses, which stay in this process's memory (they only feed §6.4 estimates and are
    re-reported every few seconds), unless the store is Redis: then every IS process over it
    shares them (``status_table.SharedStatusTable``, read back every second)."""
    spec = config.index.store_spec
    owned: IndexStore | None = None
    if store is None and not spec.is_memory:
        store = owned = RedisIndexStore.open(spec)
        log.info("index records in %s", spec.redacted)
    shared: SharedStatusTable | None = None
    if store is None:
        service = IndexService.in_memory(config.index, clock=clock)
    else:
        statuses: InstanceStatusTable
        if isinstance(store, RedisIndexStore):
            statuses = shared = SharedStatusTable(store.redis, store.spec, clock,
                                                  max_ttl_ms=config.index.max_status_ttl_ms)
        else:
            statuses = InstanceStatusTable(clock, max_ttl_ms=config.index.max_status_ttl_ms)
        service = IndexService(store, config=config.index, statuses=statuses)
    app = build_app(auth=config.auth, routes=[*IndexRoutes(service).routes(), *metrics_routes(
        config.index.base_path, service.metrics, public=config.index.metrics_public)])
    app[INDEX_SERVICE] = service
    if owned is not None:
        closing = owned

        async def close_store(_: web.Application) -> None:
            await closing.close()

        app.on_cleanup.append(close_store)
    if service.config.purge_interval_ms > 0:
        app.cleanup_ctx.append(_purge_periodically)
    if shared is not None:
        app.cleanup_ctx.append(_sync_statuses(shared))
    return await serve_app(app, host, port, base_path=config.index.base_path,
                           ssl_context=config.tls.server_ssl_context())
