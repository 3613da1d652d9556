"""HTTP block retrieval with a per-replica inactivity timeout (kvsp-draft §6.7; ``HttpBlockFetcher``
``read_timeout_s``, ``[instance] block_read_timeout_ms``): a holder that stops sending in the
middle of a block's body fails that replica, and the next replica is used. Real HTTP servers
on 127.0.0.1: the holder of the block, and one that sends half the body and then hangs."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web

from kvsp_moq.control.client.http import HttpBlockFetcher
from kvsp_moq.control.client.retrieval import retrieve_block
from kvsp_moq.control.http.server import serve_app
from kvsp_moq.kvsp.container import DecodedLayer
from kvsp_moq.kvsp.records import ReplicaRecord
from test_holder_support import LAYERS, TOKENS, container, running_holder


@asynccontextmanager
async def hanging_holder(data: bytes) -> AsyncIterator[tuple[str, asyncio.Event]]:
    """A real HTTP server that answers a block GET with its headers and the first half of the
    body, then sends nothing more until the test ends. The event is set once it has hung."""
    hung = asyncio.Event()
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        digest = base64.b64encode(hashlib.sha256(data).digest()).decode()
        resp = web.StreamResponse(headers={"Content-Type": "application/kvsp-block", "Repr-Digest": f"sha-256=:{digest}:"})
        resp.content_length = len(data)
        await resp.prepare(request)
        await resp.write(data[: len(data) // 2])
        hung.set()
        await release.wait()
        return resp

    app = web.Application()
    app.router.add_get("/blocks/{tail:.*}", handler)
    server = await serve_app(app, "127.0.0.1", 0)
    try:
        yield server.url, hung
    finally:
        release.set()
        await server.close()


class Sink:
    def __init__(self) -> None:
        self.layers: list[tuple[str, int]] = []
        self.discarded: list[str] = []

    def layer(self, record: ReplicaRecord, layer: DecodedLayer) -> None:
        self.layers.append((record.holder, layer.index))

    def discard(self, record: ReplicaRecord) -> None:
        self.discarded.append(record.holder)


async def test_a_holder_that_stops_mid_body_makes_the_next_replica_be_tried() -> None:
    fetcher = HttpBlockFetcher(TOKENS["client-a"], read_timeout_s=0.2)
    try:
        async with running_holder() as h:
            assert (await h.put_block(0)).status == 201
            (good,) = await h.index_replicas(0)
            async with hanging_holder(container(0)) as (url, hung):
                stalled = dataclasses.replace(good, holder=url)
                sink = Sink()
                got = await asyncio.wait_for(retrieve_block(fetcher, [stalled, good], sink=sink), 30)
                assert hung.is_set()
    finally:
        await fetcher.close()
    assert got.record == good and [l.index for l in got.layers] == list(range(LAYERS))
    (attempt,) = got.attempts
    assert attempt.holder == url and attempt.outcome == "error" and "Timeout" in attempt.detail
    # the layers the stalled holder delivered before it hung were discarded, then the good ones used
    stalled_layers = [i for holder, i in sink.layers if holder == url]
    assert stalled_layers and stalled_layers == list(range(len(stalled_layers))) and sink.discarded == [url]
    assert [i for holder, i in sink.layers if holder == good.holder] == list(range(LAYERS))


def test_the_instance_setting(tmp_path: Path) -> None:
    from kvsp_moq.control.common.config import load_config
    from kvsp_moq.control.common.errors import ConfigError

    (tmp_path / "ok.toml").write_text("[instance]\nblock_read_timeout_ms = 750\n")
    assert load_config(tmp_path / "ok.toml").instance.block_read_timeout_ms == 750
    (tmp_path / "bad.toml").write_text("[instance]\nblock_read_timeout_ms = 0\n")
    with pytest.raises(ConfigError, match="block_read_timeout_ms"):
        load_config(tmp_path / "bad.toml")
