"""HTTP routes of the front end (kvsp-draft §6.8; docs/http-api.md "Front end")."""

from __future__ import annotations

import json

from aiohttp import web

from ...kvsp.errors import RecordError
from ..common.errors import StoreUnavailable
from ..common.session_records import (
    ClientSessionRequest,
    OutputTokens,
    SessionFailed,
    StreamEnd,
    StreamFailed,
)
from ..http.server import (
    UUID_SEGMENT,
    ServiceRoutes,
    authenticate,
    path_session,
    read_record,
    record_response,
)
from .service import FrontEnd

__all__ = ["NDJSON", "FrontEndRoutes"]

#: Media type of a front end's token stream (one JSON object per line).
NDJSON = "application/x-ndjson"


class FrontEndRoutes(ServiceRoutes[FrontEnd]):
    """The front end's routes under ``service.config.base_path`` (docs/http-api.md "Front end")."""

    def routes(self) -> list[web.RouteDef]:
        base = self.base
        session = f"{base}sessions/{{session:{UUID_SEGMENT}}}"
        return [
            web.post(f"{base}sessions", self.post_session),
            web.post(f"{session}/tokens", self.post_tokens),
            web.get(f"{session}/tokens", self.get_tokens, allow_head=False),
            web.post(f"{session}/failed", self.post_failed),
        ]

    async def post_session(self, request: web.Request) -> web.Response:
        """A client starts a session: 201 with its id and token stream."""
        principal = authenticate(request)
        body = await read_record(request, ClientSessionRequest, self.max_body)
        started = await self.service.open(principal, body)
        return record_response(started, status=201, headers={"Location": f"{self.base}sessions/{started.session}"})

    async def post_tokens(self, request: web.Request) -> web.Response:
        """An instance delivers output tokens (§6.8); 409 ``kvsp-stale-epoch`` for a lower epoch."""
        principal = authenticate(request)
        batch = await read_record(request, OutputTokens, self.max_body)
        return record_response(await self.service.deliver(principal, path_session(request), batch))

    async def post_failed(self, request: web.Request) -> web.Response:
        """Ours (§6.8): the PC gave the session up; its client streams end with the reason.
        204; 409 ``kvsp-stale-epoch`` for an epoch lower than one seen here."""
        principal = authenticate(request)
        notice = await read_record(request, SessionFailed, self.max_body)
        await self.service.fail(principal, path_session(request), notice)
        return web.Response(status=204)

    async def get_tokens(self, request: web.Request) -> web.StreamResponse:
        """The client's stream: NDJSON lines ``{"index", "token"}`` in index order, each index
        once, then ``{"end": n}``, or ``{"failed": reason, "next": n}`` when the PC gave the
        session up; ``?from=i`` starts at index i. A store lost mid-stream ends the stream
        without its end line (503 ``kvsp-unavailable`` when lost before it starts)."""
        principal = authenticate(request)
        start = request.query.get("from", "0")
        if not (start.isascii() and start.isdigit() and len(start) <= 16):
            raise RecordError("from", f"must be a token index, got {start[:40]!r}")
        items = await self.service.stream(principal, path_session(request), int(start))
        response = web.StreamResponse(status=200, headers={"Cache-Control": "no-store"})
        response.content_type = NDJSON
        await response.prepare(request)
        try:
            async for item in items:
                line: dict[str, object]
                if isinstance(item, StreamEnd):
                    line = {"end": item.end}
                elif isinstance(item, StreamFailed):
                    line = {"failed": item.reason, "next": item.next}
                else:
                    line = item.to_json()
                await response.write(json.dumps(line, separators=(",", ":")).encode() + b"\n")
        except StoreUnavailable:
            pass  # the stream stops without its end line; the client reads again from its next index
        await response.write_eof()
        return response
