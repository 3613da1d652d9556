"""Holder block retrieval and storage over HTTP (kvsp-draft §6.7; docs/http-api.md "Holder"):
a real holder and a real IS on 127.0.0.1, a real aiohttp client, a manual clock."""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import AsyncIterator

import pytest

from kvsp_moq.control.common.config import TierConfig
from kvsp_moq.kvsp.container import encode_container, extract_layers
from kvsp_moq.kvsp.records import ReplicaRecord
from test_holder_support import (
    CONTAINER_SIZE,
    COMPAT,
    H,
    LAYERS,
    SCOPE_A,
    SCOPE_B,
    bkey,
    block_path,
    container,
    rkey,
    running_holder,
)


@pytest.fixture
async def h() -> AsyncIterator[H]:
    async with running_holder(max_block_octets=4096) as h:
        yield h


def digest_field(data: bytes) -> str:
    return f"sha-256=:{base64.b64encode(hashlib.sha256(data).digest()).decode()}:"


def max_age(reply_headers: object) -> int:
    value = reply_headers["Cache-Control"]  # type: ignore[index]
    parts = [p.strip() for p in value.split(",")]
    assert "private" in parts and "immutable" in parts, value
    (age,) = [int(p.removeprefix("max-age=")) for p in parts if p.startswith("max-age=")]
    return age


# ---------------------------------------------------------------------------------------------
# PUT (§6.7)


async def test_put_stores_and_answers_201_with_location_and_record(h: H) -> None:
    reply = await h.put_block(0)
    assert reply.status == 201, reply.body
    assert reply.headers["Location"] == f"/{block_path(0)}"
    record = ReplicaRecord.from_json(reply.json)
    assert (record.block_key, record.scope_id, record.compat_id) == (bkey(0), SCOPE_A, COMPAT)
    assert record.holder == h.url and record.size == CONTAINER_SIZE and record.codec == 1
    assert record.layer_digests is not None and len(record.layer_digests) == LAYERS
    assert rkey(0) in h.service.store


async def test_put_on_a_held_block_is_412_and_keeps_the_copy(h: H) -> None:
    assert (await h.put_block(0)).status == 201
    other = container(99)  # other octets for the same key (§6.7: the key names the prefix)
    reply = await h.put_block(0, other)
    assert (reply.status, reply.problem) == (412, "kvsp-precondition-failed")
    got = await h.get_block(0)
    assert got.status == 200 and got.body == container(0)


async def test_put_requires_if_none_match_star(h: H) -> None:
    for headers in ({}, {"If-None-Match": '"abc"'}):
        reply = await h.put_block(0, headers=headers)
        assert reply.status == 428 and reply.content_type == "application/problem+json"
    assert rkey(0) not in h.service.store


async def test_put_requires_the_scope(h: H) -> None:
    reply = await h.put_block(0, who="client-b")  # client-b has scope B only
    assert (reply.status, reply.problem) == (403, "kvsp-forbidden")
    assert rkey(0) not in h.service.store
    reply = await h.put_block(0, who=None)  # type: ignore[arg-type]
    assert (reply.status, reply.problem) == (401, "kvsp-unauthorized")


async def test_put_media_type_size_and_container_checks(h: H) -> None:
    reply = await h.put_block(0, content_type="application/octet-stream")
    assert reply.status == 415
    reply = await h.put_block(0, b"\0" * 5000)  # max_block_octets = 4096
    assert reply.status == 413

    async def chunked() -> AsyncIterator[bytes]:
        for _ in range(5):
            yield b"\0" * 1000

    reply = await h.put_block(0, chunked())  # type: ignore[arg-type]
    assert reply.status == 413
    bad = bytearray(container(0))
    bad[0:4] = b"XXXX"
    reply = await h.put_block(0, bytes(bad))
    assert (reply.status, reply.problem, reply.json["member"]) == (400, "kvsp-bad-record", "container.magic")
    reply = await h.put_block(0, container(0)[:-1])
    assert (reply.status, reply.json["member"]) == (400, "container.truncated")
    reply = await h.put_block(0, container(0) + b"\0")
    assert (reply.status, reply.json["member"]) == (400, "container.trailing")
    assert rkey(0) not in h.service.store


async def test_put_accepts_a_chunked_body(h: H) -> None:
    data = container(3)

    async def chunked() -> AsyncIterator[bytes]:
        for i in range(0, len(data), 50):
            yield data[i : i + 50]

    reply = await h.put_block(3, chunked())  # type: ignore[arg-type]
    assert reply.status == 201, reply.body
    assert (await h.get_block(3)).body == data


# ---------------------------------------------------------------------------------------------
# GET (§6.7)


async def test_get_full_container_with_repr_digest_and_cache_control(h: H) -> None:
    await h.put_block(0)
    reply = await h.get_block(0)
    assert reply.status == 200
    assert reply.content_type == "application/kvsp-block"
    assert reply.body == container(0)
    assert int(reply.headers["Content-Length"]) == CONTAINER_SIZE
    assert reply.headers["Repr-Digest"] == digest_field(container(0))
    (record,) = await h.index_replicas(0)
    assert max_age(reply.headers) <= record.ttl_ms // 1000  # no longer than the remaining TTL
    assert max_age(reply.headers) == 60

    h.clock.advance(25_500)  # the record has 34.5 s left
    reply = await h.get_block(0)
    assert max_age(reply.headers) == 34
    (record,) = await h.index_replicas(0)
    assert max_age(reply.headers) * 1000 <= record.ttl_ms


async def test_get_layer_range_has_its_own_repr_digest(h: H) -> None:
    await h.put_block(0)
    for first, last in ((0, 0), (1, 2), (3, 3), (0, 3)):
        reply = await h.get_block(0, params={"layers": f"{first}-{last}"})
        expected = extract_layers(container(0), first, last)
        assert reply.status == 200 and reply.body == expected
        assert reply.headers["Repr-Digest"] == digest_field(expected)
        assert int(reply.headers["Content-Length"]) == len(expected)
        assert max_age(reply.headers) <= 60


async def test_head_gives_the_fields_without_the_body(h: H) -> None:
    await h.put_block(0)
    reply = await h.request("HEAD", block_path(0))
    assert reply.status == 200 and reply.body == b""
    assert reply.headers["Repr-Digest"] == digest_field(container(0))
    assert int(reply.headers["Content-Length"]) == CONTAINER_SIZE


async def test_get_404_kinds(h: H) -> None:
    reply = await h.get_block(0)
    assert (reply.status, reply.problem) == (404, "kvsp-not-found")
    await h.put_block(0)
    for layers in ("0-4", "4-4", "2-9"):
        reply = await h.get_block(0, params={"layers": layers})
        assert (reply.status, reply.problem) == (404, "kvsp-layers-unavailable"), layers
    reply = await h.get_block(0, params={"codec": "2"})  # the holder does not transcode
    assert (reply.status, reply.problem) == (404, "kvsp-layers-unavailable")
    assert (await h.get_block(0, params={"codec": "1"})).body == container(0)


async def test_get_partial_replica_reports_layers_unavailable(h: H) -> None:
    h.service.store.put(rkey(5), container(5, layers=2, first=2))  # layers 2-3 only
    assert (await h.get_block(5, params={"layers": "2-3"})).status == 200
    reply = await h.get_block(5, params={"layers": "1-3"})
    assert (reply.status, reply.problem) == (404, "kvsp-layers-unavailable")
    assert "held: 2-3" in reply.json["detail"]


@pytest.mark.parametrize("value", ["2-1", "a-b", "1", "-1-2", "1-", "1-2-3", "0-4294967296", "１-２", " 1-2"])
async def test_malformed_layers_is_400(h: H, value: str) -> None:
    await h.put_block(0)
    reply = await h.get_block(0, params={"layers": value})
    assert (reply.status, reply.problem, reply.json["member"]) == (400, "kvsp-bad-record", "layers")


@pytest.mark.parametrize("value", ["raw", "-1", "65536", ""])
async def test_malformed_codec_is_400(h: H, value: str) -> None:
    await h.put_block(0)
    reply = await h.get_block(0, params={"codec": value})
    assert (reply.status, reply.json["member"]) == (400, "codec")


async def test_get_requires_the_scope_whether_held_or_not(h: H) -> None:
    await h.put_block(0)
    for i in (0, 1):
        reply = await h.get_block(i, who="client-b")
        assert (reply.status, reply.problem) == (403, "kvsp-forbidden")
    # A scope-B principal on a scope-B block the holder lacks: a plain miss.
    reply = await h.get_block(0, who="client-b", scope=SCOPE_B)
    assert (reply.status, reply.problem) == (404, "kvsp-not-found")


async def test_malformed_path_segments_match_no_route(h: H) -> None:
    reply = await h.request("GET", "blocks/" + "AB" * 32 + f"/{SCOPE_A.hex()}/{bkey(0).hex()}")
    assert (reply.status, reply.problem) == (404, "kvsp-not-found")
    reply = await h.request("POST", block_path(0))
    assert reply.status == 405 and "GET" in reply.headers["Allow"]


async def test_large_block_is_streamed_in_chunks() -> None:
    """A block larger than one write (chunk_octets) arrives whole and verified; a block that
    does not fit the store is 507."""
    big = encode_container(1, 0, 2, [(bytes([i]) * 300_000, bytes([i + 1]) * 300_000) for i in range(2)])
    async with running_holder(max_block_octets=2 << 20, tiers=(TierConfig("host", 1 << 20),)) as h2:
        reply = await h2.put_block(7, big)
        assert reply.status == 507 and rkey(7) not in h2.service.store
    async with running_holder(max_block_octets=2 << 20, tiers=(TierConfig("host", 2 << 20),)) as h2:
        assert (await h2.put_block(7, big)).status == 201
        reply = await h2.get_block(7)
        assert reply.body == big and reply.headers["Repr-Digest"] == digest_field(big)
        assert re.fullmatch(r"private, immutable, max-age=\d+", reply.headers["Cache-Control"])
