"""HTTP routes of the Index Service (kvsp-draft §6.1, §6.2; docs/http-api.md "Index Service")."""

from __future__ import annotations

import json
from urllib.parse import quote

from aiohttp import web

from ...kvsp.errors import RecordError
from ...kvsp.records import InstanceStatusRecord, LookupRequest, ReplicaRecord
from ...kvsp.records.lookup_wire import COMPACT_LOOKUP_MEDIA_TYPE, decode_compact_request, encode_compact_answer
from ...kvsp.records.replica_json import read_replica
from ..common.media import KVSP_JSON
from ..http.server import (
    BLOCK_PATH,
    HEX32_SEGMENT,
    ServiceRoutes,
    authenticate,
    read_body,
    read_json_object,
    read_record,
    record_response,
)
from .service import IndexService
from .store import BlockRef, ReplicaId

__all__ = ["IndexRoutes", "block_ref", "wants_compact"]


def wants_compact(accept: str) -> bool:
    """Whether an ``Accept`` field value (RFC 9110 §12.5.1) asks for the compact lookup answer
    (docs/http-api.md): its media type is listed with a q above 0. Anything else, an absent
    field included, gets the §6.2 JSON answer."""
    for element in accept.split(","):
        media_type, *params = element.split(";")
        if media_type.strip().lower() != COMPACT_LOOKUP_MEDIA_TYPE:
            continue
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    return float(value.strip()) > 0
                except ValueError:
                    return False
        return True
    return False


#: The lookup's answer depends on ``Accept`` (RFC 9110 §12.5.5).
_VARY_ACCEPT = {"Vary": "Accept"}
#: The media type of a compact lookup request body.
_COMPACT_BODY = frozenset({COMPACT_LOOKUP_MEDIA_TYPE})


def _batch_record(index: int, item: object) -> ReplicaRecord:
    """The ``index``-th record of a batch; a RecordError names it (``records[3].holder``).
    ``read_replica`` reads the records it can vouch for in one pass (~5x sooner); any other
    goes through ``from_json``, which accepts it or names its fault, as before."""
    record = read_replica(item)
    if record is not None:
        return record
    try:
        return ReplicaRecord.from_json(item)
    except RecordError as exc:
        where = f"records[{index}]" if exc.member in ("$", "") else f"records[{index}].{exc.member}"
        raise RecordError(where, str(exc).removeprefix(f"{exc.member}: ")) from None


def block_ref(request: web.Request) -> BlockRef:
    """The block named by the ``{compat}/{scope}/{key}`` segments (already matched as hex)."""
    info = request.match_info
    return BlockRef(bytes.fromhex(info["compat"]), bytes.fromhex(info["scope"]), bytes.fromhex(info["key"]))


class IndexRoutes(ServiceRoutes[IndexService]):
    """Routes of the Index Service under ``service.config.base_path`` (docs/http-api.md)."""

    def routes(self) -> list[web.RouteDef]:
        base = self.base
        return [
            web.put(f"{base}replicas/{BLOCK_PATH}", self.put_replica),
            web.delete(f"{base}replicas/{BLOCK_PATH}", self.delete_replica),
            web.get(f"{base}replicas/{BLOCK_PATH}", self.get_replicas, allow_head=False),
            web.post(f"{base}replicas:batch", self.put_replicas),
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

    async def put_replicas(self, request: web.Request) -> web.Response:
        """Ours: ``POST {is}replicas:batch`` with ``{"records": [Replica Record, ...]}``, a
        holder's batched §6.1 refresh; each record authorized as the single PUT, all before
        any is stored. 200 with ``{"results": [{"created": bool, "ttl_ms": granted}, ...]}``
        in the order of the records."""
        principal = authenticate(request)
        body = await read_json_object(request, self.max_body)
        items = body.get("records")
        if not isinstance(items, list):
            raise RecordError("records", "must be an array of Replica Records")
        limit = self.service.config.max_batch_records
        if len(items) > limit:
            raise RecordError("records", f"{len(items)} records exceed the limit of {limit}")
        records = [_batch_record(i, item) for i, item in enumerate(items)]
        published = await self.service.publish_many(principal, records)
        results = [{"created": p.created, "ttl_ms": p.record.ttl_ms} for p in published]
        return web.Response(body=json.dumps({"results": results}, separators=(",", ":")).encode(),
                            content_type=KVSP_JSON)

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
        """§6.2 ``POST {is-base}lookup``: the request as ``application/kvsp+json`` or in the
        compact form (``kvsp/records/lookup_wire.py``); the answer as ``application/kvsp+json``
        (the shape of docs/http-api.md), or compact when the client's ``Accept`` asks for it."""
        principal = authenticate(request)
        max_keys = self.service.config.max_block_keys
        if request.content_type == COMPACT_LOOKUP_MEDIA_TYPE:
            body = await read_body(request, self.max_body, _COMPACT_BODY)
            lookup = decode_compact_request(body, max_block_keys=max_keys)
        else:
            lookup = LookupRequest.from_json(await read_json_object(request, self.max_body), max_block_keys=max_keys)
        if not wants_compact(request.headers.get("Accept", "")):
            return record_response(await self.service.lookup(principal, lookup), headers=_VARY_ACCEPT)
        found = await self.service.lookup_stored(principal, lookup)
        answer = encode_compact_answer(lookup.compat_id, lookup.scope_id, lookup.block_keys, found.stored, found.targets)
        return web.Response(body=answer, content_type=COMPACT_LOOKUP_MEDIA_TYPE, headers=_VARY_ACCEPT)

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
