"""Serving a Placement Controller (kvsp-draft §6.3, §6.4, §6.8) over HTTP: :func:`serve_pc`.

``[pc] store`` chooses where its state lives (``pc/store``): in memory (the default; the
process is the only PC), or Redis, where several PC processes run active/standby over the
same state with the leader lock of ``pc/leader.py`` (``leader_lease_ms``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import cast

from aiohttp import web

from ..client.http import HttpClient, HttpFrontEndClient, HttpIndexClient, HttpInstanceClient
from ..common.clock import Clock, MonotonicClock, Timer
from ..common.config import ControlConfig, PcConfig
from ..http.metrics import metrics_routes
from ..http.server import RunningServer, build_app, serve_app
from .routes import PcRoutes, PcSessionRoutes
from .leader import Leadership
from .service import InstanceClient, PcIndex, PlacementController, SleepPolicy, StartInstance
from .sessions import SessionInstanceClient
from .store import PcStore, open_pc_store

__all__ = ["PC_SERVICE", "serve_pc"]

log = logging.getLogger(__name__)

PC_SERVICE = web.AppKey("kvsp_pc_service", PlacementController)

#: How long a stopping PC with the memory store spends telling reshard members the end.
SHUTDOWN_NOTICE_S = 2.0


async def serve_pc(
    config: ControlConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    clock: Clock | None = None,
    index: PcIndex | None = None,
    instances: InstanceClient | None = None,
    policy: SleepPolicy | None = None,
    start_instance: StartInstance | None = None,
    session_client: SessionInstanceClient | None = None,
    store: PcStore | None = None,
) -> RunningServer:
    """Run a PC per ``config.pc``. With ``failure_check_ms`` set, every that many ms on ``clock`` (when it can wait:
    ``MonotonicClock``, ``ManualClock``) it migrates the sessions of failed instances (§6.8). ``index`` defaults to :class:`HttpIndexClient` for
    ``index_url`` (none: no lookups, every placement recomputes); ``instances`` to
    :class:`HttpInstanceClient` with ``instance_token``; ``start_instance`` is the
    deployment's hook (§6.4). ``store`` defaults to the one ``[pc] store`` names; with a shared
    store the PC answers only once it holds the leader lock (503 ``kvsp-not-leader`` until then,
    see ``pc/leader.py``); the server closes the store when it stops."""
    pcc: PcConfig = config.pc
    spec = pcc.store_spec
    store = store if store is not None else open_pc_store(spec)
    leader = Leadership(store, lease_ms=None if spec.is_memory else pcc.leader_lease_ms)
    owned: list[HttpClient | HttpIndexClient] = []
    if index is None and pcc.index_url is not None:
        index_client = HttpIndexClient(pcc.index_url, pcc.index_token, tls=config.tls)
        owned.append(index_client)
        index = index_client
    if instances is None:
        instance_client = HttpInstanceClient(pcc.instance_token, tls=config.tls)
        owned.append(instance_client)
        instances = instance_client
    clock = clock if clock is not None else MonotonicClock()
    timer = cast(Timer, clock) if hasattr(clock, "sleep_ms") else MonotonicClock()
    http_instances = instances if isinstance(instances, HttpInstanceClient) else None
    front_ends = HttpFrontEndClient(pcc.front_end_token if pcc.front_end_token is not None else pcc.instance_token,
                                    tls=config.tls)
    owned.append(front_ends)
    service = PlacementController(
        clock=clock, index=index, instances=instances, config=pcc, policy=policy, start_instance=start_instance,
        session_client=session_client if session_client is not None else http_instances,
        reshard_client=http_instances, timer=timer, front_ends=front_ends, leader=leader,
    )
    await leader.start()  # the first try: a PC that finds the lock free is active at once
    app = build_app(auth=config.auth, routes=[*PcRoutes(service).routes(), *PcSessionRoutes(service).routes(),
                                              *metrics_routes(pcc.base_path, service.metrics, public=pcc.metrics_public)])
    app[PC_SERVICE] = service

    async def close_clients(app: web.Application) -> AsyncIterator[None]:
        monitor = asyncio.create_task(_watch_failures(service, timer, pcc.failure_check_ms)) if pcc.failure_check_ms else None
        lock = asyncio.create_task(leader.run())
        yield
        for task in (monitor, lock):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await service.close()  # gives the leader lock up: a standby takes over at once
        for client in owned:
            await client.close()
        await store.close()

    async def stop_reshards(app: web.Application) -> None:
        # A reshard's PUT waits up to its deadline_ms (the client's choice): the server's graceful
        # shutdown would wait for it (aiohttp: up to 60 s) before closing. Its PUT answers 503 now.
        # With a shared store the reshard stays stored: the PC that takes over finishes it; with
        # the memory store nobody will, so its members are told its end (abort if undecided).
        if spec.is_memory:
            await service.reshard.abandon(SHUTDOWN_NOTICE_S)
        else:
            service.reshard.stop()

    app.on_shutdown.append(stop_reshards)  # runs before the server waits for its requests
    app.cleanup_ctx.append(close_clients)
    return await serve_app(app, host, port, base_path=pcc.base_path, ssl_context=config.tls.server_ssl_context())


async def _watch_failures(service: PlacementController, timer: Timer, interval_ms: int) -> None:
    """§6.3/§6.8: look for expired instances and migrate their sessions, forever."""
    while True:
        await timer.sleep_ms(interval_ms)
        if not service.leader.leading:
            continue  # a standby: the active PC does this
        try:
            await service.sessions.check_failures()
        except Exception:  # must not stop the loop
            log.exception("checking for failed instances failed")
