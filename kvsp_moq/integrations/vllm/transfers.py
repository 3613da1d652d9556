"""The worker's KVSP transfers, on the client loop (:mod:`.loop`): loads and publications.

Everything here runs on the loop thread and uses the client library as the instance's engine
does (docs/engine.md), so naming, containers, digests and records are never re-implemented:

- :class:`Peers` — the connections of one worker: a MOQT session pool to the relay
  (``bridge.MoqtPool``), a :class:`~kvsp_moq.bridge.MoqtHolder` attached to the relay as a
  publisher over the worker's own :class:`~kvsp_moq.storage.BlockStore`, the IS client, the
  HTTP holder's block fetcher and storer (``control.client.http``).
- :func:`load` — one external block, layer by layer: a MOQT FETCH through the relay
  (``bridge.BlockLoad`` into a :class:`~kvsp_moq.sinks.NumpySink` that verifies each layer's
  digest against the record before exposing it, binding §4.1, kvsp-draft §6.7); layer l is
  offered to vLLM (:class:`Incoming`) the moment it is verified. When MOQT fails at layer l
  (no relay, a refused or tampered layer), layers l..L-1 are fetched from an HTTP replica
  (``client.retrieval.retrieve_block``: Repr-Digest and layer digests verified); when that
  fails too the block is failed (vLLM recomputes it). In the codec the request's
  ``codec_policy`` names (``settings.ConnectorSettings.codec_of``): first the codec's track
  FETCHed through the relay, which transcodes the raw replica (``bridge.transcoding.
  coded_layers``: each layer checked against the relay's coded digests, decoded to the cache's
  dtype), then raw from the first layer that did not come; over HTTP ``codec=n`` (§6.7,
  Repr-Digest), else the replica's codec.
- :func:`begin_block` / :class:`Publications` — a block computed here: a
  ``MoqtHolder.begin`` writer (each layer is published to subscribers as it is written,
  DESIGN.md §4 "layers are published as computed"), sealed once every layer is in; then, in
  the background and at most ``max_saves_in_flight`` at a time, the instance engine's own
  publisher (``control.client.computed.ComputedBlockPublisher.publish_written``): the
  container to the HTTP holder (``PUT blocks/...``, the holder publishes its record) and the
  ``moqt://`` Replica Record naming the relay to the IS, only once the relay accepted the
  namespace (binding §10), refreshed before it expires and withdrawn when the worker's store
  evicts the block (§6.1).
- :func:`stream` — one block of a prefill→decode stream (:mod:`.stream`): SUBSCRIBEd to through
  the relay under the stream's Replica ID (``bridge.subscribe_block``, RENDEZVOUS_TIMEOUT:
  the relay holds the SUBSCRIBE until the producer publishes the namespace), the layers
  produced before the subscription FETCHed, the rest live; each verified against its object's
  LAYER_DIGEST before it is offered (binding §4, case 3), the time it was marked. In the
  codec the request's ``codec_policy`` names, where one is: first the codec's track,
  SUBSCRIBEd through the transcoding relay (docs/binding.md §13: each layer coded as it
  arrives, checked against the LAYER_DIGEST the relay computed, decoded on a worker thread),
  then raw from the first layer that did not come (also when the producer had begun before
  the SUBSCRIBE: the raw path FETCHes past layers, a coded SUBSCRIBE does not).
- Loads in flight are bounded too (``max_loads_in_flight``, :attr:`Peers.load_slots`): the relay
  caps the requests of one session (binding §9).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from ...bridge import BlockLoad, MoqtHolder, MoqtPool, Source, subscribe_block
from ...bridge.transcoding import coded_layers, streamed_coded_layers
from ...control.client.computed import ComputedBlockPublisher, PublicationCounts
from ...control.client.http import HttpBlockFetcher, HttpBlockStorer, HttpIndexClient
from ...control.client.retrieval import BlockFetcher, RetrievalFailed, retrieve_block
from ...control.common.tls import TlsConfig
from ...kvsp.codecs import coded_section_bytes, decode_layer
from ...kvsp.codecs.elements import FLOAT_TYPES
from ...kvsp.codecs.policy import LOSSY_CODECS
from ...kvsp.errors import ContainerError
from ...kvsp.layout import Geometry
from ...kvsp.naming import BlockName
from ...kvsp.records import ReplicaRecord
from ...kvsp.registries import CODEC_RAW, CODECS, CODECS_BY_NAME
from ...pubsub import MoqtSession
from ...sinks import LayerFailed, NumpySink
from ...storage import BlockStore, BlockWriter, HostTier, RecordKey, ReplicaExists
from .settings import ConnectorSettings
from .stream import stream_replica_id

__all__ = ["Incoming", "Peers", "Publications", "begin_block", "load", "seal", "stream"]

log = logging.getLogger(__name__)

MOQT, HTTP, STREAM = "moqt", "http", "stream"


@dataclass
class Peers:
    """One worker's connections and store (module notes); :meth:`open` on the loop."""

    settings: ConnectorSettings
    store: BlockStore
    index: HttpIndexClient | None
    fetcher: HttpBlockFetcher
    storer: HttpBlockStorer | None
    pool: MoqtPool | None = None
    holder: MoqtHolder | None = None
    #: The holder's attachment to the relay (``MoqtHolder.attach_relay_soon``; its result: the
    #: session, or None when the holder closed first).
    attaching: asyncio.Task[MoqtSession | None] | None = None
    #: The publisher of computed blocks (the instance engine's) and what it counted.
    publisher: ComputedBlockPublisher | None = None
    counts: PublicationCounts = field(default_factory=PublicationCounts)
    #: Places for loads in flight (``max_loads_in_flight``).
    load_slots: asyncio.Semaphore = field(default_factory=asyncio.Semaphore)

    @classmethod
    async def open(cls, settings: ConnectorSettings) -> Peers:
        store = BlockStore([HostTier(settings.store_bytes, name="host")])
        index = HttpIndexClient(settings.index_url, settings.index_token, timeout_s=settings.deadline_s) \
            if settings.index_url else None
        fetcher = HttpBlockFetcher(settings.fetch_token or settings.holder_token, timeout_s=settings.deadline_s,
                                   read_timeout_s=settings.deadline_s)
        storer = HttpBlockStorer(settings.holder_token, timeout_s=settings.deadline_s) if settings.holder_url else None
        peers = cls(settings, store, index, fetcher, storer, load_slots=asyncio.Semaphore(settings.max_loads_in_flight))
        if settings.relay_url is not None:
            sizes = {"max_datagram_size": settings.max_datagram_size} if settings.max_datagram_size else {}
            transport = TlsConfig().transport(ca_file=settings.ca_file, insecure=settings.insecure,
                                              purpose="the KVSP connector's MOQT relay", **sizes)
            tokens = (settings.moqt_token,) if settings.moqt_token else ()
            peers.pool = MoqtPool(transport, connect_timeout=settings.moqt_timeout_ms / 1000, setup_tokens=tokens)
            if settings.publish:
                # A relay down now (restarting beside the engine) is attached to in the
                # background, with the holder's reconnect backoff: until then blocks are
                # published to the store and the HTTP holder only (the publisher names the relay only in records of namespaces it accepted).
                holder = MoqtHolder(store, ttl_ms=settings.record_ttl_ms)
                peers.holder = holder
                peers.attaching = holder.attach_relay_soon(settings.relay_url, transport, setup_tokens=tokens)
                done, _ = await asyncio.wait({peers.attaching}, timeout=settings.deadline_s)
                if not done:
                    log.warning("KVSP: relay %s not attached within %g s: publishing over HTTP only until it "
                                "is (attaching in the background)", settings.relay_url, settings.deadline_s)
        if settings.publish:
            peers.publisher = ComputedBlockPublisher(
                store=store, counters=peers.counts, holder_url=settings.holder_url, storer=storer,
                moqt_holder=peers.holder, relay_url=settings.relay_url, index=index,
                record_ttl_ms=settings.record_ttl_ms, index_timeout_s=settings.deadline_s)
            peers.publisher.start()  # the moqt:// records' refresh (§6.1)
        return peers

    @property
    def relay_attached(self) -> bool:
        """The MoqtHolder has a session to the relay (its publications can go over MOQT)."""
        url = self.settings.relay_url
        return self.holder is not None and url is not None and self.holder.relay_session(url) is not None

    async def close(self) -> None:
        for closer in (self.publisher.close if self.publisher else None, self.holder.close if self.holder else None, self.pool.close if self.pool else None,
                       self.index.close if self.index else None, self.fetcher.close,
                       self.storer.close if self.storer else None):
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer()


@dataclass
class Incoming:
    """One block being loaded: layer l's (K, V) in kvsp-layout-1 once verified; ``pages``:
    (page within the block, vLLM's block id) of the pages it fills (``plan.BlockLoad``)."""

    req_id: str
    pages: tuple[tuple[int, int], ...]
    layers: int
    kv: list[tuple[np.ndarray, np.ndarray] | None] = field(default_factory=list)
    ready: list[asyncio.Event] = field(default_factory=list)
    failed_from: int | None = None  # the first layer no source delivered
    octets: dict[str, int] = field(default_factory=dict)
    #: Octets received in a codec other than raw, per way (what crossed the wire).
    coded: dict[str, int] = field(default_factory=dict)
    source: str | None = None
    task: asyncio.Task[None] | None = None
    #: A block of a prefill→decode stream; when each layer was offered (monotonic ns, 0: not yet).
    streamed: bool = False
    arrived_ns: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.kv = [None] * self.layers
        self.ready = [asyncio.Event() for _ in range(self.layers)]
        self.arrived_ns = [0] * self.layers

    @property
    def block_ids(self) -> tuple[int, ...]:
        return tuple(bid for _, bid in self.pages)

    def offer(self, layer: int, k: np.ndarray, v: np.ndarray, via: str, coded_octets: int | None = None) -> None:
        """Layer ``layer``, verified, in the KV cache's element type; ``coded_octets``: the
        octets it crossed the wire as, when it came in a codec other than raw."""
        self.arrived_ns[layer] = time.monotonic_ns()
        self.kv[layer] = (k, v)
        self.octets[via] = self.octets.get(via, 0) + k.nbytes + v.nbytes
        if coded_octets is not None:
            self.coded[via] = self.coded.get(via, 0) + coded_octets
        self.source = via if self.source in (None, via) else "mixed"
        self.ready[layer].set()

    def fail(self, first: int) -> None:
        self.failed_from = first if self.failed_from is None else min(first, self.failed_from)
        for event in self.ready[first:]:
            event.set()

    async def layer(self, layer: int) -> tuple[np.ndarray, np.ndarray] | None:
        await self.ready[layer].wait()
        return self.kv[layer]


def _records(raw: Sequence[Mapping[str, object]], codec: str | None) -> list[ReplicaRecord]:
    """The records that parse and are sources for a load in ``codec`` (None: raw): replicas
    in codec raw; and, over HTTP, replicas stored in ``codec`` itself or in a lossless codec
    (decoded as they arrive). A replica stored in a lossy codec the request's policy did not
    name is never a source (docs/container.md "Codec policy")."""
    wanted = {CODEC_RAW.value, *(c.value for c in CODECS.values() if c.value not in LOSSY_CODECS)}
    if codec is not None:
        wanted.add(CODECS_BY_NAME[codec].value)
    out = []
    for obj in raw:
        try:
            record = ReplicaRecord.from_json(dict(obj))
        except Exception as exc:  # a record the IS sent that does not parse: not a source
            log.warning("KVSP: skipping an invalid replica record: %s", exc)
            continue
        if record.codec == CODEC_RAW.value or (record.codec in wanted and not record.is_moqt):
            out.append(record)
    return out


async def load(peers: Peers, incoming: Incoming, key: RecordKey, raw_records: Sequence[Mapping[str, object]],
               geometry: Geometry, tokens: int, codec: str | None = None) -> None:
    """Load one block into ``incoming`` (module notes), in ``codec`` where the request's
    ``codec_policy`` names one (None: raw), once a place among the loads in flight is free;
    never raises."""
    async with peers.load_slots:
        await _load(peers, incoming, key, raw_records, geometry, tokens, codec)


async def _load(peers: Peers, incoming: Incoming, key: RecordKey, raw_records: Sequence[Mapping[str, object]],
                geometry: Geometry, tokens: int, codec: str | None) -> None:
    if codec is not None and geometry.dtype.name not in FLOAT_TYPES:
        codec = None  # the codecs code fp32/fp16/bf16 elements; an fp8 cache loads raw
    records = [r for r in _records(raw_records, codec) if RecordKey.of(r) == key]
    layers = incoming.layers
    timeout = peers.settings.moqt_timeout_ms / 1000
    next_layer = 0
    moqt = [r for r in records if r.is_moqt and r.layer_digests is not None and len(r.layer_digests) == layers]
    if codec is not None and moqt and peers.pool is not None and coded_section_bytes(codec, geometry, tokens) is not None:
        next_layer = await _coded_from_moqt(peers, incoming, moqt, codec, geometry, tokens)
    if next_layer < layers and moqt and peers.pool is not None:
        first = next_layer
        sink = NumpySink(geometry, tokens, (first, layers - 1), moqt[0].layer_digests or ())
        block_load = BlockLoad(sink, [Source.from_record(r) for r in moqt], pool=peers.pool, timeout=timeout)
        task = asyncio.get_running_loop().create_task(block_load.run())
        try:
            for layer in range(first, layers):
                k, v = await block_load.wait_for_layer(layer)
                incoming.offer(layer, np.asarray(k), np.asarray(v), MOQT)
                next_layer = layer + 1
        except (LayerFailed, Exception) as exc:  # LayerFailed: no MOQT source is left
            log.info("KVSP: block %s: MOQT stopped at layer %d: %s", key.block_key.hex()[:12], next_layer, exc)
        finally:
            if not task.done():
                task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if next_layer < layers:
        http = [r for r in records if not r.is_moqt]
        if http and not await _from_http(peers, incoming, http, next_layer, geometry, tokens, codec):
            incoming.fail(next_layer)
        elif not http:
            incoming.fail(next_layer)


async def _coded_from_moqt(peers: Peers, incoming: Incoming, records: list[ReplicaRecord], codec: str,
                           geometry: Geometry, tokens: int) -> int:
    """Layers of the block in ``codec`` over MOQT: the coded track of a raw replica, FETCHed
    through the relay, which makes it from the raw track (docs/binding.md §13); each layer
    checked against the coded digests the relay declares, decoded (on a worker thread) and
    offered; the FETCH bounded by ``moqt_timeout_ms`` like the raw one. Returns the first layer
    not delivered (0: none; the raw track is loaded then)."""
    assert peers.pool is not None
    url = peers.settings.relay_url or records[0].holder
    name = records[0].block_name()
    if name is None:
        return 0
    done = 0
    try:
        session = await peers.pool.get(url)
        async with contextlib.aclosing(coded_layers(session, name, codec, geometry, 0, incoming.layers - 1,
                                                    timeout=peers.settings.moqt_timeout_ms / 1000,
                                                    decode=asyncio.to_thread)) as layers:
            async for layer in layers:
                incoming.offer(layer.index, layer.k, layer.v, MOQT, coded_octets=layer.coded_octets)
                done = layer.index + 1
    except Exception as exc:  # no transcoding relay, a refused FETCH, a tampered layer: raw then
        log.info("KVSP: block %s: %s over MOQT stopped at layer %d (%s): the raw track from there",
                 name.block_key.hex()[:12], codec, done, exc)
    return done


async def _coded_stream(peers: Peers, incoming: Incoming, name: BlockName, codec: str, geometry: Geometry) -> int:
    """Layers of a streamed block in ``codec``: its coded track SUBSCRIBEd through the relay
    (RENDEZVOUS_TIMEOUT as the raw one), which codes each layer as the producer publishes it
    (docs/binding.md §13); each checked against its LAYER_DIGEST, decoded on a worker thread
    and offered. Returns the first layer not delivered (0 when the producer had begun: the
    raw path, which FETCHes past layers, loads the whole block)."""
    assert peers.pool is not None and peers.settings.relay_url is not None
    done = 0
    deadline = peers.settings.deadline_s
    try:
        session = await peers.pool.get(peers.settings.relay_url)
        async with contextlib.aclosing(streamed_coded_layers(session, name, codec, geometry, 0, incoming.layers - 1,
                                                             timeout=deadline, rendezvous_ms=peers.settings.deadline_ms,
                                                             decode=asyncio.to_thread)) as got:
            async for layer in got:
                incoming.offer(layer.index, layer.k, layer.v, STREAM, coded_octets=layer.coded_octets)
                done = layer.index + 1
    except Exception as exc:  # no transcoding relay, a refused SUBSCRIBE, a tampered layer: raw then
        log.info("KVSP: streamed block %s: %s stopped at layer %d (%s): the raw track from there",
                 name.block_key.hex()[:12], codec, done, exc)
    return done


async def _from_http(peers: Peers, incoming: Incoming, records: list[ReplicaRecord], first: int,
                     geometry: Geometry, tokens: int, codec: str | None = None) -> bool:
    """Layers ``first``.. of the block from an HTTP replica, in ``codec`` where a holder
    transcodes (§6.7 ``codec=n``; Repr-Digest protects it), else in the replica's codec;
    each decoded to the KV cache's element type. False if none delivers."""
    last = incoming.layers - 1
    layers = None if first == 0 else (first, last)
    fetcher = cast(BlockFetcher, peers.fetcher)
    got = None
    if codec is not None:
        try:
            got = await retrieve_block(fetcher, records, layers=layers, codec=CODECS_BY_NAME[codec].value, geometry=None)
        except RetrievalFailed as exc:
            log.info("KVSP: no HTTP replica delivered layers %d-%d in %s: %s; asking for the replicas' codec",
                     first, last, codec, exc)
    if got is None:
        try:
            got = await retrieve_block(fetcher, records, layers=layers, geometry=None)
        except RetrievalFailed as exc:
            log.info("KVSP: no HTTP replica delivered layers %d-%d: %s", first, last, exc)
            return False
    if got.header.token_count != tokens or got.first_layer != first or got.last_layer != last:
        log.warning("KVSP: %s sent layers %d-%d of %d tokens, not %d-%d of %d", got.record.holder,
                    got.first_layer, got.last_layer, got.header.token_count, first, last, tokens)
        return False
    coded = got.header.codec != CODEC_RAW.value
    for lv in got.layers:
        try:
            k, v = decode_layer(got.header.codec, lv.k, lv.v, geometry, tokens)
        except ContainerError as exc:  # verified octets that do not decode: not placed
            log.warning("KVSP: %s: layer %d does not decode: %s", got.record.holder, lv.index, exc)
            return False
        incoming.offer(lv.index, np.asarray(k), np.asarray(v), HTTP,
                       coded_octets=len(lv.k) + len(lv.v) if coded else None)
    return True


async def stream(peers: Peers, incoming: Incoming, key: RecordKey, stream_id: bytes, geometry: Geometry,
                 tokens: int, codec: str | None = None) -> None:
    """Load one block of a prefill→decode stream into ``incoming`` (module notes): its replica
    in the stream ``stream_id`` (:func:`~.stream.stream_replica_id`), through the relay,
    within ``deadline_ms``, in ``codec`` where the request's ``codec_policy`` names one (None:
    raw); never raises. What does not arrive verified fails (vLLM recomputes the block)."""
    layers = incoming.layers
    if peers.pool is None or peers.settings.relay_url is None:
        incoming.fail(0)
        return
    name = BlockName(key.compat_id, key.scope_id, key.block_key, stream_replica_id(stream_id, key))
    first = 0
    if codec is not None and geometry.dtype.name in FLOAT_TYPES and coded_section_bytes(codec, geometry, tokens):
        first = await _coded_stream(peers, incoming, name, codec, geometry)
        if first == layers:
            return
    # digests: the objects' (binding §4)
    sink = NumpySink(geometry, tokens, (first, layers - 1), [None] * (layers - first))
    deadline = peers.settings.deadline_s
    task = asyncio.get_running_loop().create_task(subscribe_block(
        peers.settings.relay_url, name, sink, pool=peers.pool, timeout=deadline,
        rendezvous_ms=peers.settings.deadline_ms))
    # when the subscription is over, what has not arrived never will: its waiters fail
    task.add_done_callback(lambda t: sink.abort_all("the stream ended"))
    layer = first
    try:
        for layer in range(first, layers):
            k, v = await sink.wait_for_layer(layer)
            incoming.offer(layer, np.asarray(k), np.asarray(v), STREAM)
        layer = layers
    except (LayerFailed, Exception) as exc:
        log.info("KVSP: streamed block %s stopped at layer %d: %s", key.block_key.hex()[:12], layer, exc)
        incoming.fail(layer)
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(BaseException):
            await task


def begin_block(peers: Peers, key: RecordKey, geometry: Geometry, layers: int, tokens: int, *,
                replica_id: bytes | None = None) -> BlockWriter | None:
    """A writer for a block computed here (published over MOQT layer by layer when the relay
    link is up); None when the store already holds it or has no room. ``replica_id``: the
    replica's (a stream's id, :mod:`.stream`); None: a fresh random one."""
    try:
        if peers.holder is not None:
            return peers.holder.begin(key, geometry, layers, tokens, replica_id=replica_id)
        return peers.store.begin(key, geometry, layers, tokens, replica_id=replica_id)
    except ReplicaExists:
        return None
    except Exception as exc:  # a full store: this block is not published
        log.warning("KVSP: cannot store block %s: %s", key.block_key.hex()[:12], exc)
        return None


def write_layer(writer: BlockWriter, layer: int, k: np.ndarray, v: np.ndarray) -> None:
    """One computed layer into its writer (on the loop: subscribers get it at once)."""
    if writer.open:
        try:
            writer.write_layer(layer, k, v)
        except Exception as exc:
            log.warning("KVSP: writing layer %d of %s failed: %s", layer, writer.key.block_key.hex()[:12], exc)
            writer.abort()


def seal(writer: BlockWriter) -> bool:
    """Seal a block whose every layer was written (it is then complete in the store, served
    over MOQT); False, the writer aborted, when it is not whole."""
    if not writer.open or writer.missing_layers:
        log.warning("KVSP: block %s not published: %s", writer.key.block_key.hex()[:12],
                    f"layers {writer.missing_layers} missing" if writer.open else "its writer was closed")
        if writer.open:
            writer.abort()
        return False
    try:
        writer.finish()
    except Exception as exc:
        log.warning("KVSP: block %s not sealed: %s", writer.key.block_key.hex()[:12], exc)
        return False
    return True


class Publications:
    """The publications of sealed blocks in the background (module notes): at most ``limit``
    in flight; each one's outcome (the destinations it reached, or its exception) goes to the
    callback given with it."""

    def __init__(self, publisher: ComputedBlockPublisher, limit: int) -> None:
        self.publisher = publisher
        self.limit = limit
        self._tasks: set[asyncio.Task[list[str]]] = set()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def submit(self, key: RecordKey, outcome: Callable[[list[str] | BaseException], None]) -> bool:
        """Start publishing ``key``; False (nothing started) when ``limit`` are in flight."""
        if len(self._tasks) >= self.limit:
            return False
        task = asyncio.get_running_loop().create_task(self.publisher.publish_written(key))

        def done(t: asyncio.Task[list[str]]) -> None:
            self._tasks.discard(t)
            if not t.cancelled():
                outcome(t.exception() or t.result())

        self._tasks.add(task)
        task.add_done_callback(done)
        return True

    async def flush(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until none is in flight; True when none is."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._tasks:  # asyncio.wait, not gather: a timeout must not cancel them
            left = deadline - loop.time()
            if left <= 0:
                return False
            await asyncio.wait(set(self._tasks), timeout=left)
        return True

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
