"""The holder's Replica Records at a real Index Service (kvsp-draft §6.1, §6.6): publication on
PUT, refresh before expiry, withdrawal at eviction (ordered by the shared event log: the IS's
store and the holder's store write into it), withdrawal *before* a forced eviction of leased
data, and retries while the IS is unreachable."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvsp_moq.control.common.config import ControlConfig, IndexConfig, TierConfig
from kvsp_moq.control.index.serve import serve_index
from kvsp_moq.kvsp.container import decode_container
from kvsp_moq.storage import ReplicaPinned
from test_holder_support import AUTH, BLOCK_SIZE, RecordingIndexStore, bkey, container, rkey, running_holder


async def test_put_publishes_the_replica_record() -> None:
    async with running_holder() as h:
        await h.put_block(0)
        (record,) = await h.index_replicas(0)
        stored = decode_container(container(0))
        assert record.holder == h.url
        assert record.layer_digests == tuple(stored.layer_digests())
        assert record.digest == stored.replica_digest()
        assert record.size == len(container(0)) and record.codec == 1
        assert [r.tier for r in record.residency] == ["host"]
        assert h.events == [("is-put", bkey(0).hex())]


async def test_records_are_refreshed_before_they_expire() -> None:
    async with running_holder(record_ttl_ms=60_000) as h:
        await h.put_block(0)
        publisher = h.service.publisher
        h.clock.advance(10_000)
        assert await publisher.refresh() == 0  # not due yet (a third of the TTL)
        h.clock.advance(10_000)
        assert await publisher.refresh() == 1
        assert h.events == [("is-put", bkey(0).hex())] * 2
        h.clock.advance(45_000)  # 65 s after the first PUT, 45 s after the refresh
        (record,) = await h.index_replicas(0)
        assert record.ttl_ms == 15_000


async def test_replicas_stored_by_other_means_are_published_at_refresh() -> None:
    async with running_holder() as h:
        h.service.store.put(rkey(9), container(9))  # e.g. an instance's BlockWriter
        assert await h.index_replicas(9) == []
        assert await h.service.publisher.refresh() == 1
        assert [r.holder for r in await h.index_replicas(9)] == [h.url]


async def test_eviction_for_room_withdraws_before_the_new_replica_is_published() -> None:
    async with running_holder(tiers=(TierConfig("host", 2 * BLOCK_SIZE),)) as h:
        await h.put_block(0)
        await h.put_block(1)
        h.events.clear()
        reply = await h.put_block(2)  # evicts block 0 (LRU)
        assert reply.status == 201
        # By the time the PUT is answered: the eviction was announced (bytes still there),
        # the DELETE reached the IS, and only then was the new replica published.
        assert h.events == [("evict", bkey(0).hex()), ("is-delete", bkey(0).hex()), ("is-put", bkey(2).hex())]
        assert await h.index_replicas(0) == []
        assert (await h.get_block(0)).status == 404


async def test_deliberate_eviction_withdraws_first() -> None:
    async with running_holder() as h:
        await h.put_block(0)
        h.events.clear()
        assert await h.service.evict(rkey(0))
        assert h.events == [("is-delete", bkey(0).hex()), ("evict", bkey(0).hex())]
        assert await h.index_replicas(0) == []


async def test_forced_eviction_of_leased_data_withdraws_first() -> None:
    async with running_holder() as h:
        await h.put_block(0)
        assert (await h.lease([0], ttl_ms=30_000)).status == 201
        with pytest.raises(ReplicaPinned):
            await h.service.evict(rkey(0))
        h.events.clear()
        assert await h.service.evict(rkey(0), force=True)  # a fault (§6.6)
        assert h.events == [("is-delete", bkey(0).hex()), ("evict", bkey(0).hex())]
        assert (await h.get_block(0)).status == 404
        # Re-storing the block gives a fresh replica that the old lease does not pin.
        assert (await h.put_block(0)).status == 201
        assert not h.service.store.is_pinned(rkey(0))


async def test_unreachable_index_is_retried(caplog: pytest.LogCaptureFixture) -> None:
    """Publication fails and is retried by the refresh; a withdrawal that fails is retried
    with backoff until it reaches the IS (started later on the same port)."""
    config = ControlConfig(auth=AUTH, index=IndexConfig(purge_interval_ms=0))
    async with await serve_index(config, "127.0.0.1", 0) as gone:
        dead_url, port = gone.url, gone.port
    caplog.set_level(logging.WARNING, logger="kvsp_moq.control.client.publisher")
    async with running_holder(index_url=dead_url, withdraw_retry_ms=5, withdraw_retry_max_ms=20) as h:
        assert (await h.put_block(0)).status == 201  # stored, though not published
        assert "publishing" in caplog.text
        events: list[tuple[str, str]] = []
        store = RecordingIndexStore(h.clock, events)
        retrying = _LogEvent("retrying")
        logging.getLogger("kvsp_moq.control.client.publisher").addHandler(retrying)
        try:
            h.service.store.remove(rkey(0))  # eviction while the IS is down: DELETE is retried
            await retrying.event.wait()
        finally:
            logging.getLogger("kvsp_moq.control.client.publisher").removeHandler(retrying)
        async with await serve_index(config, "127.0.0.1", port, clock=h.clock, store=store):
            await h.service.publisher.flush()
            assert events == [("is-delete", bkey(0).hex())]
            await h.put_block(1)
            assert events[-1] == ("is-put", bkey(1).hex())


class _LogEvent(logging.Handler):
    """Sets an asyncio event when a record containing ``text`` is logged (no polling)."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.WARNING)
        self.text = text
        self.event = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()
