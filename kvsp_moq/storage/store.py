"""The holder's block store: replicas in tiers, placement, LRU eviction that honours pins.

One :class:`BlockStore` holds at most one replica per :class:`RecordKey` (kvsp-draft §6.7:
a holder that already has a replica "returns 412 and keeps its copy"). Each layer of a
replica lives in exactly one tier; the tiers are given fastest first (device, host, disk).
See ``docs/storage.md`` for the rules; in short:

- placement of a new replica: lowest layers in the fastest tier, the rest spill downward
  (:mod:`.residency`); room is made by LRU eviction (:mod:`.eviction`);
- a pinned replica (a lease, §6.6) or one being written is never evicted; when nothing can
  be evicted, :class:`StoreFull` is raised and nothing changes;
- every replica that leaves the store, for whatever reason, is announced to the evict
  listeners *before* its octets are released (§6.1: withdraw the record before or
  immediately after evicting), and a replica never loses part of its layers;
- residency changes (moves, demotions) are announced to the residency listeners, so the
  holder can republish the record's ``residency`` (§4.4).

Threading: a store is not thread-safe. It is meant to be used from one thread (the holder's
asyncio event loop); its calls do not await. Disk writes are blocking file I/O; a holder that
cannot afford them on the loop runs the whole store on one worker thread instead. Listeners
run synchronously inside the call that triggered them and must not change the store (reads
with ``touch=False`` are fine).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from ..kvsp.container import (
    VERSION,
    BytesLike,
    Container,
    ContainerHeader,
    decode_container,
    layer_digest,
)
from ..kvsp.errors import ContainerError
from ..kvsp.layout import Geometry, encode_raw_layer
from ..kvsp.records import Residency
from ..kvsp.registries import CODEC_RAW
from .errors import (
    IncompleteReplica,
    LayersUnavailable,
    NotAddressable,
    ReplicaBusy,
    ReplicaExists,
    ReplicaNotFound,
    ReplicaPinned,
    StorageError,
    StoreFull,
)
from .eviction import Evictor
from .keys import RecordKey, check_replica_id, new_replica_id
from .movement import LayerMover, verify_file
from .pins import Clock
from .reader import BlockReader, LayerPart
from .replica import ReplicaInfo, StoredReplica
from .residency import plan_placement
from .sources import Section, as_section, host_view, section_nbytes
from .stats import StoreStats, TierStats
from .tiers import DeviceTier, DiskFile, DiskTier, Extent, Tier
from .writer import BlockWriter, LayerListener, ReplicaWrites

__all__ = ["BlockStore", "EvictListener", "ResidencyListener"]

log = logging.getLogger(__name__)

#: Called with (record key, replica id) before a replica's octets are released.
EvictListener = Callable[[RecordKey, bytes], None]
#: Called with (record key, replica id) after a replica's residency changed.
ResidencyListener = Callable[[RecordKey, bytes], None]


def _notify(listeners: Sequence[Callable[[RecordKey, bytes], None]], key: RecordKey, rid: bytes) -> None:
    for listener in list(listeners):
        try:
            listener(key, rid)
        except Exception:  # a failing listener must not stop the others nor the store
            log.exception("store listener %r failed for %s", listener, key)


class _StoreWrites(ReplicaWrites):
    """The store's side of its :class:`BlockWriter` objects (passed to them, see
    :class:`~.writer.ReplicaWrites`)."""

    __slots__ = ("_store",)

    def __init__(self, store: BlockStore) -> None:
        self._store = store

    def write_layer(self, replica: StoredReplica, layer: int, k: object, v: object) -> bytes:
        return self._store._write_layer(replica, layer, k, v)

    def landing_view(self, replica: StoredReplica, layer: int) -> memoryview | None:
        return self._store._landing_view(replica, layer)

    def commit_layer(self, replica: StoredReplica, layer: int, digest: bytes,
                     staged: memoryview | None) -> bytes:
        return self._store._commit_layer(replica, layer, digest, staged)

    def finish(self, replica: StoredReplica) -> ReplicaInfo:
        return self._store._finish(replica)

    def abort(self, replica: StoredReplica) -> None:
        self._store._abort(replica)


class BlockStore:
    """Replicas of KV blocks in tiers (fastest first). See the module docstring."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        clock: Clock = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self._tiers: tuple[Tier, ...] = tuple(tiers)
        self._clock = clock
        self._wall_clock = wall_clock
        self._by_key: dict[RecordKey, StoredReplica] = {}
        self._evictor = Evictor(self._tiers, self, clock)
        self._mover = LayerMover(self._evictor.sync)
        self._evict_listeners: list[EvictListener] = []
        self._residency_listeners: list[ResidencyListener] = []
        self._hits = self._misses = self._evictions = self._demotions = 0
        self._removals = self._puts = 0
        self._writes = _StoreWrites(self)

    # -- tiers and listeners -------------------------------------------------------------------

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers, fastest first."""
        return self._tiers

    def tier(self, name: str) -> Tier:
        for tier in self._tiers:
            if tier.name == name:
                return tier
        raise KeyError(f"no tier named {name!r}")

    def add_evict_listener(self, listener: EvictListener) -> None:
        """Call ``listener(key, replica_id)`` whenever a replica leaves the store (eviction,
        removal, abort), while its octets are still readable."""
        self._evict_listeners.append(listener)

    def remove_evict_listener(self, listener: EvictListener) -> None:
        self._evict_listeners.remove(listener)

    def add_residency_listener(self, listener: ResidencyListener) -> None:
        """Call ``listener(key, replica_id)`` after layers of a stored replica changed tier."""
        self._residency_listeners.append(listener)

    def remove_residency_listener(self, listener: ResidencyListener) -> None:
        self._residency_listeners.remove(listener)

    # -- lookup ------------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: RecordKey) -> ReplicaInfo | None:
        """The replica of ``key``, or None. Not an access (no LRU update)."""
        replica = self._by_key.get(key)
        return replica.info(self._clock()) if replica is not None else None

    def info(self, key: RecordKey) -> ReplicaInfo:
        """Like :meth:`get`; :class:`ReplicaNotFound` when absent."""
        return self._lookup(key).info(self._clock())

    def replicas(self) -> list[ReplicaInfo]:
        """Every replica, least recently used first."""
        now = self._clock()
        return [r.info(now) for r in self._evictor]

    def residency(self, key: RecordKey) -> tuple[Residency, ...]:
        """The residency entries of the Replica Record (§4.4)."""
        return self._lookup(key).residency()

    def _lookup(self, key: RecordKey, replica_id: bytes | None = None) -> StoredReplica:
        replica = self._by_key.get(key)
        if replica is None or (replica_id is not None and replica.replica_id != replica_id):
            raise ReplicaNotFound(key, replica_id)
        return replica

    # -- storing -----------------------------------------------------------------------------

    def put(
        self,
        key: RecordKey,
        data: BytesLike | Container,
        *,
        replica_id: bytes | None = None,
        geometry: Geometry | None = None,
        expected_layer_digests: Sequence[bytes] | None = None,
    ) -> ReplicaInfo:
        """Store a whole container (§6.7 ``PUT``), copying each section once into its tier.

        The container is validated first (:class:`ContainerError`; with ``geometry`` the raw
        section sizes too, and with ``expected_layer_digests``, indexed by absolute layer as in
        a Replica Record, every layer digest); only then is room made.
        :class:`ReplicaExists` when ``key`` already has a replica (it is kept, §6.7).
        """
        self._check_absent(key)
        if isinstance(data, Container):
            container = decode_container(data.buffer, geometry=geometry) if geometry else data
        else:
            container = decode_container(data, geometry=geometry)
        h = container.header
        sections = [(layer.k, layer.v) for layer in container.layers()]
        return self._put_sections(
            key, h.codec, h.first_layer, h.token_count, sections, replica_id, expected_layer_digests
        )

    def put_layers(
        self,
        key: RecordKey,
        layers: Sequence[tuple[object, object]],
        *,
        token_count: int,
        first_layer: int = 0,
        codec: int = CODEC_RAW.value,
        geometry: Geometry | None = None,
        replica_id: bytes | None = None,
        expected_layer_digests: Sequence[bytes] | None = None,
        known_layer_digests: Sequence[bytes] | None = None,
    ) -> ReplicaInfo:
        """Store decoded layers ``[(K, V), ...]`` from ``first_layer`` on: buffers, torch
        tensors, or (with ``geometry``) numpy arrays ``[tokens, kv_heads, head_dim]``.

        ``known_layer_digests``: the layers' digests (§4.3) as the caller already computed them
        over these very octets (a ``DecodedLayer.digest``, hashed while they arrived): taken as
        they are instead of hashing every layer a second time. Only for octets the caller
        hashed itself; ``expected_layer_digests`` is still checked against them."""
        self._check_absent(key)
        if known_layer_digests is not None and len(known_layer_digests) != len(layers):
            raise ValueError(f"{len(known_layer_digests)} known layer digests for {len(layers)} layers")
        sections = []
        for k, v in layers:
            if geometry is not None and isinstance(k, np.ndarray) and isinstance(v, np.ndarray):
                k, v = encode_raw_layer(k, v, geometry)
            sections.append((as_section(k, "K"), as_section(v, "V")))
        if geometry is not None and codec == CODEC_RAW.value:
            want = geometry.section_bytes(token_count)
            for i, (k, v) in enumerate(sections):
                if section_nbytes(k) != want or section_nbytes(v) != want:
                    raise ContainerError(
                        "lengths", f"layer {first_layer + i}: sections must have {want} octets"
                    )
        return self._put_sections(
            key, codec, first_layer, token_count, sections, replica_id, expected_layer_digests,
            known_layer_digests,
        )

    def begin(
        self,
        key: RecordKey,
        geometry: Geometry,
        layers: int | range,
        tokens: int,
        *,
        replica_id: bytes | None = None,
        on_layer: LayerListener | None = None,
    ) -> BlockWriter:
        """Start a codec-raw replica of ``layers`` (a count from 0, or a range) holding
        ``tokens`` tokens; room for all of it is made now. Returns its :class:`BlockWriter`."""
        if isinstance(layers, int):
            layers = range(layers)
        if layers.step != 1 or len(layers) == 0:
            raise ContainerError("layer_count", "layers must be a non-empty contiguous range")
        section = geometry.section_bytes(tokens)
        lengths = ((section, section),) * len(layers)
        replica = self._begin(key, CODEC_RAW.value, layers.start, tokens, lengths, replica_id)
        writer = BlockWriter(self._writes, replica, geometry)
        if on_layer is not None:
            writer.add_listener(on_layer)
        return writer

    def _check_absent(self, key: RecordKey) -> None:
        existing = self._by_key.get(key)
        if existing is not None:
            raise ReplicaExists(key, existing.replica_id)

    def _put_sections(
        self,
        key: RecordKey,
        codec: int,
        first_layer: int,
        token_count: int,
        sections: Sequence[tuple[Section, Section]],
        replica_id: bytes | None,
        expected: Sequence[bytes] | None,
        known: Sequence[bytes] | None = None,
    ) -> ReplicaInfo:
        lengths = tuple((section_nbytes(k), section_nbytes(v)) for k, v in sections)
        ContainerHeader(VERSION, 0, codec, first_layer, len(lengths), token_count, lengths)
        # Hash before making room: a bad block must not evict anything (one pass, §4.3); the
        # caller's own digests of the same octets when it has them (put_layers).
        digests = list(known) if known is not None else [layer_digest(host_view(k), host_view(v)) for k, v in sections]
        if expected is not None:
            for layer, digest in enumerate(digests, first_layer):
                if layer >= len(expected) or expected[layer] != digest:
                    raise ContainerError("layer_digests", f"layer {layer} does not match its digest")
        replica = self._begin(key, codec, first_layer, token_count, lengths, replica_id)
        try:
            for layer, (k, v), digest in zip(replica.layers, sections, digests):
                self._write_layer(replica, layer, k, v, digest)
            return self._finish(replica)
        except BaseException:
            if not replica.dead:
                self._discard(replica)  # never visible outside this call: nobody to tell
            raise

    def _begin(
        self,
        key: RecordKey,
        codec: int,
        first_layer: int,
        token_count: int,
        lengths: tuple[tuple[int, int], ...],
        replica_id: bytes | None,
        created_at: float | None = None,
    ) -> StoredReplica:
        """Register a replica being written and reserve room for all its layers."""
        self._check_absent(key)
        rid = new_replica_id() if replica_id is None else check_replica_id(replica_id)
        if rid in self._evictor:
            raise ValueError(f"replica id {rid.hex()} is already in use")
        ContainerHeader(VERSION, 0, codec, first_layer, len(lengths), token_count, lengths)
        sizes = [k + v for k, v in lengths]
        plan = plan_placement(sizes, [self._evictor.room(t, enough=sum(sizes)) for t in self._tiers])
        if plan is None:
            raise StoreFull(
                sum(sizes),
                f"{key}: {sum(sizes)} octets do not fit even after evicting every unpinned replica",
            )
        replica = StoredReplica(
            key, rid, codec, first_layer, token_count, lengths,
            self._wall_clock() if created_at is None else created_at,
        )
        self._by_key[key] = replica
        self._evictor.add(replica)
        protect = frozenset({replica})
        try:
            # Slowest tier first: demotions out of a faster tier then land only in space the
            # new replica does not need.
            for index in reversed(range(len(self._tiers))):
                tier = self._tiers[index]
                layers = [layer for layer, t in zip(replica.layers, plan) if t == index]
                if not layers:
                    continue
                self._evictor.make_room(tier, sum(replica.layer_size(l) for l in layers), protect)
                self._mover.allocate(replica, layers, tier)
        except BaseException:
            self._discard(replica)
            raise
        return replica

    def _write_layer(
        self, replica: StoredReplica, layer: int, k: object, v: object, digest: bytes | None = None
    ) -> bytes:
        i = self._unwritten_slot(replica, layer)
        k_sec, v_sec = as_section(k, "K"), as_section(v, "V")
        k_len, v_len = replica.lengths[i]
        if section_nbytes(k_sec) != k_len or section_nbytes(v_sec) != v_len:
            raise ContainerError(
                "lengths",
                f"layer {layer}: got sections of {section_nbytes(k_sec)} and "
                f"{section_nbytes(v_sec)} octets, expected {k_len} and {v_len}",
            )
        if digest is None:
            digest = layer_digest(host_view(k_sec), host_view(v_sec))
        self._mover.write(replica, layer, k_sec, v_sec)
        replica.digests[i] = digest
        return digest

    def _unwritten_slot(self, replica: StoredReplica, layer: int) -> int:
        """The index of ``layer`` in a replica being written, checked: open, in range, not yet written."""
        if replica.dead or not replica.writing:
            raise StorageError(f"{replica.key}: the writer is closed")
        if not isinstance(layer, int) or layer not in replica.layers:
            raise ContainerError("layers", f"layer {layer!r} is not in {replica.layers}")
        i = layer - replica.first_layer
        if replica.digests[i] is not None:
            raise ValueError(f"layer {layer} was already written")
        return i

    def _landing_view(self, replica: StoredReplica, layer: int) -> memoryview | None:
        """A writable view of the location reserved for an unwritten layer when it is host
        memory (a host tier's buffer), else None. Not readable until committed (no digest)."""
        self._unwritten_slot(replica, layer)
        slot = replica.slot(layer)
        assert slot is not None
        location = slot.location
        buf: Any = location.buf if isinstance(location, Extent) else None
        if not isinstance(buf, np.ndarray):
            return None
        return memoryview(buf.data)  # the host tier's uint8 buffer, writable

    def _commit_layer(self, replica: StoredReplica, layer: int, digest: bytes,
                      staged: memoryview | None) -> bytes:
        """Mark ``layer`` written with ``digest``, which the caller computed over its octets as
        they landed: in the view of :meth:`_landing_view` (``staged`` None), or in ``staged``
        (K || V), copied once into the reserved location now. Not hashed again."""
        i = self._unwritten_slot(replica, layer)
        if staged is not None:
            k_len = replica.lengths[i][0]
            return self._write_layer(replica, layer, staged[:k_len], staged[k_len:], digest)
        if self._landing_view(replica, layer) is None:
            raise StorageError(f"{replica.key}: layer {layer} has no landing view to commit")
        replica.digests[i] = digest
        return digest

    def _finish(self, replica: StoredReplica) -> ReplicaInfo:
        if replica.dead or not replica.writing:
            raise StorageError(f"{replica.key}: the writer is closed")
        missing = [layer for layer, d in zip(replica.layers, replica.digests) if d is None]
        if missing:
            raise IncompleteReplica(replica.key, missing)
        try:
            self._mover.seal(replica)
        except OSError:
            self._drop(replica)  # it may have been announced while being written
            raise
        replica.writing = False
        self._puts += 1
        return replica.info(self._clock())

    def _abort(self, replica: StoredReplica) -> None:
        if replica.dead:
            return
        if not replica.writing:
            raise StorageError(f"{replica.key}: the replica is complete; use remove()")
        self._removals += 1
        self._drop(replica)

    # -- reading -----------------------------------------------------------------------------

    def _readable_or_raise(self, key: RecordKey, first: int, last: int, touch: bool) -> StoredReplica:
        replica = self._by_key.get(key)
        if replica is None:
            if touch:
                self._misses += 1
            raise ReplicaNotFound(key)
        ok = all(isinstance(x, int) and not isinstance(x, bool) for x in (first, last))
        if not ok or first > last or not all(replica.readable(l) for l in range(first, last + 1)):
            if touch:
                self._misses += 1
            raise LayersUnavailable(key, first, last, replica.readable_ranges())
        if touch:
            self._hits += 1
            self._evictor.touch(replica)
        return replica

    def open_reader(
        self,
        key: RecordKey,
        first_layer: int | None = None,
        last_layer: int | None = None,
        *,
        chunk_size: int | None = None,
        touch: bool = True,
    ) -> BlockReader:
        """Stream the container of layers ``first_layer..last_layer`` (inclusive; default all)
        (§6.7 ``GET``, ``layers=a-b``). :class:`ReplicaNotFound` without a replica;
        :class:`LayersUnavailable` when a layer of the range is not held (or not written yet).
        ``chunk_size`` caps the size of each yielded view. ``touch`` counts it as an access."""
        replica = self._by_key.get(key)
        first = replica.first_layer if first_layer is None and replica else first_layer
        last = replica.last_layer if last_layer is None and replica else last_layer
        replica = self._readable_or_raise(key, first, last, touch)  # type: ignore[arg-type]
        assert first is not None and last is not None
        lo, hi = first - replica.first_layer, last - replica.first_layer + 1
        header = ContainerHeader(
            VERSION, 0, replica.codec, first, hi - lo, replica.token_count, replica.lengths[lo:hi]
        )
        parts: list[LayerPart] = []
        for layer in range(first, last + 1):
            slot = replica.slot(layer)
            assert slot is not None
            location = slot.location
            # Views are taken now (zero-copy) so that a later eviction cannot pull the octets
            # away; a staged tier (CUDA) is copied one layer at a time while streaming.
            parts.append(location.payload() if location.zero_copy else location)
        full = (first, last) == (replica.first_layer, replica.last_layer) and not replica.writing

        def remember(digest: bytes) -> None:
            replica.container_sha256 = digest

        return BlockReader(
            key, replica.replica_id, header, parts, chunk_size=chunk_size,
            known_sha256=replica.container_sha256 if full else None,
            on_sha256=remember if full else None,
        )

    def layer_views(
        self, key: RecordKey, layer: int, *, allow_disk: bool = False, touch: bool = True
    ) -> tuple[memoryview, memoryview]:
        """Read-only (K, V) views of one layer in host memory (host tier, CPU device tier),
        no copy. A disk layer gives views of the mapped file only with ``allow_disk`` (touching
        them reads the disk). :class:`NotAddressable` for a CUDA layer."""
        replica = self._readable_or_raise(key, layer, layer, touch)
        slot = replica.slot(layer)
        assert slot is not None
        location = slot.location
        if not (location.in_memory or (allow_disk and location.zero_copy)):
            raise NotAddressable(key, layer, location.tier.name, "host memory view")
        payload = location.payload()
        return payload[: slot.k_len], payload[slot.k_len : slot.k_len + slot.v_len]

    def layer_payload(self, key: RecordKey, layer: int, *, touch: bool = True) -> memoryview:
        """K || V of one layer (the binding v1 object payload, whose SHA-256 is the layer
        digest): a view for host memory and disk, a staged copy for a CUDA tier."""
        replica = self._readable_or_raise(key, layer, layer, touch)
        slot = replica.slot(layer)
        assert slot is not None
        return slot.location.payload()

    def layer_tensors(self, key: RecordKey, layer: int, *, touch: bool = True) -> tuple[Any, Any]:
        """(K, V) uint8 tensors of a layer held in a device tier (no copy)."""
        replica = self._readable_or_raise(key, layer, layer, touch)
        slot = replica.slot(layer)
        assert slot is not None
        location = slot.location
        if not (isinstance(location, Extent) and isinstance(location.tier, DeviceTier)):
            raise NotAddressable(key, layer, location.tier.name, "device tensor")
        tensor = location.tier.tensor(location)
        return tensor[: slot.k_len], tensor[slot.k_len : slot.k_len + slot.v_len]

    def container_sha256(self, key: RecordKey) -> bytes:
        """SHA-256 of the full container (``Repr-Digest``, §6.7), computed once and cached."""
        return self.open_reader(key, touch=False).sha256()

    def touch(self, key: RecordKey) -> None:
        """Mark the replica as just used (LRU)."""
        self._evictor.touch(self._lookup(key))

    # -- moving between tiers ------------------------------------------------------------------

    def move(
        self, key: RecordKey, to: str, first_layer: int | None = None, last_layer: int | None = None
    ) -> ReplicaInfo:
        """Move the held layers of ``first_layer..last_layer`` (default all) to tier ``to``,
        evicting other replicas if needed (:class:`StoreFull`, nothing changed, if impossible).
        Not an access; pinned replicas can be moved (a move is not an eviction)."""
        replica, target, layers = self._selection(key, to, first_layer, last_layer)
        rank = self._tiers.index(target)
        return self._move(replica, target, [l for l in layers if self._rank(replica, l) != rank])

    def promote(
        self,
        key: RecordKey,
        to: str | None = None,
        first_layer: int | None = None,
        last_layer: int | None = None,
    ) -> ReplicaInfo:
        """Move the selected layers that are in tiers slower than ``to`` (default: the fastest
        tier) up to ``to``; layers already as fast or faster stay."""
        target_name = to if to is not None else self._tiers[0].name
        replica, target, layers = self._selection(key, target_name, first_layer, last_layer)
        rank = self._tiers.index(target)
        return self._move(replica, target, [l for l in layers if self._rank(replica, l) > rank])

    def demote(
        self,
        key: RecordKey,
        to: str | None = None,
        first_layer: int | None = None,
        last_layer: int | None = None,
    ) -> ReplicaInfo:
        """Move the selected layers that are in tiers faster than ``to`` (default: the slowest
        tier) down to ``to``; layers already as slow or slower stay."""
        target_name = to if to is not None else self._tiers[-1].name
        replica, target, layers = self._selection(key, target_name, first_layer, last_layer)
        rank = self._tiers.index(target)
        return self._move(replica, target, [l for l in layers if self._rank(replica, l) < rank])

    def _rank(self, replica: StoredReplica, layer: int) -> int:
        slot = replica.slot(layer)
        assert slot is not None
        return self._tiers.index(slot.tier)

    def _selection(
        self, key: RecordKey, to: str, first: int | None, last: int | None
    ) -> tuple[StoredReplica, Tier, list[int]]:
        replica = self._lookup(key)
        if replica.writing:
            raise ReplicaBusy(key)
        target = self.tier(to)
        first = replica.first_layer if first is None else first
        last = replica.last_layer if last is None else last
        if first > last or not all(replica.readable(l) for l in range(first, last + 1)):
            raise LayersUnavailable(key, first, last, replica.readable_ranges())
        return replica, target, list(range(first, last + 1))

    def _move(self, replica: StoredReplica, target: Tier, layers: list[int]) -> ReplicaInfo:
        if layers:
            need = sum(replica.layer_size(l) for l in layers)
            self._evictor.make_room(target, need, frozenset({replica}))
            self._mover.relocate(replica, layers, target)
            _notify(self._residency_listeners, replica.key, replica.replica_id)
        return replica.info(self._clock())

    # -- eviction mechanics (driven by the evictor) ----------------------------------------------

    def _demote_for_room(self, victim: StoredReplica, source: Tier, target: Tier) -> None:
        self._mover.relocate(victim, victim.layers_in(source), target)
        self._demotions += 1
        _notify(self._residency_listeners, victim.key, victim.replica_id)

    def _drop_for_room(self, victim: StoredReplica) -> None:
        self._evictions += 1
        self._drop(victim)

    def _drop(self, replica: StoredReplica) -> None:
        """Announce, then unregister and release (§6.1: withdraw before or at eviction)."""
        if replica.dead:
            return
        _notify(self._evict_listeners, replica.key, replica.replica_id)
        self._discard(replica)

    def _discard(self, replica: StoredReplica) -> None:
        """Unregister and release without announcing (for replicas nobody has seen)."""
        if replica.dead:
            return
        replica.dead = True
        if self._by_key.get(replica.key) is replica:
            del self._by_key[replica.key]
        self._evictor.remove(replica)
        self._mover.release_all(replica)

    # -- pins and removal ----------------------------------------------------------------------

    def pin(
        self,
        key: RecordKey,
        owner: Hashable,
        ttl_ms: int | None = None,
        *,
        replica_id: bytes | None = None,
    ) -> ReplicaInfo:
        """Keep the replica of ``key`` from eviction for ``owner`` (a lease id), for ``ttl_ms``
        or until :meth:`unpin` (§6.6). Pinning again renews. With ``replica_id``, only that
        replica (:class:`ReplicaNotFound` if the key now has another one)."""
        replica = self._lookup(key, replica_id)
        if ttl_ms is not None and (not isinstance(ttl_ms, int) or isinstance(ttl_ms, bool) or ttl_ms < 1):
            raise ValueError(f"ttl_ms must be a positive integer, got {ttl_ms!r}")
        now = self._clock()
        replica.pins.add(owner, None if ttl_ms is None else now + ttl_ms / 1000)
        return replica.info(now)

    def unpin(self, key: RecordKey, owner: Hashable) -> bool:
        """Drop ``owner``'s pin; whether there was one (False too when ``key`` is absent)."""
        replica = self._by_key.get(key)
        return replica is not None and replica.pins.remove(owner)

    def is_pinned(self, key: RecordKey) -> bool:
        replica = self._by_key.get(key)
        return replica is not None and replica.pins.active(self._clock())

    def pin_owners(self, key: RecordKey) -> tuple[Hashable, ...]:
        return self._lookup(key).pins.owners(self._clock())

    def remove(self, key: RecordKey, *, replica_id: bytes | None = None, force: bool = False) -> None:
        """Remove the replica of ``key`` (evict listeners are called first).

        :class:`ReplicaPinned` if pinned and :class:`ReplicaBusy` if being written, unless
        ``force`` (a fault: §6.6 "MUST first withdraw the affected replica records", which
        the listeners do before the octets go)."""
        replica = self._lookup(key, replica_id)
        if not force:
            if replica.writing:
                raise ReplicaBusy(key)
            owners = replica.pins.owners(self._clock())
            if owners:
                raise ReplicaPinned(key, owners)
        self._removals += 1
        self._drop(replica)

    # -- statistics, recovery, shutdown --------------------------------------------------------

    def stats(self) -> StoreStats:
        tiers = []
        for tier in self._tiers:
            holding = [r for r in self._by_key.values() if r.bytes_in(tier)]
            tiers.append(TierStats(
                tier.name, tier.kind, tier.capacity, tier.used, len(holding),
                sum(len(r.layers_in(tier)) for r in holding), tier.read_mbit_per_s,
            ))
        now = self._clock()
        replicas = list(self._by_key.values())
        return StoreStats(
            tiers=tuple(tiers),
            replicas=len(replicas),
            writing=sum(r.writing for r in replicas),
            pinned=sum(r.pins.active(now) for r in replicas),
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
            demotions=self._demotions,
            removals=self._removals,
            puts=self._puts,
        )

    def recover(self, *, verify: bool = True) -> list[ReplicaInfo]:
        """Adopt the replica files found in the disk tiers (after a restart).

        A replica comes back with the layers its file holds (layers that were in memory are
        gone; its record still has every layer digest, so ``digest`` stays right). With
        ``verify`` every layer read back is checked against its digest; bad, duplicate or
        unfitting files are removed (and logged). Recovered replicas are least recently used
        in creation order. Call before storing anything.
        """
        found: list[tuple[DiskTier, DiskFile]] = []
        for tier in self._tiers:
            if isinstance(tier, DiskTier):
                found += [(tier, file) for file in tier.scan()]
        found.sort(key=lambda item: (item[1].meta.created_ms, item[1].meta.replica_id))
        recovered: list[StoredReplica] = []
        for tier, file in found:
            meta = file.meta
            existing = self._by_key.get(meta.key)
            mergeable = (
                existing is not None
                and existing.replica_id == meta.replica_id
                and existing.lengths == meta.lengths
                and existing.first_layer == meta.first_layer
                and all(existing.slot(layer) is None for layer in meta.file_layers)
            )
            if (existing is not None and not mergeable) or (existing is None and meta.replica_id in self._evictor):
                log.warning("removing %s: the store already has a replica of that key or id", file)
                tier.discard(file)
                continue
            if verify and not verify_file(file):
                log.warning("removing %s: a layer does not match its digest", file)
                tier.discard(file)
                continue
            try:
                tier.adopt(file)
            except StoreFull:
                log.warning("removing %s: tier %s is full", file, tier.name)
                tier.discard(file)
                continue
            replica = existing
            if replica is None:
                replica = StoredReplica(
                    meta.key, meta.replica_id, meta.codec, meta.first_layer, meta.token_count,
                    meta.lengths, meta.created_ms / 1000,
                )
                replica.digests = list(meta.layer_digests)
                replica.writing = False
                self._by_key[meta.key] = replica
                self._evictor.add(replica)
                recovered.append(replica)
            replica.disk_files[tier] = file
            for layer in meta.file_layers:
                self._mover.place(replica, layer, file.layer(layer))
        now = self._clock()
        return [r.info(now) for r in recovered]

    def close(self) -> None:
        """Abort the writers still open (their temporary files are removed) and release
        memory-tier octets. Sealed disk files stay for :meth:`recover`."""
        for replica in list(self._by_key.values()):
            if replica.writing:
                self._drop(replica)
            else:
                self._forget(replica)
        for tier in self._tiers:
            tier.close()

    def _forget(self, replica: StoredReplica) -> None:
        """Unregister without touching its disk files (shutdown)."""
        replica.dead = True
        del self._by_key[replica.key]
        self._evictor.remove(replica)
        self._mover.release_all(replica, keep_disk_files=True)

    def __repr__(self) -> str:
        tiers = ", ".join(f"{t.name} {t.used}/{t.capacity}" for t in self._tiers)
        return f"BlockStore({len(self._by_key)} replicas; {tiers})"
