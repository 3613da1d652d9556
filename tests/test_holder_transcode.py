"""Transcoding at the holder (kvsp-draft §6.7 "codec=n ... a holder MAY transcode"): a raw block
PUT on a real holder, fetched with ``codec=n`` through the client library's verified retrieval
(Repr-Digest, RFC 9530), decoded within the codec's bound (bit-exact for the lossless one),
made once per replica, range and codec (the holder's metric), a flipped coded byte detected,
and a 404 ``kvsp-layers-unavailable`` where the holder has no descriptor for the compat."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import AsyncIterator

import numpy as np
import pytest
from aiohttp import web

from kvsp_moq.control.client.http import HttpBlockFetcher
from kvsp_moq.control.client.retrieval import RetrievalFailed, retrieve_block
from kvsp_moq.control.common.config import TierConfig
from kvsp_moq.control.http.server import serve_app
from kvsp_moq.kvsp.codecs import FP8_E4M3, ZSTD_PLANES, decode_layer, encode_block
from kvsp_moq.kvsp.compat import compat_id, make_descriptor
from kvsp_moq.kvsp.container import decode_container
from kvsp_moq.kvsp.layout import Geometry
from kvsp_moq.kvsp.records import ReplicaRecord
from kvsp_moq.storage import RecordKey
from test_holder_support import SCOPE_A, TOKENS, H, running_holder

LAYERS, TOKENS_PER_BLOCK, HEADS, DIM = 3, 32, 2, 64
DESCRIPTOR = make_descriptor(
    model="transcode-test", model_digest="sha-256:" + "11" * 32, tokenizer_digest="sha-256:" + "22" * 32,
    layers=LAYERS, kv_heads=HEADS, head_dim=DIM, kv_dtype="fp16", positional="rope", block_tokens=TOKENS_PER_BLOCK,
    layout="kvsp-layout-1")
GEO = Geometry.from_descriptor_fields(HEADS, DIM, "fp16")
KEY = RecordKey(compat_id(DESCRIPTOR), SCOPE_A, hashlib.sha256(b"transcoded block").digest())
OTHER = RecordKey(hashlib.sha256(b"a compat without a descriptor").digest(), SCOPE_A, KEY.block_key)
FP8, PLANES = FP8_E4M3.codec.value, ZSTD_PLANES.codec.value

RNG = np.random.default_rng(31)
ARRAYS = [(RNG.normal(0, 1, (TOKENS_PER_BLOCK, HEADS, DIM)).astype(np.float16),
           RNG.normal(0, 3, (TOKENS_PER_BLOCK, HEADS, DIM)).astype(np.float16)) for _ in range(LAYERS)]
RAW = encode_block("raw", ARRAYS, GEO)


@pytest.fixture
async def h() -> AsyncIterator[H]:
    async with running_holder(descriptors=(DESCRIPTOR,), tiers=(TierConfig("host", 1 << 20),)) as h:
        for key in (KEY, OTHER):
            reply = await h.request("PUT", f"blocks/{key.path}", body=RAW, content_type="application/kvsp-block",
                                    headers={"If-None-Match": "*"})
            assert reply.status == 201, reply.body
        yield h


async def _records(h: H, key: RecordKey) -> list[ReplicaRecord]:
    reply = await h.request("GET", f"replicas/{key.path}", who="holder-svc", base=h.index.url)
    assert reply.status == 200, reply.body
    return [ReplicaRecord.from_json(r) for r in reply.json["replicas"]]


@pytest.fixture
async def fetcher() -> AsyncIterator[HttpBlockFetcher]:
    f = HttpBlockFetcher(TOKENS["client-a"])
    yield f
    await f.close()


def _transcodes(h: H, codec: int) -> float:
    value = h.service.metrics.transcodes.labels(str(codec))._value.get()
    assert isinstance(value, float)
    return value


async def test_fp8_over_http_verified_once_per_replica_and_codec(h: H, fetcher: HttpBlockFetcher) -> None:
    records = await _records(h, KEY)
    for _ in range(2):  # the second GET is served from the holder's transcoded cache
        got = await retrieve_block(fetcher, records, codec=FP8, geometry=GEO)
        assert got.header.codec == FP8 and got.attempts == ()
        for layer, (k, v) in zip(got.layers, ARRAYS, strict=True):
            dk, dv = decode_layer("fp8-e4m3", layer.k, layer.v, GEO, TOKENS_PER_BLOCK)
            for original, decoded in ((k, dk), (v, dv)):
                x = original.astype(np.float64)
                err = np.abs(decoded.view(np.float16).astype(np.float64) - x)
                amax = np.abs(x).max()
                # e4m3: relative 2**-4 plus the float16 rounding of the result (2**-11)
                assert (err <= np.abs(x) * (2.0**-4 + 2.0**-10) + amax * 2.0**-10).all()
    assert _transcodes(h, FP8) == 1
    # A layer range is another representation: transcoded once more, its header the range's.
    ranged = await retrieve_block(fetcher, records, layers=(1, 2), codec=FP8, geometry=GEO)
    assert (ranged.first_layer, ranged.last_layer) == (1, 2)
    assert _transcodes(h, FP8) == 2


async def test_lossless_codec_is_bit_exact(h: H, fetcher: HttpBlockFetcher) -> None:
    got = await retrieve_block(fetcher, await _records(h, KEY), codec=PLANES, geometry=GEO)
    assert got.header.codec == PLANES
    for layer, (k, v) in zip(got.layers, ARRAYS, strict=True):
        dk, dv = decode_layer("zstd-planes", layer.k, layer.v, GEO, TOKENS_PER_BLOCK)
        assert dk.tobytes() == k.tobytes() and dv.tobytes() == v.tobytes()


async def test_repr_digest_covers_the_transcoded_body(h: H, fetcher: HttpBlockFetcher) -> None:
    reply = await h.request("GET", f"blocks/{KEY.path}", params={"codec": str(FP8)})
    assert reply.status == 200 and reply.content_type == "application/kvsp-block"
    assert reply.headers["Repr-Digest"] == f"sha-256=:{base64.b64encode(hashlib.sha256(reply.body).digest()).decode()}:"
    assert decode_container(reply.body).header.codec == FP8

    # A holder double that flips one coded octet but keeps the holder's Repr-Digest.
    async def tampered(request: web.Request) -> web.Response:
        body = bytearray(reply.body)
        body[-7] ^= 0x01
        return web.Response(body=bytes(body), headers={"Content-Type": "application/kvsp-block",
                                                       "Repr-Digest": reply.headers["Repr-Digest"]})

    app = web.Application()
    app.router.add_get("/blocks/{tail:.*}", tampered)
    server = await serve_app(app, "127.0.0.1", 0)
    try:
        (good,) = await _records(h, KEY)
        bad = ReplicaRecord.from_json({**good.to_json(), "holder": server.url})
        with pytest.raises(RetrievalFailed, match="Repr-Digest"):
            await retrieve_block(fetcher, [bad], codec=FP8, geometry=GEO)
    finally:
        await server.close()


async def test_no_descriptor_no_transcoding(h: H) -> None:
    reply = await h.request("GET", f"blocks/{OTHER.path}", params={"codec": str(FP8)})
    assert reply.status == 404 and reply.problem == "kvsp-layers-unavailable"
    unregistered = await h.request("GET", f"blocks/{KEY.path}", params={"codec": "65000"})
    assert unregistered.status == 404 and unregistered.problem == "kvsp-layers-unavailable"
    # The stored codec is still served as stored.
    same = await h.request("GET", f"blocks/{OTHER.path}", params={"codec": "1"})
    assert same.status == 200 and same.body == RAW
