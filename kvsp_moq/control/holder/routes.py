"""HTTP routes of the holder (kvsp-draft §6.6, §6.7; docs/http-api.md "Holder")."""

from __future__ import annotations

import re

from aiohttp import web

from ...kvsp.errors import RecordError
from ...kvsp.records import LeaseRenewal, LeaseRequest
from ...storage import RecordKey, StoreFull
from ..common.config import HolderConfig
from ..common.errors import NotFound
from ..common.media import BLOCK_MEDIA_TYPE, repr_digest
from ..http.server import BLOCK_PATH, HttpProblem, authenticate, read_block_body, read_record, record_response
from .leases import IdempotencyKeyReused
from .service import BlockRead, HolderService

__all__ = ["LEASE_SEGMENT", "HolderRoutes", "parse_codec", "parse_idempotency_key", "parse_layers", "record_key"]

#: A lease identifier in a path (records/lease.py LEASE_ID).
LEASE_SEGMENT = "{lease:[A-Za-z0-9._~-]{1,128}}"
#: ``Idempotency-Key`` (draft-ietf-httpapi-idempotency-key-header §2.1): an sf-string (quoted,
#: printable ASCII without escapes here), or, leniently, the same characters bare.
_IDEMPOTENCY_KEY = re.compile(r'"([\x20\x21\x23-\x5b\x5d-\x7e]{1,255})"|([A-Za-z0-9._~:+/=-]{1,255})')
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


def parse_idempotency_key(value: str | None) -> str | None:
    """The ``Idempotency-Key`` of a lease request (docs/http-api.md "POST {h}leases"); 400
    unless an sf-string of 1 to 255 printable ASCII characters."""
    if value is None:
        return None
    match = _IDEMPOTENCY_KEY.fullmatch(value.strip())
    if match is None:
        raise HttpProblem(400, "Idempotency-Key must be a quoted string of 1 to 255 printable ASCII characters")
    return match.group(1) or match.group(2)


def parse_codec(value: str | None) -> int | None:
    """``codec=n`` (§6.7), a decimal KVSP codec value (0..65535); ``RecordError`` otherwise."""
    if value is None:
        return None
    if not (value.isascii() and value.isdigit() and len(value) <= 5) or int(value) > 0xFFFF:
        raise RecordError("codec", f"must be a decimal codec value 0..65535, got {value[:40]!r}")
    return int(value)


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
            web.get(f"{base}leases/{LEASE_SEGMENT}", self.get_lease),
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
        if read.transcode_to is not None:
            return await self._transcoded(request, read)
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
        if request.method != "HEAD":
            self.service.metrics.served(read.reader, read.full)
        return response

    async def _transcoded(self, request: web.Request, read: BlockRead) -> web.StreamResponse:
        """§6.7 GET with ``codec=n`` other than the replica's: the transcoded container
        (``holder/transcode.py``), protected by its own Repr-Digest, the only protection a
        transcoded representation has (§6.7)."""
        coded = await self.service.transcoded(read)
        response = web.StreamResponse(
            status=200,
            headers={
                "Repr-Digest": repr_digest(coded.sha256),
                "Cache-Control": f"private, immutable, max-age={read.max_age_s}",
            },
        )
        response.content_type = BLOCK_MEDIA_TYPE
        response.content_length = len(coded.body)
        await response.prepare(request)
        if request.method != "HEAD":
            view, step = memoryview(coded.body), self.config.chunk_octets
            for offset in range(0, len(view), step):
                await response.write(view[offset:offset + step])
        await response.write_eof()
        if request.method != "HEAD":
            self.service.metrics.served(read.reader, read.full)
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
        """§6.6 POST leases: 201 with a LeaseGrant and Location ``leases/{id}``. With an
        ``Idempotency-Key``, a repeat of the request answers the lease its earlier try created
        (``holder/leases.py``); the key reused for another request is 422."""
        principal = authenticate(request)
        key = parse_idempotency_key(request.headers.get("Idempotency-Key"))
        lease_request = await read_record(request, LeaseRequest, self.config.max_body_octets)
        try:
            grant = await self.service.grant_lease(principal, lease_request, idempotency_key=key)
        except IdempotencyKeyReused as exc:
            raise HttpProblem(422, str(exc)) from None
        return record_response(grant, status=201, headers={"Location": f"{self.base}leases/{grant.lease}"})

    async def get_lease(self, request: web.Request) -> web.Response:
        """The lease's remaining TTL (ours: §6.6 defines no GET): 200 with a LeaseGrant; 404
        when unknown, expired or another principal's."""
        principal = authenticate(request)
        lease_id = request.match_info["lease"]
        lease = await self.service.leases.get(principal, lease_id)
        if lease is None:
            raise NotFound(f"no live lease {lease_id!r}")
        return record_response(lease.grant(self.service.leases.clock.now_ms()))

    async def put_lease(self, request: web.Request) -> web.Response:
        """§6.6 renewal: 200 with the new LeaseGrant."""
        principal = authenticate(request)
        renewal = await read_record(request, LeaseRenewal, self.config.max_body_octets)
        grant = await self.service.leases.renew(principal, request.match_info["lease"], renewal.ttl_ms)
        self.service.metrics.lease_renewals.inc()
        return record_response(grant)

    async def delete_lease(self, request: web.Request) -> web.Response:
        """§6.6 release: 204, also for the principal's lease released already (a repeat)."""
        principal = authenticate(request)
        await self.service.leases.release(principal, request.match_info["lease"])
        self.service.metrics.lease_releases.inc()
        return web.Response(status=204)
