"""Serving a holder (kvsp-draft §6.6, §6.7) over HTTP: :func:`serve_holder`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from aiohttp import web

from ...storage import BlockStore
from ..client.http import HttpIndexClient
from ..client.journal import RecordJournal
from ..client.publisher import IndexClient, ReplicaPublisher, start_withdrawing_previous
from ..common.clock import Clock, MonotonicClock
from ..common.config import ControlConfig, HolderConfig
from ..common.errors import StoreUnavailable
from ..common.tiers import build_store
from ..http.metrics import metrics_routes
from ..http.server import BoundUrl, RunningServer, build_app, serve_app
from .lease_redis import RedisLeaseStore
from .lease_store import LeaseLimits, LeaseStore, MemoryLeaseStore
from .leases import LeaseManager
from .moqt import HolderMoqt
from .routes import HolderRoutes
from .service import HolderService
from .transcode import Transcoder, geometries_of

__all__ = ["HOLDER_SERVICE", "serve_holder"]

log = logging.getLogger(__name__)

HOLDER_SERVICE = web.AppKey("kvsp_holder_service", HolderService)


class WallClock:
    """Milliseconds since the Unix epoch: the lease clock of a Redis store, so that a lease's
    expiry means the same to a restarted holder, on whichever host (a step of the system clock
    shortens or lengthens the leases by as much)."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


def open_lease_store(hc: HolderConfig) -> LeaseStore:
    """The lease store ``[holder] store`` names (``common/store.py``)."""
    spec = hc.store_spec
    return MemoryLeaseStore() if spec.is_memory else RedisLeaseStore(spec)


async def _reload(leases: LeaseManager) -> None:
    try:
        count = await leases.reload()
    except StoreUnavailable as exc:
        log.warning("cannot reload the leases yet (retried; blocks are not stored meanwhile): %s", exc)
    else:
        log.info("reloaded %d live lease(s) from the store", count)


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
    With ``[holder] moqt_relays`` the replicas are also published over MOQT through those
    relays, each with a ``moqt://`` record naming the relay (``holder/moqt.py``).

    A store built here adopts the replica files of its disk tiers first (a restart). With
    ``[holder] store = "redis://..."`` the leases live in Redis: they are reloaded and their
    replicas re-pinned before the first request (retried in the background while Redis is
    unreachable; PUTs answer 503 until then, GETs are served). Lease expiry then runs on the
    wall clock, unless ``clock`` is given (tests drive both with one manual clock).
    """
    hc = config.holder
    lease_clock: Clock = clock if clock is not None else (MonotonicClock() if hc.store_spec.is_memory else WallClock())
    clock = clock if clock is not None else MonotonicClock()
    if store is None:
        store = build_store(hc.tiers, clock)
        recovered = store.recover()  # §6.1: republished below by the first refresh
        if recovered:
            log.info("adopted %d replica(s) from the disk tiers", len(recovered))
    owned_client: HttpIndexClient | None = None
    if index_client is None and hc.index_url is not None:
        index_client = owned_client = HttpIndexClient(hc.index_url, hc.index_token, tls=config.tls)
    url = BoundUrl(hc.url)
    publisher = ReplicaPublisher(
        store, index_client, holder_url=url, clock=clock, ttl_ms=hc.record_ttl_ms, refresh_ms=hc.refresh_ms,
        retry_ms=hc.withdraw_retry_ms, retry_max_ms=hc.withdraw_retry_max_ms,
        journal=RecordJournal(hc.records_journal) if hc.records_journal else None,
    )
    limits = LeaseLimits(hc.max_lease_ttl_ms, hc.max_leased_octets, hc.max_leases, hc.max_lease_keys)
    leases = LeaseManager(store, clock, limits, leases=open_lease_store(hc), lease_clock=lease_clock)
    await _reload(leases)
    moqt: HolderMoqt | None = None
    if hc.moqt_relays:  # binding v1 §8, §10: the replicas as MOQT tracks through the relays
        transport = config.tls.transport(ca_file=hc.moqt_ca_file, insecure=hc.moqt_insecure,
                                         purpose="the MOQT relays of [holder]")  # + [transport]
        moqt = HolderMoqt(store, index_client, config=hc, clock=clock, transport=transport)
        await moqt.connect()
    transcoder = Transcoder(geometries_of(hc.descriptors), hc.transcode_cache_octets) if hc.descriptors else None
    service = HolderService(store, clock=clock, leases=leases, publisher=publisher, chunk_octets=hc.chunk_octets,
                            moqt=moqt, transcoder=transcoder)
    app = build_app(auth=config.auth, routes=[*HolderRoutes(service, hc).routes(),
                                              *metrics_routes(hc.base_path, service.metrics, public=hc.metrics_public)])
    app[HOLDER_SERVICE] = service

    previous: list[asyncio.Task[None]] = []  # start_withdrawing_previous, once the URL is known

    async def background(app: web.Application) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                await asyncio.sleep(max(hc.refresh_ms / 4, 10) / 1000)
                if not leases.loaded:
                    await _reload(leases)
                try:
                    await leases.purge()
                except StoreUnavailable as exc:  # expired pins lapse on their own meanwhile
                    log.warning("purging expired leases failed: %s", exc)
                if url.url is None:
                    continue
                try:
                    await publisher.refresh()
                    if moqt is not None:
                        await moqt.refresh()
                except Exception:  # must not stop the loop
                    log.exception("refreshing the holder's replica records failed")

        task = asyncio.create_task(loop())
        yield
        for t in (task, *previous):
            t.cancel()
        await asyncio.gather(task, *previous, return_exceptions=True)
        try:  # withdrawals in flight: give them a moment, not the records' whole TTL
            await asyncio.wait_for(publisher.flush(), 5)
        except asyncio.TimeoutError:
            log.warning("closing with replica withdrawals still pending; the records expire at the index")
        publisher.close()
        if moqt is not None:
            await moqt.close()
        await leases.close()
        if owned_client is not None:
            await owned_client.close()

    app.cleanup_ctx.append(background)
    server = await serve_app(app, host, port, base_path=hc.base_path, ssl_context=config.tls.server_ssl_context())
    if url.url is None:
        url.url = server.url
    await publisher.refresh()  # replicas already in the store (recovered from disk)
    if moqt is not None:
        await moqt.refresh()
    # §6.1: what the last run published and this store lost (a memory tier's) is withdrawn.
    previous.append(await start_withdrawing_previous(publisher))
    return server
