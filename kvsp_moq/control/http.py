"""HTTP binding of the control-plane services (DESIGN.md §5); the only module importing aiohttp.

Structure: one application per process, built by :func:`build_app` from the services it runs
and one :class:`~.auth.Authorizer`. Each role contributes a route table (:class:`IndexRoutes`,
:class:`HolderRoutes`; the instance and PC add theirs beside it) under its own base path.
:func:`serve_index` and :func:`serve_holder` run one role each. The HTTP *clients* live here
too, behind transport-neutral interfaces defined by the services: :class:`HttpIndexClient`
(``publisher.IndexClient``, a holder publishing to the IS) and :class:`HttpBlockFetcher`
(``retrieval.BlockFetcher``, a client reading blocks from holders). The shared machinery is
role-neutral:

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
import hashlib
import http
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, cast
from urllib.parse import quote, urljoin

import aiohttp
from aiohttp import web

from ..kvsp import problems
from ..kvsp.errors import KvspError, RecordError
from ..kvsp.records import (
    InstanceStatusRecord,
    LeaseGrant,
    LeaseRenewal,
    LeaseRequest,
    LookupRequest,
    LookupResponse,
    MatchedBlock,
    PrefetchDirective,
    Problem,
    Record,
    ReplicaRecord,
    ReshardMessage,
    ReshardPlan,
    SessionCheckpoint,
    ShardMap,
    StateChange,
    decode_json,
    dump_json,
    parse_json,
    parse_reshard_message,
)
from ..kvsp.container import decode_container, encode_container
from ..storage import BlockStore, RecordKey, ReplicaPinned, StoreFull
from .auth import Authorizer, Principal, require_instance
from .clock import Clock, MonotonicClock, Timer
from .config import ControlConfig, FrontEndConfig, HolderConfig, InstanceConfig, PcConfig
from .control_records import InstanceStateRequest, PlacementRequest, SessionRequest, StatusAnswer
from .engine import InferenceEngine
from .engine_counters import CountingFetcher, CountingRetriever, EngineCounters
from .engine_records import GenerateRequest
from .engine_setup import start_engine
from .errors import ServiceError, StaleEpoch
from .frontend import FrontEnd, SessionOpenFailed, StreamEnd, StreamFailed
from .holder import BLOCK_MEDIA_TYPE, HolderService, build_store, repr_digest
from .index import IndexService
from .index_store import BlockRef, IndexStore, ReplicaId
from .instance import InstanceService
from .instance_reporter import PcClient, persisted_epoch, wall_clock_epoch
from .instance_reshard import ShardFetchFailed
from .instance_sessions import PeerUnreachable, SessionEngine, Superseded
from .leases import LeaseLimits, LeaseManager
from .pc import InstanceClient, InstanceUnreachable, PcIndex, PlacementController, SleepPolicy, StartInstance
from .pc_sessions import FrontEndUnreachable, SessionInstanceClient
from .prefetch import LeaseRefused, MoqtRetriever, PrefetchExecutor
from .retrieval import BlockFetcher, parse_repr_digest
from .publisher import IndexClient, IndexRefused, IndexUnreachable, ReplicaPublisher
from .session_records import (
    MAX_OUTPUT_TOKENS,
    CheckpointAck,
    ClientSession,
    ClientSessionRequest,
    DeliveryAnswer,
    FailureReport,
    OutputToken,
    OutputTokens,
    ReshardAck,
    SessionDone,
    SessionFailed,
    SessionOpen,
    SessionOrder,
    SessionView,
)
from .shard_store import ShardSlice, ShardStore, TokenRange
from .status_table import InstanceStatusTable

log = logging.getLogger(__name__)

#: Media type of KVSP JSON bodies (§11.1).
KVSP_JSON = "application/kvsp+json"
#: Request media types accepted for JSON bodies.
JSON_MEDIA_TYPES = frozenset({KVSP_JSON, "application/json"})

AUTHORIZER = web.AppKey("kvsp_authorizer", Authorizer)
INDEX_SERVICE = web.AppKey("kvsp_index_service", IndexService)
HOLDER_SERVICE = web.AppKey("kvsp_holder_service", HolderService)
PC_SERVICE = web.AppKey("kvsp_pc_service", PlacementController)
INSTANCE_SERVICE = web.AppKey("kvsp_instance_service", InstanceService)
FRONTEND_SERVICE = web.AppKey("kvsp_frontend_service", FrontEnd)

R = TypeVar("R", bound=Record)


class _RoutesConfig(Protocol):
    @property
    def base_path(self) -> str: ...
    @property
    def max_body_octets(self) -> int: ...


class _Configured(Protocol):
    @property
    def config(self) -> _RoutesConfig: ...


S = TypeVar("S", bound=_Configured)


class ServiceRoutes(Generic[S]):
    """Routes of one service under its ``config.base_path``, reading bodies of at most its
    ``config.max_body_octets`` (what every Routes class below shares)."""

    def __init__(self, service: S) -> None:
        self.service = service
        self.base = service.config.base_path
        self.max_body = service.config.max_body_octets
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


class IndexRoutes(ServiceRoutes[IndexService]):
    """Routes of the Index Service under ``service.config.base_path`` (docs/http-api.md)."""

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
# The holder (§6.6, §6.7)

#: A lease identifier in a path (records/lease.py LEASE_ID).
LEASE_SEGMENT = "{lease:[A-Za-z0-9._~-]{1,128}}"
#: The largest layer index (``layers=a-b``): a KVB1 field is 32 bits (§4.3).
_MAX_LAYER = (1 << 32) - 1


def record_key(request: web.Request) -> RecordKey:
    """The block resource named by the ``{compat}/{scope}/{key}`` segments (§6.7)."""
    info = request.match_info
    return RecordKey.from_hex(info["compat"], info["scope"], info["key"])


def parse_layers(value: str | None) -> tuple[int, int] | None:
    """``layers=a-b`` (§6.7: the inclusive range a..b); ``RecordError`` at ``layers`` (400)
    unless two decimal integers with a <= b."""
    if value is None:
        return None
    first, sep, last = value.partition("-")
    if not (sep and first.isascii() and last.isascii() and first.isdigit() and last.isdigit()
            and len(first) <= 10 and len(last) <= 10):  # int() refuses > 4300 digits: a 500 before
        raise RecordError("layers", f"must be a-b, two decimal layer indices, got {value[:40]!r}")
    a, b = int(first), int(last)
    if a > b or b > _MAX_LAYER:
        raise RecordError("layers", f"must be an inclusive range a-b with a <= b <= {_MAX_LAYER}, got {value!r}")
    return a, b


def parse_codec(value: str | None) -> int | None:
    """``codec=n`` (§6.7), a decimal KVSP codec value (0..65535); ``RecordError`` otherwise."""
    if value is None:
        return None
    if not (value.isascii() and value.isdigit() and len(value) <= 5) or int(value) > 0xFFFF:
        raise RecordError("codec", f"must be a decimal codec value 0..65535, got {value[:40]!r}")
    return int(value)


async def read_block_body(request: web.Request, max_octets: int) -> memoryview:
    """A ``application/kvsp-block`` body (415 otherwise) of at most ``max_octets`` (413),
    read into one buffer: with Content-Length it is allocated once at its final size and
    filled in place, so the body is held once (the store then copies each section once into
    its tier)."""
    if request.content_type != BLOCK_MEDIA_TYPE:
        raise HttpProblem(415, f"the body must be {BLOCK_MEDIA_TYPE}, not {request.content_type}")
    length = request.content_length
    if length is not None and length > max_octets:
        raise HttpProblem(413, f"the body exceeds {max_octets} octets")
    if length is not None:
        buf = bytearray(length)
        view = memoryview(buf)
        pos = 0
        async for chunk in request.content.iter_chunked(256 * 1024):
            view[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
        return view[:pos]
    grown = bytearray()
    async for chunk in request.content.iter_chunked(256 * 1024):
        if len(grown) + len(chunk) > max_octets:
            raise HttpProblem(413, f"the body exceeds {max_octets} octets")
        grown += chunk
    return memoryview(grown)


class HolderRoutes:
    """Routes of the holder under ``config.base_path`` (docs/http-api.md "Holder")."""

    def __init__(self, service: HolderService, config: HolderConfig) -> None:
        self.service = service
        self.base = config.base_path
        self.config = config

    def routes(self) -> list[web.RouteDef]:
        base = self.base
        return [
            web.get(f"{base}blocks/{BLOCK_PATH}", self.get_block),  # HEAD too
            web.put(f"{base}blocks/{BLOCK_PATH}", self.put_block),
            web.post(f"{base}leases", self.post_lease),
            web.put(f"{base}leases/{LEASE_SEGMENT}", self.put_lease),
            web.delete(f"{base}leases/{LEASE_SEGMENT}", self.delete_lease),
        ]

    async def get_block(self, request: web.Request) -> web.StreamResponse:
        """§6.7 GET: the container, streamed from the store, with Repr-Digest (MUST) and
        ``Cache-Control: private, immutable, max-age`` no longer than the replica's TTL."""
        principal = authenticate(request)
        key = record_key(request)
        layers = parse_layers(request.query.get("layers"))
        codec = parse_codec(request.query.get("codec"))
        read = self.service.open_block(principal, key, layers, codec)
        digest = await self.service.container_sha256(read)
        response = web.StreamResponse(
            status=200,
            headers={
                "Repr-Digest": repr_digest(digest),
                "Cache-Control": f"private, immutable, max-age={read.max_age_s}",
            },
        )
        response.content_type = BLOCK_MEDIA_TYPE
        response.content_length = read.reader.size
        await response.prepare(request)
        if request.method != "HEAD":
            for chunk in read.reader:
                await response.write(chunk)
        await response.write_eof()
        return response

    async def put_block(self, request: web.Request) -> web.Response:
        """§6.7 PUT with ``If-None-Match: *``: 201 and the Replica Record as published."""
        principal = authenticate(request)
        key = record_key(request)
        if request.headers.get("If-None-Match", "").strip() != "*":
            # RFC 6585 §3: the holder requires the conditional form (§6.7).
            raise HttpProblem(428, "PUT on a block requires If-None-Match: *")
        self.service.check_store(principal, key)  # 403, then 412 before reading the body
        body = await read_block_body(request, self.config.max_block_octets)
        try:
            record = await self.service.store_block(principal, key, body)
        except StoreFull as exc:
            raise HttpProblem(507, f"no room: {exc}") from None
        location = f"{self.base}blocks/{key.path}"
        return record_response(record, status=201, headers={"Location": location})

    async def post_lease(self, request: web.Request) -> web.Response:
        """§6.6 POST leases: 201 with a LeaseGrant and Location ``leases/{id}``."""
        principal = authenticate(request)
        lease_request = await read_record(request, LeaseRequest, self.config.max_body_octets)
        grant = self.service.leases.grant(principal, lease_request)
        return record_response(grant, status=201, headers={"Location": f"{self.base}leases/{grant.lease}"})

    async def put_lease(self, request: web.Request) -> web.Response:
        """§6.6 renewal: 200 with the new LeaseGrant."""
        principal = authenticate(request)
        renewal = await read_record(request, LeaseRenewal, self.config.max_body_octets)
        grant = self.service.leases.renew(principal, request.match_info["lease"], renewal.ttl_ms)
        return record_response(grant)

    async def delete_lease(self, request: web.Request) -> web.Response:
        """§6.6 release: 204."""
        principal = authenticate(request)
        self.service.leases.release(principal, request.match_info["lease"])
        return web.Response(status=204)


# ---------------------------------------------------------------------------------------------
# The Placement Controller (§6.3, §6.4)


class PcRoutes(ServiceRoutes[PlacementController]):
    """Routes of the PC under ``service.config.base_path`` (docs/http-api.md "Placement Controller")."""

    def routes(self) -> list[web.RouteDef]:
        base = self.base
        return [
            web.put(f"{base}instance-status", self.put_instance_status),
            web.put(f"{base}instance-state", self.put_instance_state),
            web.get(f"{base}instances", self.get_instances, allow_head=False),
            web.post(f"{base}placements", self.post_placement),
        ]

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


# ---------------------------------------------------------------------------------------------
# The inference instance (§6.3, §6.5)

UUID_SEGMENT = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


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


class EngineRoutes:
    """The engine's routes under the instance's base path (ours; docs/http-api.md "Generation"):
    ``POST generate`` runs one request on the model, ``GET engine`` returns its counters."""

    def __init__(self, service: InstanceService, engine: InferenceEngine) -> None:
        self.engine = engine
        self.base = service.config.base_path
        self.max_body = service.config.max_body_octets

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post(f"{self.base}generate", self.post_generate),
            web.get(f"{self.base}engine", self.get_engine, allow_head=False),
        ]

    async def post_generate(self, request: web.Request) -> web.Response:
        """200 with the output tokens, their indices and where the prompt's KV came from;
        403 without the scope (or its key here), 409 ``kvsp-not-active`` when not active."""
        principal = authenticate(request)
        body = await read_record(request, GenerateRequest, self.max_body)
        return record_response(await self.engine.generate(principal, body))

    async def get_engine(self, request: web.Request) -> web.Response:
        authenticate(request)
        return web.json_response(self.engine.stats(), content_type=KVSP_JSON)


# ---------------------------------------------------------------------------------------------
# Sessions, checkpoints and migration (§6.8), resharding (§6.9), the front end

#: A Shard Map identifier in a path (ours: unreserved characters only, so it needs no escaping).
MAP_SEGMENT = "[A-Za-z0-9._~-]{1,256}"
#: Media type of a front end's token stream (one JSON object per line).
NDJSON = "application/x-ndjson"


def path_session(request: web.Request) -> uuid.UUID:
    return uuid.UUID(request.match_info["session"])


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


class PcSessionRoutes(ServiceRoutes[PlacementController]):
    """The PC's §6.8 and §6.9 routes (docs/http-api.md "Sessions" and "Resharding")."""

    def routes(self) -> list[web.RouteDef]:
        base = self.base
        session = f"{base}sessions/{{session:{UUID_SEGMENT}}}"
        return [
            web.post(f"{base}sessions", self.post_session),
            web.get(session, self.get_session, allow_head=False),
            web.put(f"{session}/checkpoint", self.put_checkpoint),
            web.post(f"{session}/done", self.post_done),
            web.post(f"{session}/failed", self.post_failed),
            web.post(f"{base}failures", self.post_failure),
            web.put(f"{base}shard-maps/{{map:{MAP_SEGMENT}}}", self.put_shard_map),
            web.get(f"{base}shard-maps/{{map:{MAP_SEGMENT}}}", self.get_shard_map, allow_head=False),
        ]

    async def post_session(self, request: web.Request) -> web.Response:
        """Ours: place (§6.4) and start a session; 201 with its view."""
        principal = authenticate(request)
        body = await read_record(request, SessionOpen, self.max_body)
        view = await self.service.sessions.open(principal, body)
        return record_response(view, status=201, headers={"Location": f"{self.base}sessions/{body.session}"})

    async def get_session(self, request: web.Request) -> web.Response:
        return record_response(self.service.sessions.view(authenticate(request), path_session(request)))

    async def put_checkpoint(self, request: web.Request) -> web.Response:
        """§6.8: 200 with the acknowledgement; 409 ``kvsp-stale-epoch`` for a lower epoch."""
        principal = authenticate(request)
        cp = await read_record(request, SessionCheckpoint, self.max_body)
        return record_response(self.service.sessions.checkpoint(principal, path_session(request), cp))

    async def post_done(self, request: web.Request) -> web.Response:
        principal = authenticate(request)
        body = await read_record(request, SessionDone, self.max_body)
        self.service.sessions.done(principal, path_session(request), body)
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
        return record_response(self.service.deliver(principal, path_session(request), batch))

    async def post_failed(self, request: web.Request) -> web.Response:
        """Ours (§6.8): the PC gave the session up; its client streams end with the reason.
        204; 409 ``kvsp-stale-epoch`` for an epoch lower than one seen here."""
        principal = authenticate(request)
        notice = await read_record(request, SessionFailed, self.max_body)
        self.service.fail(principal, path_session(request), notice)
        return web.Response(status=204)

    async def get_tokens(self, request: web.Request) -> web.StreamResponse:
        """The client's stream: NDJSON lines ``{"index", "token"}`` in index order, each index
        once, then ``{"end": n}``, or ``{"failed": reason, "next": n}`` when the PC gave the
        session up; ``?from=i`` starts at index i."""
        principal = authenticate(request)
        start = request.query.get("from", "0")
        if not (start.isascii() and start.isdigit() and len(start) <= 16):
            raise RecordError("from", f"must be a token index, got {start[:40]!r}")
        items = self.service.stream(principal, path_session(request), int(start))
        response = web.StreamResponse(status=200, headers={"Cache-Control": "no-store"})
        response.content_type = NDJSON
        await response.prepare(request)
        async for item in items:
            line: dict[str, object]
            if isinstance(item, StreamEnd):
                line = {"end": item.end}
            elif isinstance(item, StreamFailed):
                line = {"failed": item.reason, "next": item.next}
            else:
                line = item.to_json()
            await response.write(json.dumps(line, separators=(",", ":")).encode() + b"\n")
        await response.write_eof()
        return response


# ---------------------------------------------------------------------------------------------
# Application and server


def build_app(
    *,
    auth: Authorizer,
    index: IndexService | None = None,
    holder: HolderService | None = None,
    holder_config: HolderConfig | None = None,
    pc: PlacementController | None = None,
    instance: InstanceService | None = None,
    frontend: FrontEnd | None = None,
) -> web.Application:
    """One application serving the given roles, all authenticated by ``auth``.

    Each role adds its route table under its own base path (the holder's from
    ``holder_config``, default :class:`HolderConfig`). Later roles (instance, PC) are further
    keyword arguments.
    """
    app = web.Application(middlewares=[problem_middleware])
    app[AUTHORIZER] = auth
    if index is not None:
        app[INDEX_SERVICE] = index
        app.add_routes(IndexRoutes(index).routes())
        if index.config.purge_interval_ms > 0:
            app.cleanup_ctx.append(_purge_periodically)
    if holder is not None:
        app[HOLDER_SERVICE] = holder
        app.add_routes(HolderRoutes(holder, holder_config or HolderConfig()).routes())
    if pc is not None:
        app[PC_SERVICE] = pc
        app.add_routes(PcRoutes(pc).routes())
        app.add_routes(PcSessionRoutes(pc).routes())
    if instance is not None:
        app[INSTANCE_SERVICE] = instance
        app.add_routes(InstanceRoutes(instance).routes())
        app.add_routes(InstanceSessionRoutes(instance).routes())
        if instance.inference is not None:
            app.add_routes(EngineRoutes(instance, instance.inference).routes())
    if frontend is not None:
        app[FRONTEND_SERVICE] = frontend
        app.add_routes(FrontEndRoutes(frontend).routes())
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


# ---------------------------------------------------------------------------------------------
# The holder's server


class _Url:
    """The holder URL, known once the server is bound when the configuration names none."""

    def __init__(self, url: str | None) -> None:
        self.url = url

    def __call__(self) -> str:
        if self.url is None:
            raise RuntimeError("the holder URL is not known yet")
        return self.url


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
    url = _Url(hc.url)
    publisher = ReplicaPublisher(
        store, index_client, holder_url=url, clock=clock, ttl_ms=hc.record_ttl_ms, refresh_ms=hc.refresh_ms,
        retry_ms=hc.withdraw_retry_ms, retry_max_ms=hc.withdraw_retry_max_ms,
    )
    limits = LeaseLimits(hc.max_lease_ttl_ms, hc.max_leased_octets, hc.max_leases, hc.max_lease_keys)
    service = HolderService(
        store, clock=clock, leases=LeaseManager(store, clock, limits), publisher=publisher, chunk_octets=hc.chunk_octets
    )
    app = build_app(auth=config.auth, holder=service, holder_config=hc)

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


# ---------------------------------------------------------------------------------------------
# Clients: the holder's Index Service client (§6.1) and the block fetcher (§6.7)


async def _problem_of(response: aiohttp.ClientResponse) -> tuple[str | None, str]:
    """(KVSP problem name, detail) of an error response's problem details, if it has one."""
    if response.content_type != problems.PROBLEM_MEDIA_TYPE:
        return None, response.reason or ""
    try:
        body = await response.content.read(64 * 1024)
        problem = Problem.from_json(json.loads(body))
    except (ValueError, KvspError, aiohttp.ClientError):
        return None, response.reason or ""
    return problem.name, problem.detail or ""


class HttpIndexClient:
    """:class:`~.publisher.IndexClient` over HTTP (docs/http-api.md "Index Service")."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        *,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.base_url = base_url if base_url.endswith("/") else base_url + "/"
        self._token = token
        self._session = session
        self._owned = session is None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    def _url(self, key_path: str) -> str:
        return f"{self.base_url}replicas/{key_path}"

    async def publish(self, record: ReplicaRecord) -> ReplicaRecord:
        path = f"{record.compat_id.hex()}/{record.scope_id.hex()}/{record.block_key.hex()}"
        headers = self._headers() | {"Content-Type": KVSP_JSON}
        try:
            async with self._client().put(self._url(path), data=dump_json(record), headers=headers, timeout=self._timeout) as resp:
                if resp.status in (200, 201):
                    return parse_json(await resp.read(), ReplicaRecord)
                await self._raise(resp)
        except (aiohttp.ClientError, asyncio.TimeoutError, KvspError) as exc:
            raise IndexUnreachable(f"PUT {path}: {type(exc).__name__}: {exc}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def withdraw(self, key: RecordKey, holder: str, moqt_namespace: str | None) -> bool:
        params = {"holder": holder}
        if moqt_namespace is not None:
            params["moqt_namespace"] = moqt_namespace
        try:
            async with self._client().delete(self._url(key.path), params=params, headers=self._headers(), timeout=self._timeout) as resp:
                if resp.status == 204:
                    return True
                if resp.status == 404:
                    return False  # already gone (expired, or withdrawn before)
                await self._raise(resp)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise IndexUnreachable(f"DELETE {key.path}: {type(exc).__name__}: {exc}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def lookup(self, request: LookupRequest) -> LookupResponse:
        """``POST {is}lookup`` (§6.2), for the PC (``pc.PcIndex``)."""
        status, body, name, detail = await _call(self._client(), "POST", f"{self.base_url}lookup", self._token, request, self._timeout)
        if status != 200:
            raise IndexUnreachable(f"lookup: status {status} {name or ''}: {detail}")
        return parse_json(body, LookupResponse)

    async def report_status(self, record: InstanceStatusRecord) -> None:
        """``PUT {is}instance-status``: the PC passes on the statuses it receives (§6.4 inputs)."""
        status, _, name, detail = await _call(self._client(), "PUT", f"{self.base_url}instance-status", self._token, record, self._timeout)
        if status != 200:
            raise IndexRefused(status, name, detail)

    async def replicas(self, key: RecordKey) -> list[ReplicaRecord]:
        """``GET {is}replicas/{compat}/{scope}/{key}`` (ours): the unexpired records of a block,
        for an instance executing a directive (``prefetch.ReplicaSource``); [] on 404."""
        status, body, name, detail = await _call(self._client(), "GET", self._url(key.path), self._token, None, self._timeout)
        if status == 404:
            return []
        if status != 200:
            raise IndexUnreachable(f"replicas of {key}: status {status} {name or ''}: {detail}")
        return list(parse_json(body, MatchedBlock).replicas)

    @staticmethod
    async def _raise(resp: aiohttp.ClientResponse) -> None:
        name, detail = await _problem_of(resp)
        if 400 <= resp.status < 500 and resp.status not in (408, 429):
            raise IndexRefused(resp.status, name, detail)
        raise IndexUnreachable(f"status {resp.status} {name or ''}: {detail}")

    async def close(self) -> None:
        if self._owned and self._session is not None:
            await self._session.close()
            self._session = None


@dataclass
class HttpBlockResponse:
    """:class:`~.retrieval.BlockResponse` of an aiohttp response."""

    response: aiohttp.ClientResponse
    problem: str | None
    chunk_octets: int

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def content_type(self) -> str | None:
        return self.response.headers.get("Content-Type")

    @property
    def content_length(self) -> int | None:
        return self.response.content_length

    @property
    def repr_digest(self) -> str | None:
        return self.response.headers.get("Repr-Digest")

    async def chunks(self) -> AsyncIterator[bytes]:
        async for chunk in self.response.content.iter_chunked(self.chunk_octets):
            yield chunk


class HttpBlockFetcher:
    """:class:`~.retrieval.BlockFetcher` over HTTP: GET with the client's bearer token.

    ``read_timeout_s`` bounds the wait for each read from the holder (connecting, the status
    line, every part of the body): a holder that stops sending mid-body fails this replica
    with a timeout after that long, and ``retrieval.retrieve_block`` tries the next replica,
    instead of the request waiting up to ``timeout_s`` (the bound on the whole transfer).
    """

    def __init__(
        self,
        token: str | None,
        *,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float = 60.0,
        read_timeout_s: float | None = 5.0,
        chunk_octets: int = 256 * 1024,
    ) -> None:
        self._token = token
        self._session = session
        self._owned = session is None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=read_timeout_s, sock_read=read_timeout_s)
        self.chunk_octets = chunk_octets

    @contextlib.asynccontextmanager
    async def get(self, url: str) -> AsyncIterator[HttpBlockResponse]:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        # No automatic decompression: Repr-Digest covers the representation as sent.
        async with self._session.get(url, headers=headers, timeout=self._timeout, auto_decompress=False) as resp:
            problem = None
            if resp.status >= 400:
                problem, _ = await _problem_of(resp)
            yield HttpBlockResponse(resp, problem, self.chunk_octets)

    async def close(self) -> None:
        if self._owned and self._session is not None:
            await self._session.close()
            self._session = None


async def _call(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    token: str | None,
    body: Record | None,
    timeout: aiohttp.ClientTimeout,
) -> tuple[int, bytes, str | None, str]:
    """One JSON request: (status, body, problem name, problem detail). Transport errors raise
    ``aiohttp.ClientError`` / ``asyncio.TimeoutError``."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = None
    if body is not None:
        data = dump_json(body)
        headers["Content-Type"] = KVSP_JSON
    async with session.request(method, url, data=data, headers=headers, timeout=timeout) as resp:
        if resp.status >= 400:
            name, detail = await _problem_of(resp)
            return resp.status, b"", name, detail
        return resp.status, await resp.read(), None, ""


class _Client:
    """A lazily created aiohttp session and a bearer token."""

    def __init__(self, token: str | None, *, session: aiohttp.ClientSession | None = None, timeout_s: float = 10.0) -> None:
        self._token = token
        self._session = session
        self._owned = session is None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _call(self, method: str, url: str, body: Record | None = None) -> tuple[int, bytes, str | None, str]:
        return await _call(self._client(), method, url, self._token, body, self._timeout)

    async def close(self) -> None:
        if self._owned and self._session is not None:
            await self._session.close()
            self._session = None


def _base(url: str) -> str:
    return url if url.endswith("/") else url + "/"


class HttpLeaseClient(_Client):
    """:class:`~.prefetch.LeaseClient` over HTTP (§6.6 ``POST``/``DELETE {holder}leases``)."""

    async def lease(self, holder: str, request: LeaseRequest) -> LeaseGrant:
        try:
            status, body, name, detail = await self._call("POST", f"{_base(holder)}leases", request)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise LeaseRefused(f"{type(exc).__name__}: {exc}") from exc
        if status != 201:
            raise LeaseRefused(f"status {status} {name or ''}: {detail}")
        return parse_json(body, LeaseGrant)

    async def release(self, holder: str, lease: str) -> None:
        status, _, name, detail = await self._call("DELETE", f"{_base(holder)}leases/{lease}")
        if status not in (204, 404):  # 404: expired already
            raise LeaseRefused(f"release: status {status} {name or ''}: {detail}")


class HttpBlockStorer(_Client):
    """:class:`~.engine_publish.BlockStorer` over HTTP: ``PUT {holder}blocks/...`` with
    ``If-None-Match: *`` (§6.7); an instance storing the blocks it computed."""

    async def put_block(self, holder: str, key: RecordKey, container: bytes) -> bool:
        headers = {"Content-Type": BLOCK_MEDIA_TYPE, "If-None-Match": "*"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        url = f"{_base(holder)}blocks/{key.path}"
        async with self._client().put(url, data=container, headers=headers, timeout=self._timeout) as resp:
            if resp.status == 201:
                return True
            if resp.status == 412:
                return False  # §6.7: the holder already has a replica and keeps it
            name, detail = await _problem_of(resp)
            raise IndexRefused(resp.status, name, f"PUT {url}: {detail}")


class HttpInstanceClient(_Client):
    """:class:`~.pc.InstanceClient` over HTTP: the PC's ``PUT state`` and ``POST prefetch``."""

    async def put_state(self, instance: str, state: str) -> str:
        try:
            status, body, name, detail = await self._call("PUT", f"{_base(instance)}state", StateChange(state=state))
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise InstanceUnreachable(f"{type(exc).__name__}: {exc}") from exc
        if status != 200:
            raise InstanceUnreachable(f"status {status} {name or ''}: {detail}")
        return parse_json(body, StatusAnswer).state

    async def prefetch(self, instance: str, directive: PrefetchDirective) -> str:
        url = f"{_base(instance)}prefetch"
        headers = {"Content-Type": KVSP_JSON} | ({"Authorization": f"Bearer {self._token}"} if self._token else {})
        try:
            async with self._client().post(url, data=dump_json(directive), headers=headers, timeout=self._timeout) as resp:
                if resp.status != 202:
                    name, detail = await _problem_of(resp)
                    raise InstanceUnreachable(f"status {resp.status} {name or ''}: {detail}")
                location = resp.headers.get("Location")
                if not location:
                    raise InstanceUnreachable("202 without Location")
                return urljoin(url, location)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise InstanceUnreachable(f"{type(exc).__name__}: {exc}") from exc

    async def _instance_call(self, method: str, url: str, body: Record | None, expect: int) -> bytes:
        try:
            status, data, name, detail = await self._call(method, url, body)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise InstanceUnreachable(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        if status != expect:
            raise InstanceUnreachable(f"{method} {url}: status {status} {name or ''}: {detail}")
        return data

    async def start_session(self, instance: str, order: SessionOrder) -> None:
        """``POST {ii}sessions/{id}/start`` (``pc_sessions.SessionInstanceClient``)."""
        await self._instance_call("POST", f"{_base(instance)}sessions/{order.session}/start", order, 202)

    async def resume_session(self, instance: str, order: SessionOrder) -> None:
        """``POST {ii}sessions/{id}/resume`` (§6.8)."""
        await self._instance_call("POST", f"{_base(instance)}sessions/{order.session}/resume", order, 202)

    async def reshard(self, instance: str, message: ReshardMessage) -> ReshardAck | None:
        """``POST {ii}reshard`` (§6.9, ``pc_reshard.ReshardClient``): a plan waits for the
        instance's fetches, so it gets no timeout of its own (the PC's deadline ends it)."""
        url = f"{_base(instance)}reshard"
        if isinstance(message, ReshardPlan):
            try:
                status, data, name, detail = await _call(self._client(), "POST", url, self._token, message,
                                                         aiohttp.ClientTimeout(total=None))
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise InstanceUnreachable(f"POST {url}: {type(exc).__name__}: {exc}") from exc
            if status != 200:
                raise InstanceUnreachable(f"POST {url}: status {status} {name or ''}: {detail}")
            try:
                return parse_json(data, ReshardAck)
            except RecordError as exc:
                raise InstanceUnreachable(f"POST {url}: bad acknowledgement: {exc}") from None
        await self._instance_call("POST", url, message, 200)
        return None


class PcRefused(Exception):
    """The PC refused a status report (e.g. 409 ``kvsp-stale-epoch``)."""

    def __init__(self, status: int, problem: str | None, detail: str) -> None:
        self.status = status
        self.problem = problem
        super().__init__(f"{status} {problem or ''}: {detail}")


class HttpPcClient(_Client):
    """:class:`~.instance_reporter.PcClient` over HTTP: ``PUT {pc}instance-status``."""

    def __init__(self, pc_url: str, token: str | None, **kw: object) -> None:
        super().__init__(token, **kw)  # type: ignore[arg-type]
        self.pc_url = _base(pc_url)

    async def report(self, record: InstanceStatusRecord) -> StatusAnswer:
        status, body, name, detail = await self._call("PUT", f"{self.pc_url}instance-status", record)
        if status != 200:
            raise PcRefused(status, name, detail)
        return parse_json(body, StatusAnswer)

    async def _session_call(self, method: str, path: str, body: Record, expect: int) -> bytes:
        """For a running session (``instance_sessions.CheckpointSink``): ``Superseded`` on
        ``kvsp-stale-epoch``, ``PeerUnreachable`` on anything else."""
        try:
            status, data, name, detail = await self._call(method, f"{self.pc_url}{path}", body)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise PeerUnreachable(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        if status == 409 and name == problems.STALE_EPOCH:
            raise Superseded(detail)
        if status != expect:
            raise PeerUnreachable(f"{method} {path}: status {status} {name or ''}: {detail}")
        return data

    async def checkpoint(self, checkpoint: SessionCheckpoint) -> CheckpointAck:
        """``PUT {pc}sessions/{id}/checkpoint`` (§6.8)."""
        data = await self._session_call("PUT", f"sessions/{checkpoint.session}/checkpoint", checkpoint, 200)
        try:
            return parse_json(data, CheckpointAck)
        except RecordError as exc:
            raise PeerUnreachable(f"bad checkpoint acknowledgement: {exc}") from None

    async def session_done(self, session: uuid.UUID, done: SessionDone) -> None:
        """``POST {pc}sessions/{id}/done`` (ours)."""
        await self._session_call("POST", f"sessions/{session}/done", done, 204)

    async def session_failed(self, session: uuid.UUID, failed: SessionFailed) -> None:
        """``POST {pc}sessions/{id}/failed`` (ours): this instance cannot serve the session."""
        await self._session_call("POST", f"sessions/{session}/failed", failed, 200)

    async def open_session(self, body: SessionOpen) -> SessionView:
        """``POST {pc}sessions`` (ours; ``frontend.SessionOpener``)."""
        try:
            status, data, name, detail = await self._call("POST", f"{self.pc_url}sessions", body)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise SessionOpenFailed(f"{type(exc).__name__}: {exc}") from exc
        if status != 201:
            raise SessionOpenFailed(f"status {status} {name or ''}: {detail}")
        try:
            return parse_json(data, SessionView)
        except RecordError as exc:
            raise SessionOpenFailed(f"bad answer: {exc}") from None


class HttpFrontEndClient(_Client):
    """Front ends over HTTP: an instance delivering output (``instance_sessions.TokenSink``),
    and a client starting a session and reading its stream."""

    async def deliver(self, front_end: str, batch: OutputTokens) -> None:
        """``POST {fe}sessions/{id}/tokens``; ``Superseded`` on ``kvsp-stale-epoch``."""
        url = f"{_base(front_end)}sessions/{batch.session}/tokens"
        try:
            status, _, name, detail = await self._call("POST", url, batch)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise PeerUnreachable(f"POST {url}: {type(exc).__name__}: {exc}") from exc
        if status == 409 and name == problems.STALE_EPOCH:
            raise Superseded(detail)
        if status != 200:
            raise PeerUnreachable(f"POST {url}: status {status} {name or ''}: {detail}")

    async def session_failed(self, front_end: str, session: uuid.UUID, notice: SessionFailed) -> None:
        """``POST {fe}sessions/{id}/failed`` (ours; ``pc_sessions.FrontEndNotifier``): the PC
        gave the session up. ``FrontEndUnreachable`` on anything but 204."""
        url = f"{_base(front_end)}sessions/{session}/failed"
        try:
            status, _, name, detail = await self._call("POST", url, notice)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise FrontEndUnreachable(f"POST {url}: {type(exc).__name__}: {exc}") from exc
        if status != 204:
            raise FrontEndUnreachable(f"POST {url}: status {status} {name or ''}: {detail}")

    async def start(self, front_end: str, request: ClientSessionRequest) -> ClientSession:
        """``POST {fe}sessions``: a new session, placed and started; ``PeerUnreachable`` otherwise."""
        status, data, name, detail = await self._call("POST", f"{_base(front_end)}sessions", request)
        if status != 201:
            raise PeerUnreachable(f"status {status} {name or ''}: {detail}")
        return parse_json(data, ClientSession)

    async def tokens(self, front_end: str, session: uuid.UUID,
                     start: int = 0) -> AsyncIterator[OutputToken | StreamEnd | StreamFailed]:
        """``GET {fe}sessions/{id}/tokens``: the output, in index order, then its end (or the
        session's failure); ``PeerUnreachable`` for a line that is none of these."""
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        url = f"{_base(front_end)}sessions/{session}/tokens"
        async with self._client().get(url, params={"from": str(start)}, headers=headers,
                                      timeout=aiohttp.ClientTimeout(total=None, sock_read=None)) as resp:
            if resp.status != 200:
                name, detail = await _problem_of(resp)
                raise PeerUnreachable(f"status {resp.status} {name or ''}: {detail}")
            async for line in resp.content:
                try:
                    item = decode_json(line)
                    if "failed" in item:
                        reason = item["failed"]
                        if not isinstance(reason, str):
                            raise RecordError("failed", "must be a string")
                        yield StreamFailed(reason=reason, next=_stream_count(item, "next"))
                        return
                    if "end" in item:
                        yield StreamEnd(end=_stream_count(item, "end"))
                        return
                    token = OutputToken.from_json(item)
                except RecordError as exc:
                    raise PeerUnreachable(f"{url}: bad stream line: {exc}") from None
                yield token


def _stream_count(line: Mapping[str, object], name: str) -> int:
    """``end`` or ``next`` of a token stream's last line: a number of output tokens."""
    value = line.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_OUTPUT_TOKENS:
        raise RecordError(name, f"must be a number of output tokens, got {value!r:.40}")
    return value


class HttpShardFetcher(_Client):
    """:class:`~.instance_reshard.ShardFetcher` over HTTP: ``GET {peer}shards/{map}/{v}?tokens=a-b``,
    the container's Repr-Digest verified (RFC 9530) and its Token Count checked."""

    def __init__(self, token: str | None, *, max_octets: int = 1 << 34, **kw: object) -> None:
        super().__init__(token, **kw)  # type: ignore[arg-type]
        self.max_octets = max_octets

    async def fetch(self, source: str, map_id: str, version: int, tokens: TokenRange) -> ShardSlice:
        url = f"{_base(source)}shards/{quote(map_id, safe='')}/{version}"
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        try:
            async with self._client().get(url, params={"tokens": f"{tokens[0]}-{tokens[1]}"}, headers=headers,
                                          timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False) as resp:
                if resp.status != 200:
                    name, detail = await _problem_of(resp)
                    raise ShardFetchFailed(f"{url}: status {resp.status} {name or ''}: {detail}")
                if resp.content_length is not None and resp.content_length > self.max_octets:
                    raise ShardFetchFailed(f"{url}: {resp.content_length} octets exceed {self.max_octets}")
                body = await resp.read()
                announced = resp.headers.get("Repr-Digest")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise ShardFetchFailed(f"{url}: {type(exc).__name__}: {exc}") from exc
        digest = parse_repr_digest(announced)
        if digest is None or digest != hashlib.sha256(body).digest():
            raise ShardFetchFailed(f"{url}: Repr-Digest missing or wrong")
        try:
            box = decode_container(body)
        except KvspError as exc:
            raise ShardFetchFailed(f"{url}: bad container: {exc}") from None
        if box.header.token_count != tokens[1] - tokens[0] or box.header.first_layer != 0:
            raise ShardFetchFailed(f"{url}: the container holds {box.header.token_count} tokens, not {tokens}")
        try:
            return ShardSlice(tokens, tuple((bytes(layer.k), bytes(layer.v)) for layer in box.layers()))
        except ValueError as exc:
            raise ShardFetchFailed(f"{url}: {exc}") from None


# ---------------------------------------------------------------------------------------------
# Servers of the PC and of an instance


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
    owned: list[_Client | HttpIndexClient] = []
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
    app = build_app(auth=config.auth, pc=service)

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

    ``clock`` (a :class:`~.clock.Timer`: ``MonotonicClock`` or ``ManualClock``) drives the
    status reports, deadlines and TTLs. ``epoch`` defaults to the configured ``epoch_file``
    counter, else the start time in ms (§6.3). ``pc`` defaults to :class:`HttpPcClient` for
    ``pc_url``. With ``report`` the reports run in the background (first one at start, then
    every ``report_ms``; the first report is awaited before this returns); tests pass ``report=False`` and call ``service.reporter.report_now()``.
    The instance URL is ``url``, else the bound address. ``session_engine`` runs the sessions
    the PC starts and resumes (§6.8, ``instance_sessions.SessionEngine``; none: they are
    refused with 409); ``shard_store`` holds its sequence shards (§6.9; default in memory).
    """
    ic: InstanceConfig = config.instance
    timer: Timer = clock if clock is not None else MonotonicClock()
    store = store if store is not None else build_store(ic.tiers, timer)
    if epoch is None:
        epoch = persisted_epoch(ic.epoch_file) if ic.epoch_file else wall_clock_epoch()
    owned: list[_Client | HttpIndexClient] = []
    index_client: HttpIndexClient | None = None
    if ic.index_url is not None:
        index_client = HttpIndexClient(ic.index_url, ic.token)
        owned.append(index_client)
    if pc is None and ic.pc_url is not None:
        pc_client = HttpPcClient(ic.pc_url, ic.token)
        owned.append(pc_client)
        pc = pc_client
    leases = HttpLeaseClient(ic.token)
    fetcher = HttpBlockFetcher(ic.token, read_timeout_s=ic.block_read_timeout_ms / 1000)
    owned.append(leases)
    url = _Url(ic.url)
    publisher = ReplicaPublisher(store, index_client, holder_url=url, clock=timer, ttl_ms=ic.record_ttl_ms,
                                 refresh_ms=max(1, ic.record_ttl_ms // 3))
    replicas = index_client if index_client is not None else _NoIndex()
    # [instance.engine]: what directives load is counted with what requests load (engine_counters.py).
    counters = EngineCounters() if ic.engine is not None else None
    counted_fetcher = CountingFetcher(counters, cast(BlockFetcher, fetcher), 0) if counters is not None else None
    counted_retriever = CountingRetriever(counters, moqt_retriever) if counters is not None else None
    executor = PrefetchExecutor(
        store=store, publisher=publisher, replicas=replicas, leases=leases,
        fetcher=counted_fetcher if counted_fetcher is not None else cast(BlockFetcher, fetcher), timer=timer,
        max_directives=ic.max_directives, blocks_in_flight=ic.prefetch_blocks_in_flight,
        moqt_retriever=counted_retriever if counted_retriever is not None else moqt_retriever,
    )
    session_pc = pc if isinstance(pc, HttpPcClient) else None
    if session_pc is None and ic.pc_url is not None:
        session_pc = HttpPcClient(ic.pc_url, ic.token)
        owned.append(session_pc)
    front_ends = HttpFrontEndClient(ic.token)
    shard_fetcher = HttpShardFetcher(ic.token)
    owned += [front_ends, shard_fetcher]
    service = InstanceService(url=ic.url or "http://unbound/", epoch=epoch, store=store, prefetch=executor,
                              timer=timer, pc=pc, config=ic, session_engine=session_engine, checkpoints=session_pc,
                              front_ends=front_ends, shard_store=shard_store, shard_fetcher=shard_fetcher)
    if ic.engine is not None:
        assert counters is not None and counted_fetcher is not None
        storer = HttpBlockStorer(ic.token)
        owned.append(storer)
        try:
            service.inference = await start_engine(
                ic.engine, store=store, lifecycle=service.lifecycle, url=lambda: service.url, index=index_client,
                index_publisher=index_client, fetcher=cast(BlockFetcher, fetcher), storer=storer,
                replica_publisher=publisher, directives=executor, token=ic.token, counters=counters,
                owned=(counted_retriever,) if counted_retriever is not None else ())
        except BaseException:
            await fetcher.close()
            for client in owned:
                await client.close()
            raise
        counted_fetcher.layers = service.inference.bundle.layers
    app = build_app(auth=config.auth, instance=service)

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
    server = await serve_app(app, host, port, base_path=ic.base_path)
    if url.url is None:
        url.url = server.url
    service.url = url()
    # Background tasks start once the URL is known (the first report names the instance).
    tasks.append(asyncio.create_task(publisher.run()))
    if report:
        await service.reporter.report_logged()  # known to the PC before it announces itself
        tasks.append(asyncio.create_task(service.reporter.run()))
    return server


class _NoIndex:
    """Without an IS the instance cannot verify anything it would load: no records."""

    async def replicas(self, key: RecordKey) -> list[ReplicaRecord]:
        return []



async def serve_frontend(
    config: ControlConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    pc: HttpPcClient | None = None,
) -> RunningServer:
    """Run a front end per ``config.frontend`` (§6.8). ``pc`` defaults to :class:`HttpPcClient`
    for ``pc_url`` with ``pc_token`` (none: clients cannot start sessions, instances can still
    deliver to sessions registered in Python). Its URL is ``url``, else the bound address."""
    fc: FrontEndConfig = config.frontend
    owned: list[_Client] = []
    if pc is None and fc.pc_url is not None:
        pc = HttpPcClient(fc.pc_url, fc.pc_token)
        owned.append(pc)
    url = _Url(fc.url)
    service = FrontEnd(config=fc, pc=pc, url=url)
    app = build_app(auth=config.auth, frontend=service)

    async def end_streams(app: web.Application) -> None:
        service.close()  # open token streams would otherwise hold the shutdown

    app.on_shutdown.append(end_streams)

    async def close_clients(app: web.Application) -> AsyncIterator[None]:
        yield
        for client in owned:
            await client.close()

    app.cleanup_ctx.append(close_clients)
    server = await serve_app(app, host, port, base_path=fc.base_path)
    if url.url is None:
        url.url = server.url
    return server
