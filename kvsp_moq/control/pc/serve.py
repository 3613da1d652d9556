"""Serving a Placement Controller (kvsp-draft §6.3, §6.4, §6.8) over HTTP: :func:`serve_pc`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import cast

from aiohttp import web

from ..client.http import HttpClient, HttpFrontEndClient, HttpIndexClient, HttpInstanceClient
from ..common.clock import Clock, MonotonicClock, Timer
from ..common.config import ControlConfig, PcConfig
from ..http.server import RunningServer, build_app, serve_app
from .routes import PcRoutes, PcSessionRoutes
from .service import InstanceClient, PcIndex, PlacementController, SleepPolicy, StartInstance
from .sessions import SessionInstanceClient

__all__ = ["PC_SERVICE", "serve_pc"]

log = logging.getLogger(__name__)

PC_SERVICE = web.AppKey("kvsp_pc_service", PlacementController)


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
) -> RunningServer:
    """Run a PC per ``config.pc``. With ``failure_check_ms`` set, every that many ms on ``clock`` (when it can wait:
    ``MonotonicClock``, ``ManualClock``) it migrates the sessions of failed instances (§6.8). ``index`` defaults to :class:`HttpIndexClient` for
    ``index_url`` (none: no lookups, every placement recomputes); ``instances`` to
    :class:`HttpInstanceClient` with ``instance_token``; ``start_instance`` is the
    deployment's hook (§6.4)."""
    pcc: PcConfig = config.pc
    owned: list[HttpClient | HttpIndexClient] = []
    if index is None and pcc.index_url is not None:
        index_client = HttpIndexClient(pcc.index_url, pcc.index_token)
        owned.append(index_client)
        index = index_client
    if instances is None:
        instance_client = HttpInstanceClient(pcc.instance_token)
        owned.append(instance_client)
        instances = instance_client
    clock = clock if clock is not None else MonotonicClock()
    timer = cast(Timer, clock) if hasattr(clock, "sleep_ms") else MonotonicClock()
    http_instances = instances if isinstance(instances, HttpInstanceClient) else None
    front_ends = HttpFrontEndClient(pcc.front_end_token if pcc.front_end_token is not None else pcc.instance_token)
    owned.append(front_ends)
    service = PlacementController(
        clock=clock, index=index, instances=instances, config=pcc, policy=policy, start_instance=start_instance,
        session_client=session_client if session_client is not None else http_instances,
        reshard_client=http_instances, timer=timer, front_ends=front_ends,
    )
    app = build_app(auth=config.auth, routes=[*PcRoutes(service).routes(), *PcSessionRoutes(service).routes()])
    app[PC_SERVICE] = service

    async def close_clients(app: web.Application) -> AsyncIterator[None]:
        monitor = asyncio.create_task(_watch_failures(service, timer, pcc.failure_check_ms)) if pcc.failure_check_ms else None
        yield
        if monitor is not None:
            monitor.cancel()
            await asyncio.gather(monitor, return_exceptions=True)
        await service.close()
        for client in owned:
            await client.close()

    app.cleanup_ctx.append(close_clients)
    return await serve_app(app, host, port, base_path=pcc.base_path)


async def _watch_failures(service: PlacementController, timer: Timer, interval_ms: int) -> None:
    """§6.3/§6.8: look for expired instances and migrate their sessions, forever."""
    while True:
        await timer.sleep_ms(interval_ms)
        try:
            await service.sessions.check_failures()
        except Exception:  # must not stop the loop
            log.exception("checking for failed instances failed")
