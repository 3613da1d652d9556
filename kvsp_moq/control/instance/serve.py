"""Serving an inference instance's control plane (kvsp-draft §6.3, §6.5, §6.8, §6.9) over HTTP.

:func:`serve_instance` runs the instance (its prefetch executor, status reporter, sessions and
shards, and the inference engine when ``[instance.engine]`` is configured) with the HTTP
clients of its peers. :func:`serve_model_instance` (``kvsp instance``) is :func:`serve_instance`
plus, when ``[instance.engine]`` is configured and ``[instance] session_engine = "model"`` (the
default), a :class:`~.instance.model_sessions.ModelSessionEngine` bound to the instance's inference
engine once the model is loaded. Orders that arrive before that (the instance reports to the PC
while it starts) wait for the binding.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any, cast

from aiohttp import web

from ...kvsp.records import ReplicaRecord
from ...storage import BlockStore, RecordKey
from ..client.http import (
    HttpBlockFetcher,
    HttpBlockStorer,
    HttpClient,
    HttpFrontEndClient,
    HttpIndexClient,
    HttpPcClient,
    HttpShardFetcher,
)
from ..client.http_leases import HttpLeaseClient
from ..client.journal import RecordJournal
from ..client.publisher import ReplicaPublisher, start_withdrawing_previous
from ..client.moqt import retrieve_block
from ..client.retrieval import BlockFetcher, MoqtRetriever
from ..common.clock import MonotonicClock, Timer
from ..common.config import ControlConfig, InstanceConfig, pc_targets
from ..common.shard_store import ShardStore
from ..common.tiers import build_store
from ..engine.counters import CountingFetcher, CountingRetriever, EngineCounters
from ..engine.routes import EngineRoutes
from ..engine.setup import engine_transport, start_engine
from ..http.metrics import metrics_routes
from ..http.server import BoundUrl, RunningServer, build_app, serve_app
from .model_sessions import ModelSessionEngine
from .prefetch import PrefetchExecutor
from .reporter import PcClient, persisted_epoch, wall_clock_epoch
from .routes import InstanceRoutes, InstanceSessionRoutes
from .service import InstanceService
from .sessions import SessionEngine

__all__ = ["INSTANCE_SERVICE", "serve_instance", "serve_model_instance"]

INSTANCE_SERVICE = web.AppKey("kvsp_instance_service", InstanceService)


async def serve_instance(
    config: ControlConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    clock: Timer | None = None,
    store: BlockStore | None = None,
    epoch: int | None = None,
    pc: PcClient | None = None,
    report: bool = True,
    moqt_retriever: MoqtRetriever | None = None,
    session_engine: SessionEngine | None = None,
    shard_store: ShardStore | None = None,
) -> RunningServer:
    """Run an inference instance's control plane per ``config.instance``.

    ``clock`` (a :class:`~.common.clock.Timer`: ``MonotonicClock`` or ``ManualClock``) drives the
    status reports, deadlines and TTLs. ``epoch`` defaults to the configured ``epoch_file``
    counter, else the start time in ms (§6.3). ``pc`` defaults to :class:`HttpPcClient` for
    ``pc_url``. With ``report`` the reports run in the background (first one at start, then
    every ``report_ms``; the first report is awaited before this returns); tests pass ``report=False`` and call ``service.reporter.report_now()``.
    The instance URL is ``url``, else the bound address. ``session_engine`` runs the sessions
    the PC starts and resumes (§6.8, ``instance.sessions.SessionEngine``; none: they are
    refused with 409); ``shard_store`` holds its sequence shards (§6.9; default in memory).
    """
    ic: InstanceConfig = config.instance
    tls = config.tls  # [tls]: every client below verifies servers per it (docs/security.md)
    timer: Timer = clock if clock is not None else MonotonicClock()
    store = store if store is not None else build_store(ic.tiers, timer)
    if epoch is None:
        epoch = persisted_epoch(ic.epoch_file) if ic.epoch_file else wall_clock_epoch()
    owned: list[HttpClient | HttpIndexClient] = []
    index_client: HttpIndexClient | None = None
    if ic.index_url is not None:
        index_client = HttpIndexClient(ic.index_url, ic.token, tls=tls)
        owned.append(index_client)
    pcs = pc_targets(ic.pc_url, ic.pc_urls)  # several: active/standby PCs, tried in turn
    if pc is None and pcs:
        pc_client = HttpPcClient(pcs, ic.token, failover_ms=ic.pc_failover_ms, tls=tls)
        owned.append(pc_client)
        pc = pc_client
    leases = HttpLeaseClient(ic.token, tls=tls)
    fetcher = HttpBlockFetcher(ic.token, read_timeout_s=ic.block_read_timeout_ms / 1000, tls=tls)
    owned.append(leases)
    url = BoundUrl(ic.url)
    journal = RecordJournal(ic.records_journal) if ic.records_journal else None
    publisher = ReplicaPublisher(store, index_client, holder_url=url, clock=timer, ttl_ms=ic.record_ttl_ms,
                                 refresh_ms=max(1, ic.record_ttl_ms // 3), journal=journal)
    replicas = index_client if index_client is not None else _NoIndex()
    # [instance.engine]: what directives load is counted with what requests load (engine/counters.py).
    counters = EngineCounters() if ic.engine is not None else None
    if moqt_retriever is None and counters is None:  # MOQT prefetch loads verify per [tls]
        moqt_retriever = functools.partial(retrieve_block, config=tls.transport(purpose="MOQT prefetch loads"))
    counted_fetcher = CountingFetcher(counters, cast(BlockFetcher, fetcher), 0) if counters is not None else None
    counted_retriever = (CountingRetriever(counters, moqt_retriever, transport=engine_transport(ic.engine, tls),
                                           receive_limits=ic.engine.moqt_limits, timeout=ic.engine.moqt_timeout_s,
                                           idle_timeout=ic.engine.moqt_idle_timeout_s)
                         if counters is not None and ic.engine is not None else None)
    executor = PrefetchExecutor(
        store=store, publisher=publisher, replicas=replicas, leases=leases,
        fetcher=counted_fetcher if counted_fetcher is not None else cast(BlockFetcher, fetcher), timer=timer,
        max_directives=ic.max_directives, max_running=ic.max_running_directives, blocks_in_flight=ic.prefetch_blocks_in_flight,
        moqt_retriever=counted_retriever if counted_retriever is not None else moqt_retriever,
        codec_policy=ic.codec_policy,
    )
    session_pc = pc if isinstance(pc, HttpPcClient) else None
    if session_pc is None and pcs:
        session_pc = HttpPcClient(pcs, ic.token, failover_ms=ic.pc_failover_ms, tls=tls)
        owned.append(session_pc)
    front_ends = HttpFrontEndClient(ic.token, tls=tls)
    shard_fetcher = HttpShardFetcher(ic.token, tls=tls)
    owned += [front_ends, shard_fetcher]
    service = InstanceService(url=ic.url or "http://unbound/", epoch=epoch, store=store, prefetch=executor,
                              timer=timer, pc=pc, config=ic, session_engine=session_engine, checkpoints=session_pc,
                              front_ends=front_ends, shard_store=shard_store, shard_fetcher=shard_fetcher)
    if ic.engine is not None:
        assert counters is not None and counted_fetcher is not None
        storer = HttpBlockStorer(ic.token, tls=tls)
        owned.append(storer)
        try:
            service.inference = await start_engine(
                ic.engine, store=store, lifecycle=service.lifecycle, url=lambda: service.url, index=index_client,
                index_publisher=index_client, fetcher=cast(BlockFetcher, fetcher), storer=storer,
                replica_publisher=publisher, directives=executor, token=ic.token, counters=counters,
                owned=(counted_retriever,) if counted_retriever is not None else (), tls=tls, clock=timer,
                codec_policy=ic.codec_policy)
        except BaseException:
            await fetcher.close()
            for client in owned:
                await client.close()
            raise
        counted_fetcher.layers = service.inference.bundle.layers
        if counted_retriever is not None and service.inference.pool is not None:
            counted_retriever.share_pool(service.inference.pool)  # one session per relay for all loads
    routes = [*InstanceRoutes(service).routes(), *InstanceSessionRoutes(service).routes()]
    if service.inference is not None:
        routes += EngineRoutes(service.config, service.inference).routes()
    service.metrics.engine = counters  # [instance.engine]: its counters in GET {ii}metrics
    routes += metrics_routes(ic.base_path, service.metrics, public=ic.metrics_public)
    app = build_app(auth=config.auth, routes=routes)
    app[INSTANCE_SERVICE] = service

    tasks: list[asyncio.Task[None]] = []

    async def shutdown(app: web.Application) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await service.close()
        publisher.close()
        await fetcher.close()
        for client in owned:
            await client.close()

    app.on_cleanup.append(shutdown)
    server = await serve_app(app, host, port, base_path=ic.base_path, ssl_context=tls.server_ssl_context())
    if url.url is None:
        url.url = server.url
    service.url = url()
    # Background tasks start once the URL is known (the first report names the instance).
    tasks.append(asyncio.create_task(publisher.run()))
    # §6.1: what the last run published and this (empty or recovered) store lost is withdrawn.
    tasks.append(await start_withdrawing_previous(publisher))
    if report:
        await service.reporter.report_logged()  # known to the PC before it announces itself
        tasks.append(asyncio.create_task(service.reporter.run()))
    return server


class _NoIndex:
    """Without an IS the instance cannot verify anything it would load: no records."""

    async def replicas(self, key: RecordKey) -> list[ReplicaRecord]:
        return []


async def serve_model_instance(config: ControlConfig, host: str = "127.0.0.1", port: int = 0, **kw: Any) -> RunningServer:
    """Run an instance per ``config.instance`` with model-backed sessions (module notes);
    ``kw`` goes to :func:`serve_instance`."""
    ic = config.instance
    sessions: ModelSessionEngine | None = None
    if ic.engine is not None and ic.session_engine == "model" and kw.get("session_engine") is None:
        sessions = ModelSessionEngine(load_timeout_s=ic.session_load_timeout_ms / 1000)
        kw["session_engine"] = sessions
    server = await serve_instance(config, host, port, **kw)
    if sessions is not None:
        service = server.app[INSTANCE_SERVICE]
        assert service.inference is not None
        sessions.bind(service.inference, url=lambda: service.url)
    return server
