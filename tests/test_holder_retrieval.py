"""Client-side block retrieval (kvsp-draft §6.1, §6.7): a real holder and a real IS, plus a
holder *test double* that is a real aiohttp server misbehaving on purpose (a flipped byte,
a missing or recomputed Repr-Digest, the wrong layers). The client must reject every bad
answer, fall back to the next replica, and report what to recompute when all fail."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from kvsp_moq.control.client.http import HttpBlockFetcher
from kvsp_moq.control.client.retrieval import RetrievalFailed, parse_repr_digest, retrieve_block
from kvsp_moq.control.http.server import serve_app
from kvsp_moq.kvsp.container import DecodedLayer, extract_layers
from kvsp_moq.kvsp.records import ReplicaRecord
from test_holder_support import LAYERS, TOKENS, H, bkey, container, rkey, running_holder


def _digest(data: bytes) -> str:
    return f"sha-256=:{base64.b64encode(hashlib.sha256(data).digest()).decode()}:"


@asynccontextmanager
async def double(mode: str, data: bytes) -> AsyncIterator[str]:
    """A real HTTP server answering every block GET according to ``mode``."""

    async def handler(request: web.Request) -> web.StreamResponse:
        body = data
        if "layers" in request.query and mode != "wrong-range":
            a, b = map(int, request.query["layers"].split("-"))
            body = extract_layers(data, a, b)
        headers = {"Content-Type": "application/kvsp-block", "Repr-Digest": _digest(body)}
        if mode == "404":
            return web.json_response({"type": "urn:kvsp:problem:kvsp-not-found", "status": 404}, status=404, content_type="application/problem+json")
        if mode == "500":
            return web.Response(status=500)
        if mode in ("flip", "flip-redigest"):
            tampered = bytearray(body)
            tampered[-5] ^= 0x01  # in the last layer's V section
            body = bytes(tampered)
            if mode == "flip-redigest":
                headers["Repr-Digest"] = _digest(body)
        if mode == "no-digest":
            del headers["Repr-Digest"]
        if mode == "bad-digest-syntax":
            headers["Repr-Digest"] = "sha-256=abc"
        if mode == "wrong-type":
            headers["Content-Type"] = "application/octet-stream"
        return web.Response(body=body, headers=headers)

    app = web.Application()
    app.router.add_get("/blocks/{tail:.*}", handler)
    server = await serve_app(app, "127.0.0.1", 0)
    try:
        yield server.url
    finally:
        await server.close()


@pytest.fixture
async def h() -> AsyncIterator[H]:
    async with running_holder() as h:
        for i in range(2):
            assert (await h.put_block(i)).status == 201
        yield h


@pytest.fixture
async def fetcher() -> AsyncIterator[HttpBlockFetcher]:
    f = HttpBlockFetcher(TOKENS["client-a"])
    yield f
    await f.close()


class Sink:
    def __init__(self) -> None:
        self.layers: list[tuple[str, int]] = []
        self.discarded: list[str] = []

    def layer(self, record: ReplicaRecord, layer: DecodedLayer) -> None:
        self.layers.append((record.holder, layer.index))

    def discard(self, record: ReplicaRecord) -> None:
        self.discarded.append(record.holder)


async def test_full_block_is_verified(h: H, fetcher: HttpBlockFetcher) -> None:
    (record,) = await h.index_replicas(0)
    sink = Sink()
    got = await retrieve_block(fetcher, [record], sink=sink)
    assert got.record == record and (got.first_layer, got.last_layer) == (0, LAYERS - 1)
    assert [l.digest for l in got.layers] == list(record.layer_digests or ())
    assert got.container_sha256 == hashlib.sha256(container(0)).digest()
    assert sink.layers == [(h.url, i) for i in range(LAYERS)] and sink.discarded == []


async def test_layer_range_is_verified(h: H, fetcher: HttpBlockFetcher) -> None:
    (record,) = await h.index_replicas(0)
    got = await retrieve_block(fetcher, [record], layers=(1, 2))
    assert [l.index for l in got.layers] == [1, 2]
    assert got.container_sha256 == hashlib.sha256(extract_layers(container(0), 1, 2)).digest()


@pytest.mark.parametrize("mode", ["flip", "flip-redigest", "no-digest", "bad-digest-syntax", "wrong-type", "wrong-range", "500"])
async def test_bad_answers_are_rejected_and_the_next_replica_used(h: H, fetcher: HttpBlockFetcher, mode: str) -> None:
    (good,) = await h.index_replicas(0)
    layers = (1, 3) if mode == "wrong-range" else None
    async with double(mode, container(0)) as url:
        bad = dataclasses.replace(good, holder=url)
        sink = Sink()
        got = await retrieve_block(fetcher, [bad, good], layers=layers, sink=sink)
    assert got.record == good
    (attempt,) = got.attempts
    assert attempt.holder == url and attempt.outcome == ("error" if mode == "500" else "rejected")
    if mode == "flip":  # the layer digest catches it as the layer completes
        assert "layer 3 does not match" in attempt.detail
    if mode == "flip-redigest":  # Repr-Digest is right for the bytes; the layer digest is not
        assert "layer 3 does not match" in attempt.detail
    if mode in ("no-digest", "bad-digest-syntax"):
        assert "Repr-Digest" in attempt.detail
    # Layers from the bad source that reached the sink were discarded.
    bad_layers = [i for holder, i in sink.layers if holder == url]
    assert (sink.discarded == [url]) == bool(bad_layers)


async def test_repr_digest_mismatch_alone_is_rejected(h: H, fetcher: HttpBlockFetcher) -> None:
    """A transcoded representation (another codec) is protected by Repr-Digest only."""
    (good,) = await h.index_replicas(0)
    # The double flips a byte but keeps the original Repr-Digest; with the record's codec
    # "unknown" to the client (another codec asked), only Repr-Digest can catch it.
    async with double("flip", container(0)) as url:
        bad = dataclasses.replace(good, holder=url, codec=2, layer_digests=None, digest=hashlib.sha256(b"x").digest())
        with pytest.raises(RetrievalFailed) as failed:
            await retrieve_block(fetcher, [bad], codec=1)
    assert "Repr-Digest" in failed.value.attempts[0].detail


async def test_404_is_a_miss_then_next_replica(h: H, fetcher: HttpBlockFetcher) -> None:
    (record0,) = await h.index_replicas(0)
    assert await h.service.evict(rkey(0))  # the IS record is withdrawn; a stale copy remains
    async with double("honest", container(0)) as url:
        got = await retrieve_block(fetcher, [record0, dataclasses.replace(record0, holder=url)])
    assert got.record.holder == url
    assert [(a.holder, a.outcome) for a in got.attempts] == [(h.url, "miss")]
    assert "kvsp-not-found" in got.attempts[0].detail


async def test_all_fail_reports_the_layers_to_recompute(h: H, fetcher: HttpBlockFetcher) -> None:
    (record,) = await h.index_replicas(1)
    assert await h.service.evict(rkey(1))
    async with double("404", container(1)) as u404, double("flip", container(1)) as uflip:
        replicas = [record, dataclasses.replace(record, holder=u404), dataclasses.replace(record, holder=uflip),
                    dataclasses.replace(record, holder="moqt://relay.example/x", moqt_namespace=None)]
        with pytest.raises(RetrievalFailed) as failed:
            await retrieve_block(fetcher, [r for r in replicas if not r.holder.startswith("moqt")], layers=(0, 2))
        assert failed.value.layers == (0, 2) and failed.value.block_key == bkey(1)
        assert [a.outcome for a in failed.value.attempts] == ["miss", "miss", "rejected"]
        with pytest.raises(RetrievalFailed) as failed:
            await retrieve_block(fetcher, replicas[:2])
        assert failed.value.layers == (0, LAYERS - 1)
    with pytest.raises(RetrievalFailed) as failed:
        await retrieve_block(fetcher, [])
    assert failed.value.layers is None and failed.value.attempts == ()


async def test_replicas_that_cannot_serve_the_range_are_skipped(h: H, fetcher: HttpBlockFetcher) -> None:
    (record,) = await h.index_replicas(0)
    no_digests = dataclasses.replace(record, layer_digests=None)
    got = await retrieve_block(fetcher, [no_digests, record], layers=(2, 3))
    assert [a.outcome for a in got.attempts] == ["skipped"]
    assert "layer digests" in got.attempts[0].detail


async def test_client_without_the_scope_gets_nothing(h: H) -> None:
    (record,) = await h.index_replicas(0)
    f = HttpBlockFetcher(TOKENS["client-b"])
    try:
        with pytest.raises(RetrievalFailed) as failed:
            await retrieve_block(f, [record])
    finally:
        await f.close()
    assert failed.value.attempts[0].outcome == "error" and "403" in failed.value.attempts[0].detail


def test_parse_repr_digest() -> None:
    d = hashlib.sha256(b"x").digest()
    b64 = base64.b64encode(d).decode()
    assert parse_repr_digest(f"sha-256=:{b64}:") == d
    assert parse_repr_digest(f"sha-512=:{b64}:, sha-256=:{b64}:") == d
    for bad in (None, "", "sha-256=abc", f"sha-512=:{b64}:", "sha-256=:!!!:", "sha-256=:" + base64.b64encode(b"short").decode() + ":"):
        assert parse_repr_digest(bad) is None
