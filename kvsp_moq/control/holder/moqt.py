"""The holder's replicas over MOQT (binding v1 §8, §10; kvsp-draft §4.4, §6.1): ``[holder] moqt_relays``.

:class:`HolderMoqt` publishes every complete replica of the holder's store, from whichever
tier holds it (host memory or disk: the objects are read from the tier when the fetch stream
reaches them, ``bridge.track.BlockTrack``; a disk tier's file is mapped, never loaded whole),
as a MOQT track through each configured relay, and a second Replica Record per relay names
it: ``holder`` = the relay's ``moqt://`` URL, ``moqt_namespace`` = the replica's namespace,
beside the HTTP record. So a rack relay fans blocks of the storage tier out to the instances,
and caches them (MAX_CACHE_DURATION = the remaining TTL of the records, binding §7).

Order (binding §10: a record must name a relay that serves the replica):

1. ``publish(key)`` (a PUT stored a replica): the track enters the holder's catalog and its
   PUBLISH_NAMESPACE goes to every relay; once a relay accepted it (at most ``moqt_timeout_ms``),
   the ``moqt://`` record naming that relay is PUT at the IS. A relay that answers later gets
   its record at the next refresh (each relay's :class:`ReplicaPublisher` refreshes only the
   replicas its relay accepted).
2. Eviction or expiry (the store's evict listeners, before the octets go): the track leaves the
   catalog (a FETCH now gets DOES_NOT_EXIST), its namespace is withdrawn at every relay and the
   ``moqt://`` records are DELETEd at the IS, like the HTTP one. An eviction on purpose
   (``HolderService.evict``) awaits those DELETEs first (§6.6 "MUST first withdraw").
3. ``refresh()`` (the holder's background loop): relays not connected (unreachable at start,
   or the connection lost) are connected again; replicas not yet published (recovered from
   disk) are published; the records are refreshed.

The relay sessions carry ``moqt_token`` as an AUTHORIZATION_TOKEN Setup Option (binding §9)
and verify the relay's certificate per ``moqt_ca_file`` / ``moqt_insecure`` / ``[tls]``.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from ...bridge import MoqtHolder
from ...storage import BlockStore, RecordKey
from ...transport import TransportConfig
from ..client.publisher import IndexClient, ReplicaPublisher
from ..common.clock import Clock
from ..common.config import HolderConfig

__all__ = ["HolderMoqt"]

log = logging.getLogger(__name__)


class HolderMoqt:
    """Publishes ``store``'s replicas through ``config.moqt_relays`` (see the module notes)."""

    def __init__(self, store: BlockStore, index_client: IndexClient | None, *, config: HolderConfig,
                 clock: Clock, transport: TransportConfig) -> None:
        self.config = config
        self.transport = transport
        self.timeout_s = config.moqt_timeout_ms / 1000
        #: One publisher of ``moqt://`` records per relay: ``holder`` = the relay's URL.
        self.publishers: dict[str, ReplicaPublisher] = {
            url: ReplicaPublisher(
                store, index_client, holder_url=url, clock=clock, ttl_ms=config.record_ttl_ms,
                refresh_ms=config.refresh_ms, retry_ms=config.withdraw_retry_ms,
                retry_max_ms=config.withdraw_retry_max_ms, include=functools.partial(self._accepted, url),
            )
            for url in config.moqt_relays
        }
        self.holder = MoqtHolder(store, ttl_ms=config.record_ttl_ms, ttl_of=self._remaining_ms)

    # -- relays -------------------------------------------------------------------------------

    async def connect(self) -> None:
        """Attach every relay without a live session (failures are logged and retried by
        :meth:`refresh`)."""
        tokens = (self.config.moqt_token,) if self.config.moqt_token else ()
        for url in self.config.moqt_relays:
            if url in self.attached:
                continue
            try:
                await asyncio.wait_for(self.holder.attach_relay(url, self.transport, setup_tokens=tokens,
                                                                reconnect=self.config.moqt_reconnect),
                                       self.timeout_s)
            except Exception as exc:  # unreachable, refused, timed out: logged, retried
                log.warning("cannot publish through relay %s (retried at the next refresh): %r", url, exc)
            else:
                log.info("publishing the holder's replicas through relay %s", url)

    @property
    def attached(self) -> list[str]:
        """The relays with a live session."""
        return [url for url in self.config.moqt_relays
                if (session := self.holder.relay_session(url)) is not None and not session.closed.done()]

    def _accepted(self, url: str, key: RecordKey) -> bool:
        return self.holder.is_announced(url, key)

    def _remaining_ms(self, key: RecordKey, replica_id: bytes) -> int | None:
        remaining = max((p.remaining_ms(key, replica_id) for p in self.publishers.values()), default=0)
        return remaining or None

    # -- replicas -----------------------------------------------------------------------------

    async def publish(self, key: RecordKey) -> None:
        """The replica of ``key`` was stored: announce it, then publish its ``moqt://`` records."""
        self.holder.publish(key)
        await self.holder.wait_announced(self.timeout_s)
        for url, publisher in self.publishers.items():
            if self.holder.is_announced(url, key):
                await publisher.publish(key)

    async def refresh(self) -> None:
        """Reconnect lost relays, publish replicas not yet published, refresh the records."""
        if len(self.attached) < len(self.config.moqt_relays):
            await self.connect()
        for info in self.holder.store.replicas():
            if info.complete:
                self.holder.publish(info.key)
        await self.holder.wait_announced(self.timeout_s)
        for publisher in self.publishers.values():
            await publisher.refresh()

    async def withdraw(self, key: RecordKey, replica_id: bytes) -> None:
        """Before an eviction on purpose: the ``moqt://`` records of the replica are DELETEd."""
        await asyncio.gather(*(p.withdraw(key, replica_id) for p in self.publishers.values()))

    async def flush(self) -> None:
        """Wait for the withdrawals started by evictions (before answering a PUT that evicted)."""
        await asyncio.gather(*(p.flush() for p in self.publishers.values()))

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.flush(), self.timeout_s)
        except TimeoutError:
            log.warning("closing with moqt:// record withdrawals pending; they expire at the index")
        for publisher in self.publishers.values():
            publisher.close()
        await self.holder.close()
