"""Executing prefetch directives at an inference instance (kvsp-draft §6.5, §6.6, §6.7, §6.1).

:class:`PrefetchExecutor` accepts a :class:`PrefetchDirective`, answers at once (the caller
returns 202 with the status resource), and runs the directive as a background task, so a
directive never blocks requests already admitted (§6.5 MUST): the loop only awaits network
I/O, and storing a block is one synchronous copy per section.

For each block in the directive's order that the instance does not already hold (§6.5), with
``blocks_in_flight`` transfers at a time (``[instance] prefetch_blocks_in_flight``, default 4;
the IS lookups, leases and publications run beside them), and a block another directive is
loading awaited rather than loaded twice:

1. the Replica Records of the block are read from the IS (:class:`ReplicaSource`: one
   ``lookup`` for the directive's blocks when the client has it, else per block), and the
   directive's sources are tried in their order, each with its record (digests to verify);
   a source the IS has no record of cannot be verified and is skipped;
2. a lease of ``lease_ms`` is taken at that source (§6.6, ``POST leases``) *before* the
   retrieval, so it cannot evict the block meanwhile; a refused lease (404, 429, ...) moves
   on to the next source;
3. the block is retrieved and verified (§6.7: ``client.retrieval.retrieve_block`` over HTTP —
   Repr-Digest, layer digests, replica digest — or, for a ``moqt://`` holder,
   :func:`retrieve_via_moqt`: ``client.moqt.retrieve_block``, binding v1 FETCH through the
   bridge with the same verification, when the MOQT stack is installed); layers arrive in ascending order
   (``layer_order: "ascending"``, the only order defined) and are stored in that order;
   a failed verification moves on to the next source. A MOQT retriever with ``land``
   (``MoqtBlockRetriever``, the engine's counting one) stores the block itself as it arrives:
   a FETCH with no TRACK_STATUS before it, each layer received into the store's tier and
   verified against the record as it lands (``bridge/landing.py``), nothing assembled;
4. the block is placed in the instance's own tiers (:class:`~kvsp_moq.storage.BlockStore`)
   and its new replica is published to the IS (§6.1, :class:`~.client.publisher.ReplicaPublisher`);
5. the lease is released (``DELETE leases/{id}``), whatever happened.

Codecs (``codec_policy``, ``[instance.codec_policy]``, :mod:`kvsp_moq.kvsp.codecs.policy`): a
block of a scope the policy names a codec for is asked of HTTP holders in that codec (§6.7
``codec=n``; verified by Repr-Digest only, §6.7), stored in it and published with that codec
in its record (§4.4 ``codec``), so a lossy replica is never mistaken for a raw one; a holder
that does not transcode (404) is then asked for the replica's own codec. A replica whose
record names a lossy codec the policy does not name for the scope is not a source (skipped,
with the reason in the directive's error). MOQT sources are loaded in the replica's codec.

``deadline_ms`` runs on the injectable timer: when it passes, loading stops (the task is
cancelled, its lease still released) and the directive is ``partial`` with the keys loaded so
far (§6.5 MUST-like "stops loading and reports partial"). Otherwise the end state is
``complete`` (every block held), ``failed`` (nothing could be loaded) or ``partial``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ...kvsp.codecs.policy import CodecChoice, CodecPolicy
from ...kvsp.errors import ContainerError
from ...kvsp.records import (
    LeaseGrant,
    LeaseRequest,
    LookupRequest,
    LookupResponse,
    PrefetchDirective,
    PrefetchStatus,
    ReplicaRecord,
)
from ...kvsp.records.prefetch import COMPLETE, FAILED, PARTIAL, PENDING
from ...storage import BlockStore, RecordKey, ReplicaExists, StorageError
from ..client.publisher import ReplicaPublisher
from ..client.retrieval import (
    BlockFetcher,
    Landed,
    MoqtRetriever,
    RetrievalFailed,
    Retrieved,
    retrieve_block,
    retrieve_via_moqt,
)
from ..common.clock import Timer
from ..common.errors import LeaseRefused, Overloaded

__all__ = ["LeaseClient", "PrefetchExecutor", "ReplicaSource"]

log = logging.getLogger(__name__)


class ReplicaSource(Protocol):
    """The IS, as the instance reads it: the unexpired records of one block."""

    async def replicas(self, key: RecordKey) -> list[ReplicaRecord]:
        ...


class LeaseClient(Protocol):
    """Leases at holders (§6.6)."""

    async def lease(self, holder: str, request: LeaseRequest) -> LeaseGrant:
        """``POST {holder}leases``; :class:`LeaseRefused` if not granted."""
        ...

    async def release(self, holder: str, lease: str) -> None:
        """``DELETE {holder}leases/{lease}`` (errors are the caller's to log)."""
        ...


@dataclass
class DirectiveRun:
    """One directive's progress: what GET on its status resource returns."""

    directive: PrefetchDirective
    state: str = PENDING
    loaded: list[bytes] = field(default_factory=list)
    error: str | None = None
    task: asyncio.Task[None] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def status(self) -> PrefetchStatus:
        return PrefetchStatus(directive=self.directive.directive, state=self.state, loaded=tuple(self.loaded), error=self.error)


class PrefetchExecutor:
    """Runs directives in the background and keeps their status (the last ``max_directives``)."""

    def __init__(
        self,
        *,
        store: BlockStore,
        publisher: ReplicaPublisher | None,
        replicas: ReplicaSource,
        leases: LeaseClient,
        fetcher: BlockFetcher,
        timer: Timer,
        max_directives: int = 1024,
        max_running: int = 64,
        moqt_retriever: MoqtRetriever | None = None,
        blocks_in_flight: int = 4,
        codec_policy: CodecPolicy | None = None,
    ) -> None:
        if blocks_in_flight < 1:
            raise ValueError(f"blocks_in_flight must be at least 1, got {blocks_in_flight}")
        self.store = store
        self.publisher = publisher
        self.replicas = replicas
        self.leases = leases
        self.fetcher = fetcher
        self.timer = timer
        self.max_directives = max_directives
        #: Directives running at once (a peer's flood of directives must not start unbounded work).
        self.max_running = max_running
        self.moqt_retriever = moqt_retriever
        #: Blocks of one directive retrieved at once (``[instance] prefetch_blocks_in_flight``):
        #: each retrieval waits a round trip or more before its first byte, so a few in flight
        #: keep the path busy; over MOQT they are FETCHes of their own on one session per source.
        self.blocks_in_flight = blocks_in_flight
        #: The codec blocks are loaded in, per scope (lossy only where configured).
        self.codec_policy = codec_policy if codec_policy is not None else CodecPolicy()
        self._runs: OrderedDict[uuid.UUID, DirectiveRun] = OrderedDict()
        #: Blocks being loaded now, with the outcome other directives naming them await.
        self._loading: dict[RecordKey, asyncio.Future[str | None]] = {}
        #: Told each directive's end state and its duration in seconds (``instance/metrics.py``),
        #: before its ``done`` is set.
        self.on_finished: Callable[[str, float], None] | None = None

    def get(self, directive: uuid.UUID) -> DirectiveRun | None:
        return self._runs.get(directive)

    def by_request_ref(self, request_ref: str) -> list[DirectiveRun]:
        """The kept directives carrying ``request_ref`` (§6.5: it lets the PC associate the
        directive with the request it routes), oldest first."""
        return [run for run in self._runs.values() if run.directive.request_ref == request_ref]

    @property
    def running(self) -> int:
        return sum(1 for r in self._runs.values() if not r.done.is_set())

    def start(self, directive: PrefetchDirective) -> DirectiveRun:
        """Accept ``directive`` and start it; the same directive id again is the same run."""
        run = self._runs.get(directive.directive)
        if run is not None:
            return run
        if self.running >= self.max_running:
            raise Overloaded(f"{self.running} prefetch directives are running (max_running_directives)")
        run = DirectiveRun(directive)
        self._runs[directive.directive] = run
        self._forget_old()
        run.task = asyncio.get_running_loop().create_task(self._run(run), name=f"prefetch {directive.directive}")
        return run

    def _forget_old(self) -> None:
        while len(self._runs) > self.max_directives:
            oldest = next((k for k, r in self._runs.items() if r.done.is_set()), None)
            if oldest is None:
                return
            del self._runs[oldest]

    async def close(self) -> None:
        tasks = [r.task for r in self._runs.values() if r.task is not None and not r.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- one directive ---------------------------------------------------------------------------

    async def _run(self, run: DirectiveRun) -> None:
        started = time.perf_counter()
        work = asyncio.create_task(self._load_all(run))
        deadline = asyncio.create_task(self.timer.sleep_ms(run.directive.deadline_ms))
        try:
            await asyncio.wait({work, deadline}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # §6.5: the deadline expired: stop loading, report partial
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                run.state, run.error = PARTIAL, f"deadline of {run.directive.deadline_ms} ms expired"
                return
            failures = work.result()
            if not failures:
                run.state = COMPLETE
            else:
                run.state = FAILED if not run.loaded else PARTIAL
                run.error = "; ".join(failures)[:4000]
        except asyncio.CancelledError:
            work.cancel()
            run.state, run.error = PARTIAL, "the instance stopped"
            raise
        except Exception as exc:  # a bug: report it rather than stay pending forever
            log.exception("prefetch directive %s failed", run.directive.directive)
            run.state, run.error = FAILED, f"{type(exc).__name__}: {exc}"
        finally:
            deadline.cancel()
            if self.on_finished is not None:
                self.on_finished(run.state, time.perf_counter() - started)
            run.done.set()

    async def _load_all(self, run: DirectiveRun) -> list[str]:
        """Load every block of the directive not already held (§6.5 "each block it does not
        already hold"), ``blocks_in_flight`` at a time; ``run.loaded`` keeps directive order."""
        d = run.directive
        gate = asyncio.Semaphore(self.blocks_in_flight)
        known = await self._records_of(d)

        async def one(block_key: bytes, sources: Sequence[str]) -> str | None:
            key = RecordKey(d.compat_id, d.scope_id, block_key)
            loading = self._loading.get(key)
            if loading is not None:  # another directive is loading it: its outcome is ours
                error = await asyncio.shield(loading)
                if error is not None:
                    return error
            elif key not in self.store:
                error = await self._load_once(key, lambda: self._load_block(d, key, sources, gate,
                                                                            known.get(block_key)))
                if error is not None:
                    return error
            run.loaded.append(block_key)  # progress, visible in the directive's status
            return None

        errors = await asyncio.gather(*(one(b.block_key, b.sources) for b in d.blocks))
        order = {b.block_key: i for i, b in enumerate(d.blocks)}
        run.loaded.sort(key=order.__getitem__)
        return [f"{b.block_key.hex()}: {e}" for b, e in zip(d.blocks, errors) if e is not None]

    async def _records_of(self, d: PrefetchDirective) -> dict[bytes, list[ReplicaRecord]]:
        """The records of the directive's blocks from ONE IS lookup (§6.2: the leading blocks
        with a replica, in order) when the IS client has ``lookup``; the blocks it does not
        cover (after the first miss, or when it fails) are read one by one (``replicas``)."""
        lookup = getattr(self.replicas, "lookup", None)
        keys = tuple(dict.fromkeys(b.block_key for b in d.blocks
                                   if RecordKey(d.compat_id, d.scope_id, b.block_key) not in self.store))
        if lookup is None or len(keys) < 2:
            return {}
        request = LookupRequest(scope_id=d.scope_id, compat_id=d.compat_id, block_keys=keys)
        try:
            answer = await lookup(request)
        except Exception as exc:  # the per-block reads say what is wrong, block by block
            log.info("directive %s: one lookup for its blocks failed (%s); reading them one by one",
                     d.directive, exc)
            return {}
        if not isinstance(answer, LookupResponse) or not answer.answers(request):
            return {}
        return {block.block_key: list(block.replicas) for block in answer.blocks}

    async def _load_once(self, key: RecordKey, load: Callable[[], Awaitable[str | None]]) -> str | None:
        """``load()``, known to other directives while it runs (a block landing over MOQT is in
        the store before it is complete: they wait for this outcome instead)."""
        outcome: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._loading[key] = outcome
        error: str | None = "the load was cancelled"
        try:
            error = await load()
            return error
        finally:
            del self._loading[key]
            outcome.set_result(error)

    async def _load_block(self, d: PrefetchDirective, key: RecordKey, sources: Sequence[str],
                          gate: asyncio.Semaphore, known: list[ReplicaRecord] | None = None) -> str | None:
        """Load one block from the first source that works; ``None`` or why it failed. Only
        the transfer holds a place of ``gate`` (the directive's window of blocks in flight):
        the IS lookup, the lease and the publication of the new replica run beside it."""
        found = known if known is not None else await self.replicas.replicas(key)
        records = {r.holder: r for r in found}
        reasons: list[str] = []
        choice = self.codec_policy.choose(key.scope_id)
        for source in sources:
            record = records.get(source)
            if record is None:
                reasons.append(f"{source}: no replica record at the index")
                continue
            if not self.codec_policy.accepts(record.codec, key.scope_id):
                reasons.append(f"{source}: the replica is in lossy codec {record.codec}, which the "
                               f"codec policy does not allow for this scope ({choice.reason})")
                continue
            if source.startswith("moqt:"):
                # MOQT sources have no HTTP lease endpoint; the bridge retrieves and verifies.
                land = getattr(self.moqt_retriever, "land", None)
                try:
                    async with gate:
                        if land is not None:  # straight into the store, layer by layer
                            landed = await land([record], self.store, key)
                        else:
                            retrieved = await retrieve_via_moqt([record], self.moqt_retriever)
                except RetrievalFailed as exc:
                    reasons.append(f"{source}: {exc}")
                    continue
                error = await (self._landed(key, landed) if land is not None else self._place(key, retrieved))
                if error is None:
                    return None
                reasons.append(f"{source}: {error}")
                continue
            request = LeaseRequest(block_keys=(key.block_key,), compat_id=key.compat_id, scope_id=key.scope_id, ttl_ms=d.lease_ms)
            try:
                grant = await self.leases.lease(source, request)  # §6.6: before the retrieval
            except LeaseRefused as exc:
                reasons.append(f"{source}: lease refused: {exc}")
                continue
            try:
                try:
                    async with gate:
                        retrieved = await self._retrieve(record, choice)  # §6.7, verified
                except RetrievalFailed as exc:
                    reasons.append(f"{source}: {exc}")
                    continue
                error = await self._place(key, retrieved)
                if error is None:
                    return None
                reasons.append(f"{source}: {error}")
            finally:
                await self._release(source, grant.lease)
        return "; ".join(reasons) or "no sources"

    async def _retrieve(self, record: ReplicaRecord, choice: CodecChoice) -> Retrieved:
        """The block from ``record``'s HTTP holder in the policy's codec (§6.7 ``codec=n``),
        else, when that holder does not have it in that codec (404), in the replica's own."""
        codec = choice.value
        if codec is None or codec == record.codec:
            return await retrieve_block(self.fetcher, [record])
        try:
            retrieved = await retrieve_block(self.fetcher, [record], codec=codec)
        except RetrievalFailed as exc:
            if not all(a.outcome == "miss" for a in exc.attempts):
                raise
            log.info("block %s: %s does not serve codec %d (%s); loading codec %d",
                     record.block_key.hex(), record.holder, codec, choice.reason, record.codec)
            return await retrieve_block(self.fetcher, [record])
        log.info("block %s loaded in codec %d from %s (%s)", record.block_key.hex(), codec, record.holder, choice.reason)
        return retrieved

    async def _landed(self, key: RecordKey, landed: Landed) -> str | None:
        """A block the MOQT retriever stored itself (``land``): publish its new replica (§6.1);
        None when the store already held the block (loaded meanwhile)."""
        if landed.info is not None and self.publisher is not None:
            await self.publisher.publish(key)
        return None

    async def _place(self, key: RecordKey, retrieved: Retrieved) -> str | None:
        """Store the verified layers in the instance's tiers and publish the replica (§6.1)."""
        h = retrieved.header
        try:
            self.store.put_layers(
                key, [(layer.k, layer.v) for layer in retrieved.layers],
                token_count=h.token_count, first_layer=h.first_layer, codec=h.codec,
                # hashed by the decoder as the octets arrived (§4.3): not hashed a second time
                known_layer_digests=[layer.digest for layer in retrieved.layers],
            )
        except ReplicaExists:
            return None  # loaded meanwhile (another directive)
        except (StorageError, ContainerError) as exc:
            return f"cannot store: {exc}"
        if self.publisher is not None:
            await self.publisher.publish(key)
        return None

    async def _release(self, holder: str, lease: str) -> None:
        try:
            await self.leases.release(holder, lease)
        except Exception as exc:  # the lease then expires at the holder after lease_ms
            log.warning("releasing lease %s at %s failed: %s", lease, holder, exc)
