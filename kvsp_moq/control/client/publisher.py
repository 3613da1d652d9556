"""A holder's Replica Records at the Index Service (kvsp-draft §6.1).

"A holder publishes each replica it is willing to serve with PUT, carrying a Replica Record
[...] Holders refresh records before expiry with the same PUT [...] A holder MUST withdraw a
record with DELETE before or immediately after evicting the replica" (§6.1).

:class:`ReplicaPublisher` does that for one :class:`~kvsp_moq.storage.BlockStore`:

- :meth:`~ReplicaPublisher.publish` PUTs the record of a stored replica (built by
  ``ReplicaInfo.replica_record``) and remembers when the IS will expire it (the TTL the IS
  granted, §6.1 "the IS caps ttl_ms"); that expiry is also the replica's remaining TTL used
  for ``Cache-Control: max-age`` (§6.7).
- :meth:`~ReplicaPublisher.refresh` republishes records a third of their TTL before they expire
  (the period is configurable), publishes replicas that reached the store by other means (an
  instance's :class:`~kvsp_moq.storage.BlockWriter`; only those ``include`` selects, when
  given), and retries failed publications; the
  holder's background loop calls it, tests call it with a manual clock. It sends the due
  records in batches (``POST {is}replicas:batch``, ours) when the client can, single PUTs
  to an IS without that route.
- Withdrawal on eviction: the publisher is an evict listener of the store, called *before*
  the octets go. Listeners are synchronous and the IS is remote, so the listener starts the
  DELETE at once (a task) and it reaches the IS immediately after the eviction; a holder that
  evicts to make room for a PUT awaits :meth:`~ReplicaPublisher.flush` before it publishes the
  new replica and answers, so the withdrawal is at the IS first. A failed DELETE (IS
  unreachable, 5xx) is logged and retried with exponential backoff until it succeeds or the
  record has expired at the IS anyway.
- Withdrawal *before* eviction: :meth:`~ReplicaPublisher.withdraw` awaits the DELETE; the
  holder calls it before removing a replica on purpose (``HolderService.evict``, including a
  forced eviction of leased data after a fault, §6.6 "MUST first withdraw").
- One asyncio lock per block key orders a publication and a withdrawal of the same key: an
  HTTP holder's replicas of one block share one record identity (its holder URL), so a
  pending DELETE must not overtake, or be overtaken by, a PUT of the next replica.
- Withdrawal after a restart: with a :class:`~.journal.RecordJournal`, every record is listed
  in a file from its first PUT until its withdrawal; :meth:`~ReplicaPublisher.withdraw_previous`,
  run at start, withdraws what the last run listed and this store no longer holds (a memory
  tier's replicas are all gone after a restart; a disk tier's recovered ones stay published).

The IS is reached through :class:`IndexClient`, a small transport-neutral interface
(``client.http.HttpIndexClient`` implements it over HTTP).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from ...kvsp.records import ReplicaRecord
from ...storage import BlockStore, RecordKey, ReplicaInfo
from ..common.clock import Clock
from .journal import JournalEntry, RecordJournal

__all__ = ["DEFAULT_BATCH", "IndexClient", "IndexRefused", "IndexUnreachable", "PREVIOUS_WAIT_S", "ReplicaPublisher",
           "start_withdrawing_previous"]

#: How long a role's start waits for the withdrawal of the last run's records before it serves
#: (the rest goes on in the background: an unreachable IS must not hold up the start).
PREVIOUS_WAIT_S = 5.0

log = logging.getLogger(__name__)

#: Records per batched refresh request (``POST {is}replicas:batch``).
DEFAULT_BATCH = 256


class IndexUnreachable(Exception):
    """The IS could not be reached or failed (connection error, timeout, 5xx): retry later."""


class IndexRefused(Exception):
    """The IS refused the request (4xx): retrying the same request will not help."""

    def __init__(self, status: int, problem: str | None, detail: str) -> None:
        self.status = status
        self.problem = problem
        super().__init__(f"{status} {problem or ''}: {detail}")


class IndexClient(Protocol):
    """What a holder needs of the Index Service (§6.1)."""

    async def publish(self, record: ReplicaRecord) -> ReplicaRecord:
        """PUT the record; return it as stored (``ttl_ms`` = the granted TTL)."""
        ...

    async def withdraw(self, key: RecordKey, holder: str, moqt_namespace: str | None) -> bool:
        """DELETE the record of the holder's replica of ``key``; False if the IS had none."""
        ...


@dataclass
class _Published:
    replica_id: bytes
    expires_ms: int  # when the IS drops the record (and the replica's TTL ends, §6.7)
    published_ms: int | None  # last successful PUT; None while never acknowledged
    attempted: bool  # a PUT was sent (it may have reached the IS even if it failed)


class ReplicaPublisher:
    """Publishes, refreshes and withdraws the Replica Records of one store's replicas."""

    def __init__(
        self,
        store: BlockStore,
        client: IndexClient | None,
        *,
        holder_url: str | Callable[[], str],
        clock: Clock,
        ttl_ms: int = 60_000,
        refresh_ms: int = 20_000,
        retry_ms: int = 200,
        retry_max_ms: int = 10_000,
        batch_size: int = DEFAULT_BATCH,
        include: Callable[[RecordKey], bool] | None = None,
        journal: RecordJournal | None = None,
    ) -> None:
        self.store = store
        #: The file listing the records that may be at the IS (module notes), or None.
        self.journal = journal
        #: Which of the store's replicas this publisher refreshes on its own (None: all). A
        #: publisher of ``moqt://`` records through a relay includes only the replicas its
        #: MoqtHolder publishes (``client.computed``); an explicit :meth:`publish` is always sent.
        self.include = include
        self.client = client
        self._holder_url = holder_url
        self.clock = clock
        self.ttl_ms = ttl_ms
        self.refresh_ms = refresh_ms
        self.retry_ms = retry_ms
        self.retry_max_ms = retry_max_ms
        self.batch_size = batch_size
        # Whether the IS takes batches (POST {is}replicas:batch): None until one is tried.
        self._batches: bool | None = None
        self._refreshing = asyncio.Lock()  # one refresh at a time (it holds many key locks)
        self._entries: dict[RecordKey, _Published] = {}
        # Weak: a key's lock lives while a publication or withdrawal holds or awaits it.
        self._locks: weakref.WeakValueDictionary[RecordKey, asyncio.Lock] = weakref.WeakValueDictionary()
        self._withdrawals: set[asyncio.Task[None]] = set()
        store.add_evict_listener(self._on_evict)
        store.add_residency_listener(self._on_residency)

    @property
    def holder_url(self) -> str:
        return self._holder_url() if callable(self._holder_url) else self._holder_url

    # -- TTL -----------------------------------------------------------------------------------

    def remaining_ms(self, key: RecordKey, replica_id: bytes) -> int:
        """The remaining TTL of the replica's record (0 if it has none): the bound on
        ``Cache-Control: max-age`` (§6.7)."""
        entry = self._entries.get(key)
        if entry is None or entry.replica_id != replica_id:
            return 0
        return max(0, entry.expires_ms - self.clock.now_ms())

    # -- publication (§6.1 PUT) ----------------------------------------------------------------

    def record(self, info: ReplicaInfo, ttl_ms: int | None = None) -> ReplicaRecord:
        return info.replica_record(self.holder_url, self.ttl_ms if ttl_ms is None else ttl_ms)

    async def publish(self, key: RecordKey) -> ReplicaRecord | None:
        """Publish (or refresh) the record of the replica now stored under ``key``; the record
        as the IS stored it, or None when it was not published (no IS, the replica is gone or
        incomplete, the IS failed: logged, retried by :meth:`refresh`)."""
        async with self._lock(key):
            info = self.store.get(key)
            if info is None or not info.complete:
                return None
            now = self.clock.now_ms()
            entry = self._entries.get(key)
            if entry is None or entry.replica_id != info.replica_id:
                # Known from now on; with no IS the TTL is local: it bounds max-age all the same.
                entry = _Published(info.replica_id, now + self.ttl_ms, None, False)
                self._entries[key] = entry
            record = self.record(info)
            if self.client is None:
                entry.expires_ms = now + self.ttl_ms
                entry.published_ms = now
                return record
            entry.attempted = True
            self._journal_put(key, info.replica_id)
            try:
                stored = await self.client.publish(record)
            except (IndexUnreachable, IndexRefused) as exc:
                log.warning("publishing %s to the index failed: %s", key, exc)
                return None
            current = self.store.get(key)
            if current is None or current.replica_id != info.replica_id:
                return None  # evicted meanwhile: its withdrawal is queued behind this lock
            entry.expires_ms = now + stored.ttl_ms
            entry.published_ms = now
            return stored

    async def refresh(self) -> int:
        """Republish what is due (§6.1 "refresh records before expiry"): records published
        ``refresh_ms`` ago or more, never-acknowledged ones, and complete replicas not yet
        known. Returns how many were published.

        With a client that has ``publish_many`` (``HttpIndexClient``), due records go in
        batches of ``batch_size`` (one request each: ``POST {is}replicas:batch``); an IS
        without that route (404, 405) gets single PUTs from then on."""
        async with self._refreshing:
            due = self._due()
            publish_many = getattr(self.client, "publish_many", None)
            done = 0
            start = 0
            while start < len(due) and publish_many is not None and self._batches is not False \
                    and self.batch_size > 1:
                chunk = due[start:start + self.batch_size]
                published = await self._publish_batch(publish_many, chunk)
                if published is None:
                    break  # no batch route: single PUTs for this chunk and the rest
                done += published
                start += len(chunk)
            for key in due[start:]:
                if await self.publish(key) is not None:
                    done += 1
            return done

    async def _publish_batch(self, publish_many: Callable[[list[ReplicaRecord]], Awaitable[list[ReplicaRecord]]],
                             keys: list[RecordKey]) -> int | None:
        """Publish the replicas of ``keys`` in one request, holding their locks (ordered
        against withdrawals as :meth:`publish` is); how many were published, or None when
        the IS has no batch route."""
        async with contextlib.AsyncExitStack() as stack:
            for key in keys:
                await stack.enter_async_context(self._lock(key))
            now = self.clock.now_ms()
            items: list[tuple[ReplicaInfo, _Published]] = []
            for key in keys:
                info = self.store.get(key)
                if info is None or not info.complete:
                    continue
                entry = self._entries.get(key)
                if entry is None or entry.replica_id != info.replica_id:
                    entry = _Published(info.replica_id, now + self.ttl_ms, None, False)
                    self._entries[key] = entry
                entry.attempted = True
                self._journal_put(key, info.replica_id)
                items.append((info, entry))
            if not items:
                return 0
            try:
                stored = await publish_many([self.record(info) for info, _ in items])
            except IndexRefused as exc:
                if exc.status in (404, 405):
                    log.info("the index has no batch route (%s): single PUTs from now on", exc.status)
                    self._batches = False
                    return None
                log.warning("publishing %d records to the index failed: %s", len(items), exc)
                return 0
            except IndexUnreachable as exc:
                log.warning("publishing %d records to the index failed: %s", len(items), exc)
                return 0
            self._batches = True
            done = 0
            for (info, entry), record in zip(items, stored):
                current = self.store.get(info.key)
                if current is None or current.replica_id != info.replica_id:
                    continue  # evicted meanwhile: its withdrawal is queued behind the lock
                entry.expires_ms = now + record.ttl_ms
                entry.published_ms = now
                done += 1
            return done

    def _due(self) -> list[RecordKey]:
        now = self.clock.now_ms()
        due: list[RecordKey] = []
        for info in self.store.replicas():
            if not info.complete:
                continue
            if self.include is not None and not self.include(info.key):
                continue
            entry = self._entries.get(info.key)
            if (
                entry is None
                or entry.replica_id != info.replica_id
                or entry.published_ms is None
                or now - entry.published_ms >= self.refresh_ms
            ):
                due.append(info.key)
        return due

    # -- withdrawal (§6.1 DELETE) -----------------------------------------------------------------

    async def withdraw(self, key: RecordKey, replica_id: bytes | None = None) -> bool:
        """Withdraw the record of the replica of ``key`` *before* evicting it, retrying until
        it is withdrawn or has expired at the IS. Afterwards the replica counts as
        unpublished: its eviction sends nothing more. Whether a record had been published."""
        entry = self._entries.get(key)
        if entry is None or (replica_id is not None and entry.replica_id != replica_id):
            return False
        del self._entries[key]
        if entry.attempted:
            await self._withdraw_until_done(key, entry)
        return entry.attempted

    async def flush(self) -> None:
        """Wait until every withdrawal started so far has reached the IS (or given up)."""
        while self._withdrawals:
            await asyncio.gather(*list(self._withdrawals), return_exceptions=True)

    def _on_evict(self, key: RecordKey, replica_id: bytes) -> None:
        """Store evict listener (before the octets go): start the withdrawal now."""
        entry = self._entries.get(key)
        if entry is None or entry.replica_id != replica_id:
            return
        del self._entries[key]
        if not entry.attempted:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            log.error("%s evicted outside the event loop: its record stays until it expires", key)
            return
        task = loop.create_task(self._withdraw_until_done(key, entry))
        self._withdrawals.add(task)
        task.add_done_callback(self._withdrawals.discard)

    def _on_residency(self, key: RecordKey, replica_id: bytes) -> None:
        """Store residency listener: the record's ``residency`` changed; republish soon."""
        entry = self._entries.get(key)
        if entry is not None and entry.replica_id == replica_id:
            entry.published_ms = None  # due at the next refresh

    def _identity(self, key: RecordKey, replica_id: bytes) -> tuple[str, str | None]:
        """The holder and ``moqt_namespace`` naming this replica's record at the IS (§6.1)."""
        holder = self.holder_url
        namespace = key.block_name(replica_id).moqt_namespace() if holder.startswith("moqt:") else None
        return holder, namespace

    def _journal_put(self, key: RecordKey, replica_id: bytes) -> None:
        if self.journal is not None:
            self.journal.put(key, *self._identity(key, replica_id), replica_id)

    async def _withdraw_until_done(self, key: RecordKey, entry: _Published) -> None:
        holder, namespace = self._identity(key, entry.replica_id)
        async with self._lock(key):
            await self._withdraw_record(key, holder, namespace, entry.expires_ms)

    async def _withdraw_record(self, key: RecordKey, holder: str, namespace: str | None, expires_ms: int) -> None:
        """DELETE one record, retrying with backoff while the IS is unreachable and the record
        has not expired there (the caller holds the key's lock); then it leaves the journal."""
        assert self.client is not None
        delay = self.retry_ms
        while True:
            try:
                await self.client.withdraw(key, holder, namespace)
                break
            except IndexRefused as exc:
                log.error("the index refused to withdraw %s: %s", key, exc)
                break
            except IndexUnreachable as exc:
                if self.clock.now_ms() >= expires_ms:
                    log.warning("withdrawal of %s abandoned: its record has expired at the index", key)
                    break
                log.warning("withdrawal of %s failed (%s); retrying in %d ms", key, exc, delay)
            await asyncio.sleep(delay / 1000)
            delay = min(delay * 2, self.retry_max_ms)
        if self.journal is not None:
            self.journal.delete(key, holder, namespace)

    async def withdraw_previous(self) -> int:
        """§6.1 after a restart: withdraw every record the journal lists from the last run whose
        replica this store no longer holds, retrying while the IS is unreachable for up to one
        record TTL (``ttl_ms``: by then the IS has dropped them anyway). A replica still held
        (recovered from a disk tier) keeps its record, and so does an HTTP record whose block
        this store holds another replica of: the two share the record's identity, and the
        refresh publishes the new one. How many DELETEs were sent."""
        if self.journal is None or self.client is None:
            return 0
        expires_ms = self.clock.now_ms() + self.ttl_ms
        sent = 0
        for old in list(self.journal.previous):
            async with self._lock(old.key):
                if self._still_held(old):
                    continue
                await self._withdraw_record(old.key, old.holder, old.moqt_namespace, expires_ms)
                sent += 1
        self.journal.previous = []
        return sent

    def _still_held(self, old: JournalEntry) -> bool:
        info = self.store.get(old.key)
        if info is None:
            return False
        return info.replica_id == old.replica_id or (old.moqt_namespace is None and old.holder == self.holder_url)

    def _lock(self, key: RecordKey) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[key] = lock
        return lock

    # -- lifecycle --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Refresh forever, every ``refresh_ms / 4`` (for the holder's background task)."""
        while True:
            await asyncio.sleep(max(self.refresh_ms / 4, 10) / 1000)
            try:
                await self.refresh()
            except Exception:  # must not stop the loop
                log.exception("refreshing replica records failed")

    def close(self) -> None:
        self.store.remove_evict_listener(self._on_evict)
        self.store.remove_residency_listener(self._on_residency)


async def start_withdrawing_previous(publisher: ReplicaPublisher) -> asyncio.Task[None]:
    """What a role runs at its start, once it serves: :meth:`ReplicaPublisher.withdraw_previous`
    in a task, waited for up to :data:`PREVIOUS_WAIT_S` (with the IS up, the last run's stale
    records are gone before the role serves). How many were withdrawn goes to the log as a
    warning (the last run ended without withdrawing them: it was killed or crashed); a failure
    is logged too (the records expire at the IS anyway). The task (done, or still retrying),
    for the caller to cancel at its close."""

    async def withdraw() -> None:
        try:
            sent = await publisher.withdraw_previous()
        except Exception:  # a background step: logged, never raised into the event loop
            log.exception("withdrawing the records of the last run failed; they expire at the index")
            return
        if sent:
            log.warning("withdrew %d Replica Record(s) left at the index by the last run for replicas "
                        "this store no longer holds (kvsp-draft 6.1)", sent)

    task = asyncio.create_task(withdraw(), name="withdraw the last run's records")
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), PREVIOUS_WAIT_S)
    return task
