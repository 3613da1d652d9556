"""The lookup answer's two forms (kvsp-draft §6.2; docs/http-api.md "Compact lookup answer"):
the default ``application/kvsp+json`` answer and the compact MessagePack one a client asks for
by ``Accept`` (kvsp/records/lookup_wire.py). A real Index Service and real aiohttp servers on
127.0.0.1 port 0, the control plane's own client, a manual clock for every TTL. No mocks."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from kvsp_moq.control.client.http import HttpIndexClient
from kvsp_moq.control.client.publisher import IndexUnreachable
from kvsp_moq.control.common.config import IndexConfig
from kvsp_moq.control.common.media import KVSP_JSON
from kvsp_moq.control.index.routes import wants_compact
from kvsp_moq.kvsp.errors import RecordError
from kvsp_moq.kvsp.records import LookupRequest, LookupResponse, MatchedBlock, dump_json
from kvsp_moq.kvsp.records.lookup_wire import (
    COMPACT_LOOKUP_MEDIA_TYPE as COMPACT,
    decode_compact_answer,
    decode_compact_request,
    encode_compact_request,
    json_lookup_request,
)
from test_index_support import (
    DESCRIPTOR,
    H1,
    H2,
    II7,
    II9,
    RELAY,
    SCOPE_A,
    SCOPE_B,
    COMPAT,
    TOKENS,
    Ix,
    key,
    lookup_body,
    replica,
    running_index,
    status,
)

KEYS = [key(0), key(1), key(2), key(3)]  # key(3) has no replica: the match stops there


def request_of(keys: list[bytes], targets: tuple[str, ...] | None = None) -> LookupRequest:
    return LookupRequest(scope_id=SCOPE_A, compat_id=COMPAT, block_keys=tuple(keys), targets=targets)


@pytest.fixture
async def ix() -> AsyncIterator[Ix]:
    """An IS holding three matched blocks of every kind of record: two tiers with a read rate,
    a MOQT replica, two holders of one block, a record without layer digests."""
    async with running_index(IndexConfig(descriptors=(DESCRIPTOR,), purge_interval_ms=0)) as ix:
        puts = [
            (replica(key(0), residency=[("device", 0, 1, None), ("host", 2, 3, 400.0)]), "holder1"),
            (replica(key(0), holder=RELAY), "delegate"),
            (replica(key(1)), "holder1"),
            (replica(key(1), holder=H2, ttl_ms=30_000), "holder2"),
            (replica(key(2), layers=None), "holder1"),
        ]
        for record, who in puts:
            assert (await ix.put(record, who=who)).status == 201
        reply = await ix.request("PUT", "instance-status", who="pc", body=status(II7, {H1: (1000, 50), H2: (800, 70)}))
        assert reply.status == 200
        yield ix


async def post_lookup(ix: Ix, accept: str | None, targets: list[str] | None = None) -> Any:
    headers = {"Accept": accept} if accept is not None else {}
    return await ix.request("POST", "lookup", body=lookup_body(KEYS, targets=targets), headers=headers)


async def test_the_default_answer_is_the_drafts_json(ix: Ix) -> None:
    for accept in (None, KVSP_JSON, "*/*", f"{COMPACT};q=0", f"{KVSP_JSON}, {COMPACT};q=0.0"):
        reply = await post_lookup(ix, accept, targets=[II7])
        assert reply.status == 200 and reply.content_type == KVSP_JSON, accept
        assert reply.headers["Vary"] == "Accept"
        answer = reply.json
        assert answer["matched"] == 3 and len(answer["blocks"]) == 3
        for block, block_key in zip(answer["blocks"], KEYS):
            assert block["block_key"] == block_key.hex()
            for record in block["replicas"]:  # whole §4.4 records: nothing left out
                assert {"block_key", "compat_id", "scope_id", "holder", "codec", "size", "digest",
                        "residency", "ttl_ms"} <= record.keys()
                assert (record["compat_id"], record["scope_id"]) == (COMPAT.hex(), SCOPE_A.hex())
        assert [t["instance"] for t in answer["targets"]] == [II7]


async def test_the_compact_answer_carries_the_same_records(ix: Ix) -> None:
    targets = (II7, II9)
    as_json = await post_lookup(ix, None, targets=list(targets))
    compact = await post_lookup(ix, f"{COMPACT}, {KVSP_JSON};q=0.5", targets=list(targets))
    assert compact.status == 200 and compact.content_type == COMPACT and compact.headers["Vary"] == "Accept"
    expected = LookupResponse.from_json(as_json.json)
    assert expected.matched == 3 and expected.targets is not None and len(expected.targets) == 1
    assert decode_compact_answer(compact.body, request_of(KEYS, targets)) == expected
    assert len(compact.body) < len(as_json.body) / 2

    client = HttpIndexClient(ix.url, TOKENS["holder1"])
    try:
        assert await client.lookup(request_of(KEYS, targets)) == expected
        ix.clock.advance(20_000)  # every ttl_ms is the remaining lifetime, in both forms
        later = LookupResponse.from_json((await post_lookup(ix, None)).json)
        assert [r.ttl_ms for b in later.blocks for r in b.replicas] == [40_000, 40_000, 40_000, 10_000, 40_000]
        assert await client.lookup(request_of(KEYS)) == later
        ix.clock.advance(10_000)  # h2's record of block 1 expires: one replica left there
        assert [len(b.replicas) for b in (await client.lookup(request_of(KEYS))).blocks] == [2, 1, 1]
        assert (await client.lookup(request_of([key(9)]))) == LookupResponse(matched=0, blocks=())
    finally:
        await client.close()


async def test_the_compact_request_asks_the_same(ix: Ix) -> None:
    """``HttpIndexClient.lookup`` sends the request compact; the IS answers it as the JSON one."""
    targets = (II7,)
    expected = LookupResponse.from_json((await post_lookup(ix, None, targets=list(targets))).json)
    body = encode_compact_request(request_of(KEYS, targets))
    assert len(body) < len(json_lookup_request(request_of(KEYS, targets)))
    for accept, decode in ((None, lambda b: LookupResponse.from_json(json.loads(b))),
                           (COMPACT, lambda b: decode_compact_answer(b, request_of(KEYS, targets)))):
        reply = await ix.request("POST", "lookup", body=body, content_type=COMPACT,
                                 headers={"Accept": accept} if accept else {})
        assert reply.status == 200 and decode(reply.body) == expected


async def test_a_broken_compact_request_is_a_400_naming_the_member(ix: Ix) -> None:
    good = {"scope_id": SCOPE_A, "compat_id": COMPAT, "block_keys": [key(0)]}
    cases = {
        "$": b"\xc1",
        "block_keys[1]": msgspec.msgpack.encode(good | {"block_keys": [key(0), b"short"]}),
        "block_keys": msgspec.msgpack.encode(good | {"block_keys": []}),
        "scope_id": msgspec.msgpack.encode(good | {"scope_id": COMPAT}),
        "compat_id": msgspec.msgpack.encode({"scope_id": SCOPE_A, "block_keys": [key(0)]}),
        "targets[0]": msgspec.msgpack.encode(good | {"targets": ["ftp://ii7.example/"]}),
    }
    for member, body in cases.items():
        reply = await ix.request("POST", "lookup", body=body, content_type=COMPACT, headers={"Accept": COMPACT})
        assert (reply.status, reply.problem, reply.json["member"]) == (400, "kvsp-bad-record", member), reply.json
    with pytest.raises(RecordError, match="block_keys: at most 2 keys per lookup, got 3"):
        decode_compact_request(msgspec.msgpack.encode(good | {"block_keys": KEYS[:3]}), max_block_keys=2)


async def test_a_record_keeps_its_compact_encoding() -> None:
    record = replica(key(0))
    assert record.compact_encoding is record.compact_encoding  # encoded once, spliced after
    changed = dataclasses.replace(record, holder=H2)
    assert changed.compact_encoding != record.compact_encoding
    assert msgspec.msgpack.decode(changed.compact_encoding)[0] == H2


def test_accept_negotiation() -> None:
    assert wants_compact(COMPACT) and wants_compact(f"{KVSP_JSON};q=0.5, {COMPACT}")
    assert wants_compact(f" {COMPACT.upper()} ; q=0.2") and wants_compact(f"{COMPACT};level=1")
    for accept in ("", KVSP_JSON, "*/*", "application/*", f"{COMPACT};q=0", f"{COMPACT};q=zero",
                   f"{COMPACT}x", "application/msgpack"):
        assert not wants_compact(accept), accept


def test_the_clients_request_body_is_dump_json() -> None:
    for targets in (None, (II7,), (II7, "https://ii.example/kvsp/?q=\"a\\\\b\"")):
        request = request_of(KEYS, targets)
        assert json.loads(json_lookup_request(request)) == json.loads(dump_json(request))
        assert LookupRequest.from_json(json.loads(json_lookup_request(request))) == request


# ---------------------------------------------------------------------------------------------
# Hostile or broken answers: a real HTTP server that answers each lookup with a crafted body


def good_answer() -> dict[str, Any]:
    """A valid compact answer to ``request_of([key(0)])``, as MessagePack-ready values."""
    record = replica(key(0))
    assert record.layer_digests is not None
    wire = [record.holder, 1, record.size, record.digest, b"".join(record.layer_digests), [["device", 0, 3, None]], None]
    return {"matched": 1, "compat_id": COMPAT, "scope_id": SCOPE_A, "blocks": [[key(0), [[60_000, wire]]]]}


def with_record(change: Callable[[list[Any]], None]) -> bytes:
    answer = good_answer()
    change(answer["blocks"][0][1][0][1])
    return msgspec.msgpack.encode(answer)


def with_answer(change: Callable[[dict[str, Any]], None]) -> bytes:
    answer = good_answer()
    change(answer)
    return msgspec.msgpack.encode(answer)


def huge_array_header() -> bytes:
    body = with_answer(lambda a: a.__setitem__("blocks", []))
    assert body.endswith(b"\x90")  # "blocks" is the last member: an empty array
    return body[:-1] + b"\xdd\xff\xff\xff\xff"  # now an array declaring 2^32 - 1 blocks


LIMIT = 64 * 1024

#: name -> (body, content type, expected words of the error)
HOSTILE: dict[str, tuple[bytes, str, str]] = {
    "not MessagePack": (b"\xc1\xc1\xc1", COMPACT, "not MessagePack"),
    "truncated": (msgspec.msgpack.encode(good_answer())[:-7], COMPACT, "truncated"),
    "not a map": (msgspec.msgpack.encode("answer"), COMPACT, "Expected `object`"),
    "2^32 blocks declared": (huge_array_header(), COMPACT, "not MessagePack"),
    "digest of 31 octets": (with_record(lambda r: r.__setitem__(3, b"\0" * 31)), COMPACT, "blocks[0].replicas[0].digest: Expected `bytes` of length >= 32"),
    "layer digests cut": (with_record(lambda r: r.__setitem__(4, r[4][:-1])), COMPACT, "layer_digests"),
    "residency beyond the layers": (with_record(lambda r: r.__setitem__(5, [["device", 0, 9, None]])), COMPACT, "beyond the 4 layers"),
    "overlapping residency": (with_record(lambda r: r.__setitem__(5, [["device", 0, 2, None], ["host", 2, 3, None]])), COMPACT, "residency[1].layers"),
    "no residency": (with_record(lambda r: r.__setitem__(5, [])), COMPACT, "replicas[0].residency"),
    "bad tier": (with_record(lambda r: r.__setitem__(5, [["Device!", 0, 3, None]])), COMPACT, "residency[0].tier"),
    "holder not a URL": (with_record(lambda r: r.__setitem__(0, "ftp://h1.example/")), COMPACT, "replicas[0].holder"),
    "holder too long": (with_record(lambda r: r.__setitem__(0, "https://h/" + "a" * 5000)), COMPACT, "holder"),
    "moqt holder without namespace": (with_record(lambda r: r.__setitem__(0, RELAY)), COMPACT, "moqt_namespace"),
    "namespace of an HTTP replica": (with_record(lambda r: r.__setitem__(6, "AAAA")), COMPACT, "moqt_namespace"),
    "codec out of range": (with_record(lambda r: r.__setitem__(1, 70_000)), COMPACT, "replicas[0].codec"),
    "negative size": (with_record(lambda r: r.__setitem__(2, -1)), COMPACT, "replicas[0].size"),
    "ttl 0": (with_answer(lambda a: a["blocks"][0][1][0].__setitem__(0, 0)), COMPACT, "blocks[0].replicas[0].ttl_ms"),
    "no replicas": (with_answer(lambda a: a["blocks"][0].__setitem__(1, [])), COMPACT, "blocks[0].replicas"),
    "matched is not the block count": (with_answer(lambda a: a.__setitem__("matched", 2)), COMPACT, "matched = 2"),
    "more blocks than keys": (with_answer(lambda a: (a.__setitem__("matched", 2), a["blocks"].append(a["blocks"][0]))),
                              COMPACT, "exceeds the 1 keys"),
    "another key": (with_answer(lambda a: a["blocks"][0].__setitem__(0, key(1))), COMPACT, "blocks[0].block_key"),
    "another scope": (with_answer(lambda a: a.__setitem__("scope_id", SCOPE_B)), COMPACT, "scope_id"),
    "NaN estimate": (with_answer(lambda a: a.__setitem__("targets", [[II7, math.nan, 1.0]])), COMPACT, "targets[0].fetch_us"),
    "infinite estimate": (with_answer(lambda a: a.__setitem__("targets", [[II7, 1.0, math.inf]])), COMPACT, "targets[0].recompute_us"),
    "target not a URL": (with_answer(lambda a: a.__setitem__("targets", [["ii7", 1.0, 1.0]])), COMPACT, "targets[0].instance"),
    "another media type": (b"<html></html>", "text/html", "media type 'text/html'"),
    "JSON for other keys": (dump_json(LookupResponse(matched=1, blocks=(MatchedBlock(block_key=key(1), replicas=(replica(key(1)),)),))),
                            KVSP_JSON, "leading keys"),
    "JSON that is not an answer": (b'{"matched": "one"}', KVSP_JSON, "matched"),
    "over the limit": (b"\x80" * (LIMIT + 1), COMPACT, "exceeds the limit"),
}


@asynccontextmanager
async def scripted_index(answers: dict[str, tuple[bytes, str, str]], seen: list[str] | None = None) -> AsyncIterator[str]:
    """An HTTP server whose ``lookup`` answers with ``answers[X-Case]``; ``chunked: ...``
    cases are sent without Content-Length, in chunks; ``json only: ...`` cases answer a
    request that is not JSON with 415. ``seen`` gets each request's media type."""
    seen = seen if seen is not None else []

    async def lookup(request: web.Request) -> web.StreamResponse:
        case = request.headers["X-Case"]
        seen.append(request.content_type)
        if case.startswith("json only: "):  # an IS without the compact request
            if request.content_type != KVSP_JSON:
                return web.Response(status=415)
            case = case.removeprefix("json only: ")
        body, content_type, _ = answers[case.removeprefix("chunked: ")]
        if not case.startswith("chunked: "):
            return web.Response(body=body, content_type=content_type)
        response = web.StreamResponse(headers={"Content-Type": content_type})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for start in range(0, len(body), 8192):
            await response.write(body[start:start + 8192])
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/lookup", lookup)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}/"
    finally:
        await runner.cleanup()


async def lookup_at(url: str, case: str) -> LookupResponse:
    """``HttpIndexClient.lookup`` of ``key(0)`` at the scripted IS, which answers ``case``."""
    async with aiohttp.ClientSession(headers={"X-Case": case}) as session:
        client = HttpIndexClient(url, None, session=session, max_answer_octets=LIMIT)
        return await client.lookup(request_of([key(0)]))


async def test_a_broken_answer_is_refused_with_the_member_at_fault() -> None:
    async with scripted_index(HOSTILE) as url:
        for case in [*HOSTILE, "chunked: over the limit", "chunked: another scope"]:
            with pytest.raises(IndexUnreachable) as raised:
                await lookup_at(url, case)
            assert HOSTILE[case.removeprefix("chunked: ")][2] in str(raised.value), (case, str(raised.value))


async def test_the_good_answer_of_the_scripted_index_is_read() -> None:
    """The cases above fail for their fault only: the unchanged answer, sent whole or chunked,
    and a JSON answer from an IS without the compact form, are read."""
    expected = LookupResponse(matched=1, blocks=(MatchedBlock(block_key=key(0), replicas=(replica(key(0)),)),))
    answers = {"good": (msgspec.msgpack.encode(good_answer()), COMPACT, ""),
               "json": (dump_json(expected), KVSP_JSON, "")}
    async with scripted_index(answers) as url:
        for case in ("good", "chunked: good", "json", "chunked: json"):
            assert await lookup_at(url, case) == expected, case


async def test_an_is_that_refuses_the_compact_request_is_asked_in_json() -> None:
    expected = LookupResponse(matched=1, blocks=(MatchedBlock(block_key=key(0), replicas=(replica(key(0)),)),))
    seen: list[str] = []
    async with scripted_index({"json": (dump_json(expected), KVSP_JSON, "")}, seen) as url:
        async with aiohttp.ClientSession(headers={"X-Case": "json only: json"}) as session:
            client = HttpIndexClient(url, None, session=session)
            assert await client.lookup(request_of([key(0)])) == expected
            assert await client.lookup(request_of([key(0)])) == expected
    assert seen == [COMPACT, KVSP_JSON, KVSP_JSON]  # refused once, then JSON only


# ---------------------------------------------------------------------------------------------
# The decoder alone: any octets give an answer or a RecordError, never another exception


@given(st.binary(max_size=512))
def test_any_octets_decode_to_an_answer_or_a_record_error(data: bytes) -> None:
    try:
        decode_compact_answer(data, request_of([key(0)]))
    except RecordError:
        pass


@given(st.binary(max_size=512))
def test_any_octets_decode_to_a_request_or_a_record_error(data: bytes) -> None:
    try:
        request = decode_compact_request(data, max_block_keys=4)
    except RecordError:
        return
    assert 1 <= len(request.block_keys) <= 4


@given(st.integers(0, 10_000), st.integers(0, 255))
def test_a_changed_octet_gives_an_answer_or_a_record_error(position: int, value: int) -> None:
    body = bytearray(msgspec.msgpack.encode(good_answer()))
    body[position % len(body)] = value
    try:
        answer = decode_compact_answer(bytes(body), request_of([key(0)]))
    except RecordError:
        return
    assert answer.answers(request_of([key(0)]))
