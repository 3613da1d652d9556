"""Prefetch over MOQT that pipelines (issue 16): no TRACK_STATUS before the FETCH, several
blocks in flight on one session, each layer landed straight in the store's block writer
(``bridge/landing.py``: one copy, one hash, verified against the record). Real holders
(``MoqtHolder`` on loopback QUIC), a real relay (``relay.core.Relay``), a real
``PrefetchExecutor`` wiring; the holder's catalog lookups are logged to count the FETCHes it
serves and the order in which they arrive. No mocks, no sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from bridge_support import HolderNode, client_config, make_key, make_layers, record_at, start_relay, within
from kvsp_moq.bridge.landing import StoreLanding
from kvsp_moq.control.client.moqt import MoqtBlockRetriever
from kvsp_moq.control.client.retrieval import Attempt, RetrievalFailed
from kvsp_moq.kvsp.container import replica_digest
from kvsp_moq.kvsp.records import ReplicaRecord
from kvsp_moq.moqt.messages import FetchOk
from kvsp_moq.storage import BlockStore, DiskTier, HostTier, RecordKey, StorageError

BLOCKS = 8
WINDOW = 4


def counted(node: HolderNode, log: list[tuple[str, int]]) -> None:
    """Log every catalog lookup of the holder (one per FETCH or TRACK_STATUS it serves)."""
    get: Callable[..., Any] = node.holder.catalog.get

    def logged(namespace: Any, name: Any) -> Any:
        track = get(namespace, name)
        log.append(("request", getattr(track, "key", None).block_key[0] if track is not None else -1))
        return track

    node.holder.catalog.get = logged  # type: ignore[method-assign]


@pytest.fixture
async def node() -> AsyncIterator[HolderNode]:
    holder = await HolderNode().start()
    for i in range(BLOCKS):
        holder.put(key(i), make_layers(4, tokens=16, seed=10 + i))
    yield holder
    await holder.close()


def key(i: int) -> RecordKey:
    return RecordKey(b"\x11" * 32, b"\x22" * 16, bytes([i]) * 32)


def landed_payloads(store: BlockStore, k: RecordKey) -> list[bytes]:
    return [bytes(store.layer_payload(k, layer, touch=False)) for layer in range(4)]


async def land_all(retriever: MoqtBlockRetriever, records: list[ReplicaRecord], store: BlockStore,
                   log: list[tuple[str, int]]) -> None:
    """What the prefetch executor does with a window of WINDOW blocks: each block's land()."""
    gate = asyncio.Semaphore(WINDOW)

    async def one(i: int, record: ReplicaRecord) -> None:
        async with gate:
            landed = await retriever.land([record], store, key(i))
        assert landed.info is not None and landed.info.complete and landed.attempts == ()
        log.append(("done", i))

    await within(asyncio.gather(*(one(i, r) for i, r in enumerate(records))))


@pytest.mark.parametrize("via_relay", [False, True], ids=["direct", "relay"])
async def test_blocks_are_fetched_several_at_once_and_land_byte_identical(node: HolderNode, via_relay: bool) -> None:
    relay = await start_relay() if via_relay else None
    retriever = MoqtBlockRetriever(client_config())
    try:
        if relay is not None:
            await within(node.holder.attach_relay(relay.url, client_config()))
            await within(node.holder.wait_announced())
        url = relay.url if relay is not None else node.url
        records = [node.holder.replica_record(key(i), holder=url) for i in range(BLOCKS)]
        await within(retriever.pool.get(url))
        log: list[tuple[str, int]] = []
        counted(node, log)
        store = BlockStore([HostTier(1 << 20)])
        await land_all(retriever, records, store, log)
        requests = [i for what, i in log if what == "request"]
        # One request per block: a FETCH, no TRACK_STATUS before it.
        assert sorted(requests) == list(range(BLOCKS))
        # Pipelined: the holder got the FETCHes of a whole window before any block was done.
        first_done = next(n for n, (what, _) in enumerate(log) if what == "done")
        assert first_done >= WINDOW, log
        # One session to the holder or relay carried them all.
        assert len(retriever.pool._sessions) == 1  # noqa: SLF001 - the pool's own map, read only
        for i in range(BLOCKS):
            info = store.info(key(i))
            assert info.digest == records[i].digest and info.token_count == 16
            assert landed_payloads(store, key(i)) == landed_payloads(node.store, key(i))
    finally:
        await retriever.close()
        if relay is not None:
            await within(relay.close())


async def test_a_disk_tier_lands_through_a_staging_buffer(node: HolderNode, tmp_path: Any) -> None:
    store = BlockStore([DiskTier(tmp_path / "disk", 1 << 20)])
    retriever = MoqtBlockRetriever(client_config())
    try:
        landed = await within(retriever.land([node.holder.replica_record(key(0))], store, key(0)))
        assert landed.info is not None and landed.info.residency[0].tier == "disk"
        assert landed_payloads(store, key(0)) == landed_payloads(node.store, key(0))
    finally:
        await retriever.close()


@pytest.fixture
async def retriever() -> AsyncIterator[MoqtBlockRetriever]:
    got = MoqtBlockRetriever(client_config())
    yield got
    await got.close()


async def rejected(retriever: MoqtBlockRetriever, record: ReplicaRecord, k: RecordKey, store: BlockStore) -> Attempt:
    """The one attempt of a land() that must fail; nothing of it may stay in ``store``."""
    with pytest.raises(RetrievalFailed) as failed:
        await within(retriever.land([record], store, k))
    attempt, = failed.value.attempts
    assert store.get(k) is None and store.stats().tiers[0].used == 0
    return attempt


async def test_a_bad_layer_digest_is_rejected_and_nothing_is_kept(node: HolderNode, retriever: MoqtBlockRetriever) -> None:
    record = node.holder.replica_record(key(1))
    tier = node.store.layer_payload(key(1), 2, touch=False).obj  # the host tier's own array
    tier[7] ^= 0x01  # a bit flips in the holder's RAM: only the per-layer check can catch it
    attempt = await rejected(retriever, record, key(1), BlockStore([HostTier(1 << 20)]))
    assert attempt.outcome == "rejected" and "digest" in attempt.detail


def lying(record: ReplicaRecord, layers: int) -> ReplicaRecord:
    """The record with only its first ``layers`` layer digests (size and digest made to agree)."""
    digests = (record.layer_digests or ())[:layers]
    section = (record.size - 20 - 16 * 4) // 8
    return ReplicaRecord.from_json({
        **record.to_json(), "layer_digests": [d.hex() for d in digests],
        "digest": "sha-256:" + replica_digest(digests).hex(), "size": 20 + 16 * layers + 2 * layers * section,
        "residency": [{"tier": "host", "layers": [0, layers - 1]}]})


async def test_a_record_that_lies_about_the_layers_is_rejected(node: HolderNode, retriever: MoqtBlockRetriever) -> None:
    honest = node.holder.replica_record(key(2))
    liar = lying(honest, 3)  # says 3 layers; the track (FETCH_OK) holds 4
    store = BlockStore([HostTier(1 << 20)])
    attempt = await rejected(retriever, liar, key(2), store)
    assert attempt.outcome == "rejected" and "layers" in attempt.detail
    # The next record is tried: the honest one lands.
    landed = await within(retriever.land([liar, honest], store, key(2)))
    assert landed.info is not None and [a.outcome for a in landed.attempts] == ["rejected"]


async def test_a_source_of_another_section_size_is_refused(node: HolderNode, retriever: MoqtBlockRetriever) -> None:
    honest = node.holder.replica_record(key(3))
    # The same digests, but a size that makes every layer 16 octets longer: the payloads the
    # holder sends are not the record's layer size and are refused before anything lands.
    bigger = ReplicaRecord.from_json({**honest.to_json(), "size": honest.size + 4 * 32})
    attempt = await rejected(retriever, record_at(bigger, node.url), key(3), BlockStore([HostTier(1 << 20)]))
    assert attempt.outcome == "rejected" and "payload length" in attempt.detail


async def test_a_block_stored_meanwhile_is_left_as_it_is(node: HolderNode) -> None:
    store = BlockStore([HostTier(1 << 20)])
    first = store.put_layers(key(4), [(bytes(node.store.layer_payload(key(4), i))[:2048],
                                       bytes(node.store.layer_payload(key(4), i))[2048:]) for i in range(4)],
                             token_count=16)
    retriever = MoqtBlockRetriever(client_config())
    try:
        landed = await within(retriever.land([node.holder.replica_record(key(4))], store, key(4)))
        assert landed.info is None and landed.attempts == ()
        assert store.info(key(4)).replica_id == first.replica_id  # the copy already held is kept
    finally:
        await retriever.close()


def test_an_object_that_overtakes_fetch_ok_is_staged_then_committed() -> None:
    layers = make_layers(2, tokens=4, kv_heads=1, head_dim=8, dtype="fp32", seed=5)
    source = BlockStore([HostTier(1 << 16)])
    k = make_key(9)
    info = source.put_layers(k, layers.arrays, token_count=4, geometry=layers.geometry)
    payloads = [bytes(source.layer_payload(k, i)) for i in range(2)]
    digests = tuple(d for d in info.layer_digests if d is not None)
    store = BlockStore([HostTier(1 << 16)])
    landing = StoreLanding(store, k, digests, len(payloads[0]) // 2)
    # Layer 0 arrives before FETCH_OK (another QUIC stream): it is received into a staging buffer.
    view = landing.begin_layer(0, len(payloads[0]))
    view[:] = payloads[0]
    landing.chunk_written(0, len(payloads[0]))
    assert landing.end_layer(0) and store.get(k) is None
    from kvsp_moq.bridge.binding import track_properties
    from kvsp_moq.moqt.messages import Location

    props = track_properties(token_count=4, first_layer=0, layer_count=2, layer_digests=list(digests),
                             max_cache_duration_ms=None)
    landing.on_response(FetchOk(end_of_track=True, end_location=Location(0, 1), track_properties=props))
    # Layer 1 lands in the tier itself.
    view = landing.begin_layer(1, len(payloads[1]))
    assert view.obj is store._by_key[k].slot(1).location.buf  # noqa: SLF001 - the tier's buffer itself
    view[:] = payloads[1]
    landing.chunk_written(1, len(payloads[1]))
    assert landing.end_layer(1)
    stored = landing.finish()
    assert stored.complete and [bytes(store.layer_payload(k, i)) for i in range(2)] == payloads
    with pytest.raises(StorageError):
        StoreLanding(store, make_key(10), digests, 1).finish()  # never answered: nothing begun
