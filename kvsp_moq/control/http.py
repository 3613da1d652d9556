"""HTTP binding of the control-plane services (DESIGN.md §5); the only module importing aiohttp.

Structure: one application per process, built by :func:`build_app` from the services it runs
and one :class:`~.auth.Authorizer`. Each role contributes a route table (:class:`IndexRoutes`
today; the holder, instance and PC add theirs beside it) under its own base path. The shared
machinery is role-neutral:

- :func:`authenticate` — the principal of a request (401 problem otherwise);
- :func:`read_record` / :func:`read_json_object` — JSON bodies, ``application/kvsp+json`` or
  ``application/json`` (415 otherwise), at most a per-route number of octets (413), validated
  into a record (400 ``kvsp-bad-record`` naming the member);
- :func:`record_response` / :func:`problem_response` — ``application/kvsp+json`` and RFC 9457
  ``application/problem+json``;
- :func:`problem_middleware` — every refusal (``ServiceError``, ``RecordError``, routing errors,
  unexpected exceptions) leaves as a problem details response.

Endpoints and their shapes: docs/http-api.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import quote

from aiohttp import web

from ..kvsp import problems
from ..kvsp.errors import KvspError, RecordError
from ..kvsp.records import (
    InstanceStatusRecord,
    LookupRequest,
    Problem,
    Record,
    ReplicaRecord,
    decode_json,
    dump_json,
    parse_json,
)
from .auth import Authorizer, Principal
from .clock import Clock
from .config import ControlConfig
from .errors import ServiceError
from .index import IndexService
from .index_store import BlockRef, IndexStore, ReplicaId
from .status_table import InstanceStatusTable

log = logging.getLogger(__name__)

#: Media type of KVSP JSON bodies (§11.1).
KVSP_JSON = "application/kvsp+json"
#: Request media types accepted for JSON bodies.
JSON_MEDIA_TYPES = frozenset({KVSP_JSON, "application/json"})

AUTHORIZER = web.AppKey("kvsp_authorizer", Authorizer)
INDEX_SERVICE = web.AppKey("kvsp_index_service", IndexService)

R = TypeVar("R", bound=Record)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Path segments of §6.7: {compat} hex32, {scope} hex16, {block_key} hex32. A malformed segment
# matches no route, hence 404 kvsp-not-found.
HEX32_SEGMENT = "[0-9a-f]{64}"
HEX16_SEGMENT = "[0-9a-f]{32}"
BLOCK_PATH = f"{{compat:{HEX32_SEGMENT}}}/{{scope:{HEX16_SEGMENT}}}/{{key:{HEX32_SEGMENT}}}"


# ---------------------------------------------------------------------------------------------
# Problems and responses


class HttpProblem(Exception):
    """A refusal that exists only at the HTTP level (413, 415): ``about:blank`` problems."""

    def __init__(self, status: int, detail: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = dict(headers or {})


def problem_response(
    problem: Problem,
    *,
    headers: Mapping[str, str] | None = None,
    extensions: Mapping[str, object] | None = None,
) -> web.Response:
    """An RFC 9457 problem details response; ``extensions`` are extra members (``member``)."""
    body = problem.to_json()
    if extensions:
        body.update(extensions)
    status = problem.status or 500
    return web.Response(
        status=status,
        body=json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8"),
        content_type=problems.PROBLEM_MEDIA_TYPE,
        headers=headers,
    )


def blank_problem(status: int, detail: str | None = None) -> Problem:
    """An ``about:blank`` problem: the status code says it all (RFC 9457 §4.2.1)."""
    return Problem(type="about:blank", title=http.HTTPStatus(status).phrase, status=status, detail=detail)


def record_response(record: Record, *, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    """A record as ``application/kvsp+json``."""
    return web.Response(status=status, body=dump_json(record), content_type=KVSP_JSON, headers=headers)


@web.middleware
async def problem_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every refusal into problem details (DESIGN.md §5)."""
    try:
        return await handler(request)
    except ServiceError as exc:
        return problem_response(Problem.of(exc.problem, exc.detail), headers=exc.headers)
    except RecordError as exc:
        return problem_response(Problem.of(problems.BAD_RECORD, str(exc)), extensions={"member": exc.member})
    except KvspError as exc:  # a descriptor (DescriptorError) or another core validation
        member = getattr(exc, "member", None) or "$"
        return problem_response(Problem.of(problems.BAD_RECORD, str(exc)), extensions={"member": member})
    except HttpProblem as exc:
        return problem_response(blank_problem(exc.status, exc.detail), headers=exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "www-authenticate")}
        if exc.status == 404:
            problem = Problem.of(problems.NOT_FOUND, f"no resource at {request.path}")
        else:
            problem = blank_problem(exc.status)
        return problem_response(problem, headers=headers)
    except ConnectionError:
        raise  # the client went away: nobody to answer
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return problem_response(blank_problem(500))


# ---------------------------------------------------------------------------------------------
# Requests


def authenticate(request: web.Request) -> Principal:
    """The principal of a request's bearer token; ``Unauthorized`` (401) otherwise."""
    return request.app[AUTHORIZER].authenticate(request.headers.get("Authorization"))


async def read_body(request: web.Request, max_octets: int, media_types: frozenset[str] = JSON_MEDIA_TYPES) -> bytes:
    """The request body, if its media type is one of ``media_types`` (415 otherwise) and it
    has at most ``max_octets`` octets (413 otherwise, before reading when Content-Length says
    so)."""
    if request.content_type not in media_types or not _utf8_charset(request):
        accepted = ", ".join(sorted(media_types))
        raise HttpProblem(415, f"the body must be one of {accepted} (UTF-8), not {request.content_type}")
    if request.content_length is not None and request.content_length > max_octets:
        raise HttpProblem(413, f"the body exceeds {max_octets} octets")
    body = bytearray()
    async for chunk in request.content.iter_chunked(64 * 1024):
        if len(body) + len(chunk) > max_octets:
            raise HttpProblem(413, f"the body exceeds {max_octets} octets")
        body += chunk
    return bytes(body)


def _utf8_charset(request: web.Request) -> bool:
    charset = request.charset
    return charset is None or charset.lower() in ("utf-8", "utf8")


async def read_json_object(request: web.Request, max_octets: int) -> dict[str, object]:
    """A JSON object body (I-JSON, ``decode_json``); ``RecordError`` at ``$`` otherwise."""
    return decode_json(await read_body(request, max_octets), max_size=max_octets)


async def read_record(request: web.Request, record_type: type[R], max_octets: int) -> R:
    """A JSON body validated as ``record_type`` (unknown members ignored, §4.4)."""
    return parse_json(await read_body(request, max_octets), record_type, max_size=max_octets)


def block_ref(request: web.Request) -> BlockRef:
    """The block named by the ``{compat}/{scope}/{key}`` segments (already matched as hex)."""
    info = request.match_info
    return BlockRef(bytes.fromhex(info["compat"]), bytes.fromhex(info["scope"]), bytes.fromhex(info["key"]))


# ---------------------------------------------------------------------------------------------
# The Index Service (§6.1, §6.2)


class IndexRoutes:
    """Routes of the Index Service under ``service.config.base_path`` (docs/http-api.md)."""

    def __init__(self, service: IndexService) -> None:
        self.service = service
        self.base = service.config.base_path
        self.max_body = service.config.max_body_octets

    def routes(self) -> list[web.RouteDef]:
        base = self.base
        return [
            web.put(f"{base}replicas/{BLOCK_PATH}", self.put_replica),
            web.delete(f"{base}replicas/{BLOCK_PATH}", self.delete_replica),
            web.get(f"{base}replicas/{BLOCK_PATH}", self.get_replicas, allow_head=False),
            web.post(f"{base}lookup", self.lookup),
            web.put(f"{base}instance-status", self.put_instance_status),
            web.put(f"{base}descriptors/{{compat:{HEX32_SEGMENT}}}", self.put_descriptor),
        ]

    def replica_location(self, block: BlockRef, replica: ReplicaId) -> str:
        path = f"{self.base}replicas/{block.compat_id.hex()}/{block.scope_id.hex()}/{block.block_key.hex()}"
        query = f"?holder={quote(replica.holder, safe='')}"
        if replica.moqt_namespace is not None:
            query += f"&moqt_namespace={quote(replica.moqt_namespace, safe='')}"
        return path + query

    async def put_replica(self, request: web.Request) -> web.Response:
        """§6.1 publish or refresh: 201 (new replica, with Location) or 200 (refresh)."""
        principal = authenticate(request)
        record = await read_record(request, ReplicaRecord, self.max_body)
        published = await self.service.publish(principal, record, at=block_ref(request))
        if not published.created:
            return record_response(published.record)
        location = self.replica_location(BlockRef.of(published.record), ReplicaId.of(published.record))
        return record_response(published.record, status=201, headers={"Location": location})

    async def delete_replica(self, request: web.Request) -> web.Response:
        """§6.1 withdraw: ``?holder=URL[&moqt_namespace=NS]`` names the replica; 204."""
        principal = authenticate(request)
        holder = request.query.get("holder")
        if not holder:
            raise RecordError("holder", "query parameter is required: the holder URL of the replica")
        replica = ReplicaId(holder, request.query.get("moqt_namespace"))
        await self.service.withdraw(principal, block_ref(request), replica)
        return web.Response(status=204)

    async def get_replicas(self, request: web.Request) -> web.Response:
        """Ours: the unexpired replicas of one block, as a lookup's matched block."""
        principal = authenticate(request)
        return record_response(await self.service.replicas(principal, block_ref(request)))

    async def lookup(self, request: web.Request) -> web.Response:
        """§6.2 ``POST {is-base}lookup``."""
        principal = authenticate(request)
        body = await read_json_object(request, self.max_body)
        lookup = LookupRequest.from_json(body, max_block_keys=self.service.config.max_block_keys)
        return record_response(await self.service.lookup(principal, lookup))

    async def put_instance_status(self, request: web.Request) -> web.Response:
        """Ours: an Instance Status Record (§4.4, §6.3) for the estimates; 200 with the
        record as kept (ttl_ms capped)."""
        principal = authenticate(request)
        record = await read_record(request, InstanceStatusRecord, self.max_body)
        return record_response(self.service.report_instance_status(principal, record))

    async def put_descriptor(self, request: web.Request) -> web.Response:
        """Ours: a Compatibility Descriptor (§4.1) whose computed ID must be the path's; 201
        when new, 204 when already known."""
        authenticate(request)
        document = await read_json_object(request, self.max_body)
        _, created = self.service.register_descriptor(document, expect=bytes.fromhex(request.match_info["compat"]))
        return web.Response(status=201 if created else 204)


# ---------------------------------------------------------------------------------------------
# Application and server


def build_app(*, auth: Authorizer, index: IndexService | None = None) -> web.Application:
    """One application serving the given roles, all authenticated by ``auth``.

    Later roles (holder, instance, PC) are further keyword arguments, each adding its route
    table under its own base path.
    """
    app = web.Application(middlewares=[problem_middleware])
    app[AUTHORIZER] = auth
    if index is not None:
        app[INDEX_SERVICE] = index
        app.add_routes(IndexRoutes(index).routes())
        if index.config.purge_interval_ms > 0:
            app.cleanup_ctx.append(_purge_periodically)
    return app


async def _purge_periodically(app: web.Application) -> AsyncIterator[None]:
    """Reclaim expired records in the background (reads never return them anyway)."""
    service = app[INDEX_SERVICE]

    async def loop() -> None:
        while True:
            await asyncio.sleep(service.config.purge_interval_ms / 1000)
            try:
                await service.purge()
            except Exception:  # a failing store must not stop the loop
                log.exception("purge of the index failed")

    task = asyncio.create_task(loop())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@dataclass
class RunningServer:
    """A started server; ``port`` is the bound port (also when 0 was asked for)."""

    runner: web.AppRunner
    host: str
    port: int
    base_path: str = "/"

    @property
    def app(self) -> web.Application:
        return self.runner.app

    @property
    def url(self) -> str:
        """The base URL of the served role (``http://127.0.0.1:PORT/base/``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{self.base_path}"

    async def close(self) -> None:
        await self.runner.cleanup()

    async def __aenter__(self) -> RunningServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def serve_app(app: web.Application, host: str = "127.0.0.1", port: int = 0, *, base_path: str = "/") -> RunningServer:
    """Serve ``app`` on ``host:port`` until :meth:`RunningServer.close`."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0]
    except BaseException:
        await runner.cleanup()
        raise
    return RunningServer(runner, host, int(bound[1]), base_path)


async def serve_index(
    config: ControlConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    clock: Clock | None = None,
    store: IndexStore | None = None,
) -> RunningServer:
    """Run an Index Service per ``config`` on ``host:port`` (0: any free port, reported in
    the result). ``store`` defaults to the embedded store; ``clock`` drives every TTL."""
    if store is None:
        service = IndexService.in_memory(config.index, clock=clock)
    else:
        statuses = InstanceStatusTable(clock, max_ttl_ms=config.index.max_status_ttl_ms)
        service = IndexService(store, config=config.index, statuses=statuses)
    app = build_app(auth=config.auth, index=service)
    return await serve_app(app, host, port, base_path=config.index.base_path)
