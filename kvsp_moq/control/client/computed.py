"""Publishing the complete blocks an engine computed (kvsp-draft §6.1, §6.7; binding v1).

The one publisher of computed blocks: the instance's engine (``control.engine``) and the vLLM
connector (``integrations.vllm``) both use it (DESIGN.md §9). A block arrives whole
(:meth:`ComputedBlockPublisher.publish`, a container) or was written layer by layer into the
store through the MoqtHolder's writer, each layer going to subscribers as computed, and is now
sealed (:meth:`ComputedBlockPublisher.publish_written`).

Each new block (a KVB1 container, codec raw, §4.3) goes, independently of the others:

- **store** — into the instance's own tiers, and its Replica Record (holder = the instance
  URL) to the IS through the instance's :class:`~.client.publisher.ReplicaPublisher`, so that the IS
  counts the block as resident here (§6.4) and later requests reuse it locally;
- **holder** — to an HTTP holder with ``PUT blocks/... If-None-Match: *`` (§6.7); the holder
  publishes its own record (§6.1). 412 means the holder already has a replica (kept);
- **moqt** — over MOQT: the instance's :class:`~kvsp_moq.bridge.MoqtHolder`, attached to the
  relay as a publisher, announces the block's track (PUBLISH_NAMESPACE), and a ``moqt://``
  record naming the relay and the replica's namespace goes to the IS (§4.4), so consumers
  FETCH it through the relay, which caches it (binding §7). Those records have a
  :class:`~.client.publisher.ReplicaPublisher` of their own (``moqt_records``: holder = the
  relay URL, only the replicas the relay accepted, so none while it is not attached): refreshed a third of
  ``record_ttl_ms`` before they expire, and withdrawn (DELETE with the namespace) when the
  store evicts the block, as the MoqtHolder withdraws the namespace at the relay (§6.1); so
  no lookup keeps sending readers to a replica that is gone.

A failure of one destination is logged and counted; it never fails the request. Each record
publication the request waits for is bounded by ``index_timeout_s`` (an IS that does not
answer is retried by the publisher's refresh, not waited for).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ...bridge import MoqtHolder
from ...kvsp.records import ReplicaRecord
from ...storage import BlockStore, RecordKey, ReplicaExists
from ..common.clock import Clock, MonotonicClock
from .publisher import IndexClient, ReplicaPublisher

__all__ = ["BlockStorer", "ComputedBlockPublisher", "PublicationCounters", "PublicationCounts"]

log = logging.getLogger(__name__)


class BlockStorer(Protocol):
    """An HTTP holder's block resource, as the engine writes it (``client.http.HttpBlockStorer``)."""

    async def put_block(self, holder: str, key: RecordKey, container: bytes) -> bool:
        """``PUT {holder}blocks/{key}`` with ``If-None-Match: *``: True when stored (201),
        False when the holder already had a replica (412); raises on any other outcome."""
        ...


class PublicationCounters(Protocol):
    """Where the publisher counts (the instance engine's ``EngineCounters``, or
    :class:`PublicationCounts`)."""

    published_store: int
    published_holder: int
    published_moqt: int
    publish_errors: int


@dataclass
class PublicationCounts:
    """:class:`PublicationCounters` on their own (the vLLM connector's)."""

    published_store: int = 0
    published_holder: int = 0
    published_moqt: int = 0
    publish_errors: int = 0


class ComputedBlockPublisher:
    """Sends computed blocks to the destinations configured (see the module notes)."""

    def __init__(
        self,
        *,
        store: BlockStore,
        counters: PublicationCounters,
        publisher: ReplicaPublisher | None = None,
        holder_url: str | None = None,
        storer: BlockStorer | None = None,
        moqt_holder: MoqtHolder | None = None,
        relay_url: str | None = None,
        index: IndexClient | None = None,
        record_ttl_ms: int = 60_000,
        clock: Clock | None = None,
        index_timeout_s: float = 10.0,
    ) -> None:
        self.store = store
        self.counters = counters
        self.publisher = publisher
        self.holder_url = holder_url
        self.storer = storer
        self.moqt_holder = moqt_holder
        self.relay_url = relay_url
        self.index = index
        self.record_ttl_ms = record_ttl_ms
        #: The bound on each record publication the caller waits for (``_bounded``).
        self.index_timeout_s = index_timeout_s
        #: The ``moqt://`` records naming the relay: published, refreshed and withdrawn on
        #: eviction like the store's (see the module notes); None without relay or IS.
        self.moqt_records: ReplicaPublisher | None = None
        if moqt_holder is not None and relay_url is not None and index is not None:
            holder = moqt_holder
            self.moqt_records = ReplicaPublisher(
                store, index, holder_url=relay_url, clock=clock or MonotonicClock(), ttl_ms=record_ttl_ms,
                refresh_ms=max(1, record_ttl_ms // 3), include=lambda key: holder.is_announced(relay_url, key),
                # the store publisher's journal: its withdraw_previous covers these records too
                journal=publisher.journal if publisher is not None else None)
            records = self.moqt_records
            # binding §7: a track's MAX_CACHE_DURATION is its record's remaining TTL, refreshes included
            holder.records_published_by(lambda key, rid: records.remaining_ms(key, rid) or None)
        self._refresher: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Run the refresh of the ``moqt://`` records in the background (until :meth:`close`)."""
        if self.moqt_records is not None and self._refresher is None:
            self._refresher = asyncio.get_running_loop().create_task(self.moqt_records.run(),
                                                                     name="moqt record refresh")

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
            self._refresher = None
        if self.moqt_records is not None:
            self.moqt_records.close()

    async def publish(self, key: RecordKey, container: bytes) -> list[str]:
        """Publish one block; the destinations it reached."""
        held = await self._store(key, container)
        return (["store"] if held else []) + await self._distribute(key, held, lambda: container)

    async def publish_written(self, key: RecordKey) -> list[str]:
        """Publish a block that reached the store through a writer (``MoqtHolder.begin``) and
        is sealed: its store record, the HTTP holder (the container read back from the
        store) and the ``moqt://`` record; the destinations it reached."""
        self.counters.published_store += 1
        await self._store_record(key)

        def container() -> bytes:
            return b"".join(bytes(chunk) for chunk in self.store.open_reader(key, touch=False))

        return ["store"] + await self._distribute(key, True, container)

    async def _distribute(self, key: RecordKey, held: bool, container: Callable[[], bytes]) -> list[str]:
        """The HTTP holder and MOQT (records) of a block the store now holds (``held``)."""
        done: list[str] = []
        if self.storer is not None and self.holder_url is not None:
            try:
                if await self.storer.put_block(self.holder_url, key, container()):
                    self.counters.published_holder += 1
                done.append("holder")
            except Exception as exc:
                self.counters.publish_errors += 1
                log.warning("PUT of block %s at %s failed: %s", key.block_key.hex()[:12], self.holder_url, exc)
        if held and self.moqt_holder is not None and self.moqt_records is not None and self.relay_url is not None:
            try:
                self.moqt_holder.publish(key)
                await self.moqt_holder.wait_announced(self.index_timeout_s)
                if not self.moqt_holder.is_announced(self.relay_url, key):
                    # Binding §10: the record names a relay that serves the replica; the
                    # refresh publishes it once the relay is attached and accepted it.
                    raise RuntimeError("the relay has not accepted the namespace (not attached yet?)")
                # Sets the replica's expiry at the holder (MAX_CACHE_DURATION, binding §7).
                self.moqt_holder.replica_record(key, holder=self.relay_url, ttl_ms=self.record_ttl_ms)
                if await self._bounded(self.moqt_records, key) is None:
                    raise RuntimeError("the IS did not take the record (retried by the refresh)")
                self.counters.published_moqt += 1
                done.append("moqt")
            except Exception as exc:
                self.counters.publish_errors += 1
                log.warning("MOQT publication of block %s via %s failed: %s", key.block_key.hex()[:12], self.relay_url, exc)
        return done

    async def _store(self, key: RecordKey, container: bytes) -> bool:
        """Into the own tiers (and the IS through the replica publisher); True when held."""
        try:
            self.store.put(key, container)
        except ReplicaExists:
            return True  # computed or loaded meanwhile: the replica there is kept
        except Exception as exc:  # a full store: the block is still served by the holder
            self.counters.publish_errors += 1
            log.warning("storing block %s failed: %s", key.block_key.hex()[:12], exc)
            return False
        self.counters.published_store += 1
        await self._store_record(key)
        return True

    async def _store_record(self, key: RecordKey) -> None:
        """The store's record of ``key`` (holder = the engine's URL) to the IS, bounded."""
        if self.publisher is not None:
            try:
                await self._bounded(self.publisher, key)
            except Exception as exc:
                self.counters.publish_errors += 1
                log.warning("publishing the record of block %s failed: %s", key.block_key.hex()[:12], exc)

    async def _bounded(self, publisher: ReplicaPublisher, key: RecordKey) -> ReplicaRecord | None:
        """``publisher.publish(key)`` within ``index_timeout_s``: an IS that does not answer
        does not hold the request's answer; the record, never acknowledged, is published by
        the publisher's next refresh (client/publisher.py)."""
        try:
            async with asyncio.timeout(self.index_timeout_s):
                return await publisher.publish(key)
        except TimeoutError:
            log.warning("the IS did not take the record of block %s within %s s (retried by the refresh)",
                        key.block_key.hex()[:12], self.index_timeout_s)
            return None

    async def keep(self, key: RecordKey, layers: list[tuple[object, object]], tokens: int) -> None:
        """A block loaded on demand (MOQT or HTTP, verified): kept in the own tiers and
        published with the instance as holder, like a prefetched block (§6.5)."""
        try:
            self.store.put_layers(key, layers, token_count=tokens)
        except ReplicaExists:
            return
        except Exception as exc:
            log.warning("keeping block %s failed: %s", key.block_key.hex()[:12], exc)
            return
        if self.publisher is not None:
            try:
                await self._bounded(self.publisher, key)
            except Exception as exc:
                log.warning("publishing the record of block %s failed: %s", key.block_key.hex()[:12], exc)
