"""HTTP routes of an inference instance (kvsp-draft §6.3, §6.5, §6.8, §6.9; docs/http-api.md
"Inference Instance", "Sessions" and "Resharding")."""

from __future__ import annotations

import hashlib
import uuid

from aiohttp import web

from ...kvsp.container import encode_container
from ...kvsp.errors import RecordError
from ...kvsp.records import PrefetchDirective, StateChange, parse_reshard_message
from ..common.auth import require_instance
from ..common.media import BLOCK_MEDIA_TYPE, KVSP_JSON, repr_digest
from ..common.records import SessionRequest
from ..common.session_records import SessionOrder
from ..common.shard_store import TokenRange
from ..http.server import (
    MAP_SEGMENT,
    UUID_SEGMENT,
    ServiceRoutes,
    authenticate,
    path_session,
    read_block_body,
    read_body,
    read_record,
    record_response,
)
from .service import InstanceService

__all__ = ["InstanceRoutes", "InstanceSessionRoutes", "parse_token_range"]


def parse_token_range(value: str | None, name: str = "tokens") -> TokenRange:
    """``tokens=a-b``: the half-open token range [a, b) of §6.9, a < b; ``RecordError`` (400)."""
    first, sep, last = (value or "").partition("-")
    if not (sep and first.isascii() and last.isascii() and first.isdigit() and last.isdigit()
            and len(first) <= 16 and len(last) <= 16):
        raise RecordError(name, f"must be a-b, the half-open token range [a, b), got {(value or '')[:40]!r}")
    a, b = int(first), int(last)
    if a >= b:
        raise RecordError(name, f"must have a < b, got {value!r}")
    return a, b


class InstanceRoutes(ServiceRoutes[InstanceService]):
    """Routes of an instance under ``service.config.base_path`` (docs/http-api.md "Inference Instance")."""

    def routes(self) -> list[web.RouteDef]:
        base = self.base
        return [
            web.post(f"{base}prefetch", self.post_prefetch),
            web.get(f"{base}prefetch/{{directive:{UUID_SEGMENT}}}", self.get_prefetch, allow_head=False),
            web.put(f"{base}state", self.put_state),
            web.post(f"{base}sessions", self.post_session),
            web.delete(f"{base}sessions/{{session:{UUID_SEGMENT}}}", self.delete_session),
        ]

    def directive_location(self, directive: uuid.UUID) -> str:
        return f"{self.base}prefetch/{directive}"

    async def post_prefetch(self, request: web.Request) -> web.Response:
        """§6.5: 202 (Accepted) with ``Location`` naming the directive's status resource."""
        principal = authenticate(request)
        directive = await read_record(request, PrefetchDirective, self.max_body)
        directive_id = self.service.accept_directive(principal, directive)
        status = await self.service.directive_status(principal, directive_id)
        return record_response(status, status=202, headers={"Location": self.directive_location(directive_id)})

    async def get_prefetch(self, request: web.Request) -> web.Response:
        """§6.5: the directive's state (pending, partial, complete, failed) and loaded keys;
        ``?wait_ms=N`` (at most 60000) answers once the directive has ended or after N ms."""
        principal = authenticate(request)
        directive = uuid.UUID(request.match_info["directive"])
        wait = request.query.get("wait_ms", "0")
        # ASCII digits only, and few of them: str.isdigit() takes "²" and "١", and int()
        # refuses more than 4300 digits (both were 500s)
        if not (wait.isascii() and wait.isdigit() and len(wait) <= 5) or int(wait) > 60_000:
            raise RecordError("wait_ms", "query parameter must be an integer from 0 to 60000")
        return record_response(await self.service.directive_status(principal, directive, wait_s=int(wait) / 1000))

    async def put_state(self, request: web.Request) -> web.Response:
        """§6.3 ``PUT state`` from the PC: 200 ``{"state": entered}``."""
        principal = authenticate(request)
        body = await read_record(request, StateChange, self.max_body)
        return record_response(await self.service.set_state(principal, body.state))

    async def post_session(self, request: web.Request) -> web.Response:
        """Ours: admit a session (409 ``kvsp-not-active`` when draining or sleeping, §6.3)."""
        principal = authenticate(request)
        body = await read_record(request, SessionRequest, self.max_body)
        admitted = self.service.admit(principal, body)
        return record_response(admitted, status=201, headers={"Location": f"{self.base}sessions/{body.session}"})

    async def delete_session(self, request: web.Request) -> web.Response:
        """Ours: the session completed; 204."""
        principal = authenticate(request)
        self.service.finish(principal, uuid.UUID(request.match_info["session"]))
        return web.Response(status=204)


class InstanceSessionRoutes(ServiceRoutes[InstanceService]):
    """An instance's §6.8 and §6.9 routes (docs/http-api.md "Sessions" and "Resharding")."""

    def routes(self) -> list[web.RouteDef]:
        base = self.base
        session = f"{base}sessions/{{session:{UUID_SEGMENT}}}"
        shard = f"{base}shards/{{map:{MAP_SEGMENT}}}/{{version:[0-9]{{1,16}}}}"
        return [
            web.post(f"{session}/start", self.post_start),
            web.post(f"{session}/resume", self.post_resume),
            web.post(f"{base}reshard", self.post_reshard),
            web.get(shard, self.get_shard_tokens),
            web.put(shard, self.put_shard_tokens),
        ]

    async def _order(self, request: web.Request, *, resume: bool) -> web.Response:
        principal = authenticate(request)
        order = await read_record(request, SessionOrder, self.max_body)
        accepted = self.service.run_session(principal, path_session(request), order, resume=resume)
        return record_response(accepted, status=202)

    async def post_start(self, request: web.Request) -> web.Response:
        """Ours: start a session (a resume from its initial checkpoint); 202."""
        return await self._order(request, resume=False)

    async def post_resume(self, request: web.Request) -> web.Response:
        """§6.8: resume from the checkpoint at the new epoch; 202 once it runs."""
        return await self._order(request, resume=True)

    async def post_reshard(self, request: web.Request) -> web.Response:
        """§6.9: a plan answers 200 after its fetches; commit and abort answer 200 at once."""
        principal = authenticate(request)
        message = parse_reshard_message(await read_body(request, self.max_body), max_size=self.max_body)
        ack = await self.service.reshard(principal, message)
        return record_response(ack if ack is not None else message)

    async def get_shard_tokens(self, request: web.Request) -> web.Response:
        """Ours (§6.9 fetch): the KV of tokens [a, b) as a KVB1 container (§4.3) with Token
        Count b - a, layers from 0, and Repr-Digest."""
        principal = authenticate(request)
        tokens = parse_token_range(request.query.get("tokens"))
        data = await self.service.shard_tokens(principal, request.match_info["map"], int(request.match_info["version"]), tokens)
        body = encode_container(1, 0, data.token_count, data.layers)
        return web.Response(body=body, content_type=BLOCK_MEDIA_TYPE,
                            headers={"Repr-Digest": repr_digest(hashlib.sha256(body).digest()), "Cache-Control": "no-store"})

    async def put_shard_tokens(self, request: web.Request) -> web.Response:
        """Ours (§6.9): install the KV of tokens [a, b) a producer computed (a KVB1 container,
        ``application/kvsp-block``, the inverse of the GET); 201 ``{"map", "version", "tokens", "held"}``. Auth: ``instances``
        including this instance (docs/migration.md)."""
        principal = authenticate(request)
        require_instance(principal, self.service.url)
        tokens = parse_token_range(request.query.get("tokens"))
        map_id, version = request.match_info["map"], int(request.match_info["version"])
        self.service.shards.install_container(map_id, version, tokens, await read_block_body(request, self.max_body))
        held = [list(r) for r in self.service.shards.store.held(map_id)]
        return web.json_response({"map": map_id, "version": version, "tokens": list(tokens), "held": held},
                                 status=201, content_type=KVSP_JSON)
