"""HTTP routes of the Placement Controller (kvsp-draft §6.3, §6.4, §6.8, §6.9;
docs/http-api.md "Placement Controller", "Sessions" and "Resharding").

A standby PC (``pc/leader.py``) answers every route with 503 ``kvsp-not-leader``: its state
is the active PC's, in the store, and its clients move on to their next PC URL. A store that
cannot be reached answers 503 ``kvsp-unavailable`` within the store's timeout.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from ...kvsp.errors import RecordError
from ...kvsp.records import InstanceStatusRecord, SessionCheckpoint, ShardMap
from ..common.errors import StaleEpoch
from ..common.records import InstanceStateRequest, PlacementRequest
from ..common.session_records import (
    FailureReport,
    SessionDone,
    SessionFailed,
    SessionOpen,
    SessionSummary,
    SessionSummaryList,
)
from ..http.server import (
    MAP_SEGMENT,
    UUID_SEGMENT,
    ServiceRoutes,
    authenticate,
    path_session,
    read_record,
    record_response,
)
from .service import PlacementController

__all__ = ["PcRoutes", "PcSessionRoutes"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def leading(service: PlacementController, handler: Handler) -> Handler:
    """``handler``, answered only by the active PC (module notes)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        service.leader.require()
        return await handler(request)

    return handle


def led(service: PlacementController, routes: list[web.RouteDef]) -> list[web.RouteDef]:
    return [web.RouteDef(r.method, r.path, leading(service, r.handler), dict(r.kwargs)) for r in routes]


class PcRoutes(ServiceRoutes[PlacementController]):
    """Routes of the PC under ``service.config.base_path`` (docs/http-api.md "Placement Controller")."""

    def routes(self) -> list[web.RouteDef]:
        base = self.base
        return led(self.service, [
            web.put(f"{base}instance-status", self.put_instance_status),
            web.put(f"{base}instance-state", self.put_instance_state),
            web.get(f"{base}instances", self.get_instances, allow_head=False),
            web.post(f"{base}placements", self.post_placement),
        ])

    async def put_instance_status(self, request: web.Request) -> web.Response:
        """§6.3 status PUT: 200 ``{"state": ...}``; 409 ``kvsp-stale-epoch`` for a lower epoch."""
        principal = authenticate(request)
        record = await read_record(request, InstanceStatusRecord, self.max_body)
        return record_response(await self.service.report_status(principal, record))

    async def put_instance_state(self, request: web.Request) -> web.Response:
        """Ours: have the PC change an instance's state (it calls ``PUT state`` there, §6.3)."""
        principal = authenticate(request)
        body = await read_record(request, InstanceStateRequest, self.max_body)
        return record_response(await self.service.set_state(principal, body.instance, body.state))

    async def get_instances(self, request: web.Request) -> web.Response:
        """Ours: the instances the principal may report for, with their effective state."""
        return record_response(self.service.views(authenticate(request)))

    async def post_placement(self, request: web.Request) -> web.Response:
        """Ours: place a request by the §6.4 cost (and prefetch for it, §6.5)."""
        principal = authenticate(request)
        body = await read_record(request, PlacementRequest, self.max_body)
        return record_response(await self.service.place(principal, body))


class PcSessionRoutes(ServiceRoutes[PlacementController]):
    """The PC's §6.8 and §6.9 routes (docs/http-api.md "Sessions" and "Resharding")."""

    def routes(self) -> list[web.RouteDef]:
        base = self.base
        session = f"{base}sessions/{{session:{UUID_SEGMENT}}}"
        return led(self.service, [
            web.post(f"{base}sessions", self.post_session),
            web.get(f"{base}sessions", self.get_sessions, allow_head=False),
            web.get(session, self.get_session, allow_head=False),
            web.put(f"{session}/checkpoint", self.put_checkpoint),
            web.post(f"{session}/done", self.post_done),
            web.post(f"{session}/failed", self.post_failed),
            web.post(f"{base}failures", self.post_failure),
            web.put(f"{base}shard-maps/{{map:{MAP_SEGMENT}}}", self.put_shard_map),
            web.get(f"{base}shard-maps/{{map:{MAP_SEGMENT}}}", self.get_shard_map, allow_head=False),
        ])

    async def post_session(self, request: web.Request) -> web.Response:
        """Ours: place (§6.4) and start a session; 201 with its view."""
        principal = authenticate(request)
        body = await read_record(request, SessionOpen, self.max_body)
        view = await self.service.sessions.open(principal, body)
        return record_response(view, status=201, headers={"Location": f"{self.base}sessions/{body.session}"})

    async def get_sessions(self, request: web.Request) -> web.Response:
        """Ours (read-only, the dashboard's listing): the sessions tracked in the principal's
        scopes, the newest ``limit`` (default 256, at most 4096) first."""
        principal = authenticate(request)
        raw = request.query.get("limit", "256")
        if not (raw.isascii() and raw.isdigit() and 0 < len(raw) <= 4 and 0 < int(raw) <= 4096):
            raise RecordError("limit", f"must be an integer in 1..4096, got {raw[:40]!r}")
        seen = [e for e in self.service.sessions.entries() if principal.may_use_scope(e.open.scope_id)]
        out = tuple(SessionSummary(
            session=e.open.session, instance=e.instance, epoch=e.epoch, output_offset=e.checkpoint.output_offset,
            failed=e.failed, compat_id=e.open.compat_id, scope_id=e.open.scope_id, prompt_blocks=e.open.prompt_blocks,
            tokens=e.open.tokens, max_tokens=e.open.max_tokens) for e in reversed(seen[-int(raw):]))
        return record_response(SessionSummaryList(sessions=out, total=len(seen)))

    async def get_session(self, request: web.Request) -> web.Response:
        return record_response(self.service.sessions.view(authenticate(request), path_session(request)))

    async def put_checkpoint(self, request: web.Request) -> web.Response:
        """§6.8: 200 with the acknowledgement; 409 ``kvsp-stale-epoch`` for a lower epoch."""
        principal = authenticate(request)
        cp = await read_record(request, SessionCheckpoint, self.max_body)
        try:
            ack = await self.service.sessions.checkpoint(principal, path_session(request), cp)
        except StaleEpoch:
            self.service.metrics.checkpoints.labels("stale_epoch").inc()
            raise
        self.service.metrics.checkpoints.labels("acknowledged").inc()
        return record_response(ack)

    async def post_done(self, request: web.Request) -> web.Response:
        principal = authenticate(request)
        body = await read_record(request, SessionDone, self.max_body)
        await self.service.sessions.done(principal, path_session(request), body)
        return web.Response(status=204)

    async def post_failed(self, request: web.Request) -> web.Response:
        """Ours: the serving instance cannot serve the session; the PC re-places it or marks it
        failed. 200 with the session's view; 409 ``kvsp-stale-epoch`` for an older epoch."""
        principal = authenticate(request)
        body = await read_record(request, SessionFailed, self.max_body)
        return record_response(await self.service.sessions.failed(principal, path_session(request), body))

    async def post_failure(self, request: web.Request) -> web.Response:
        """Ours: an instance failed; its sessions are resumed elsewhere (§6.8). 200 with them."""
        principal = authenticate(request)
        body = await read_record(request, FailureReport, self.max_body)
        return record_response(await self.service.sessions.report_failure(principal, body))

    async def put_shard_map(self, request: web.Request) -> web.Response:
        """Ours (§6.9): install a map, or reshard to its next version; 200 with the outcome."""
        principal = authenticate(request)
        body = await read_record(request, ShardMap, self.max_body)
        if body.map != request.match_info["map"]:
            raise RecordError("map", "must be the map of the path")
        deadline = request.query.get("deadline_ms")
        deadline_ms = None
        if deadline is not None:
            if not (deadline.isascii() and deadline.isdigit() and 0 < len(deadline) <= 9 and int(deadline) > 0):
                raise RecordError("deadline_ms", f"must be a positive integer, got {deadline[:40]!r}")
            deadline_ms = int(deadline)
        return record_response(await self.service.reshard.put(principal, body, deadline_ms))

    async def get_shard_map(self, request: web.Request) -> web.Response:
        return record_response(self.service.reshard.get(authenticate(request), request.match_info["map"]))
