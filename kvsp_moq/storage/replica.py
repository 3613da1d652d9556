"""A stored replica: its block metadata and, per layer, where the layer lives.

:class:`StoredReplica` is the store's mutable, internal bookkeeping; :class:`ReplicaInfo`
is the immutable snapshot handed to callers, with the members a Replica Record needs
(kvsp-draft §4.4): codec, size, digest, layer digests, residency.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

from ..kvsp.container import FIXED_HEADER_SIZE, LENGTH_ENTRY_SIZE, replica_digest
from ..kvsp.naming import BlockName
from ..kvsp.records import ReplicaRecord, Residency
from .keys import RecordKey
from .pins import PinSet
from .residency import ranges_of, residency_entries
from .tiers import DiskFile, Location, Tier

__all__ = ["LayerSlot", "ReplicaInfo", "StoredReplica"]


@dataclass(slots=True)
class LayerSlot:
    """Where one layer lives: its K || V octets at ``location``."""

    location: Location
    k_len: int
    v_len: int

    @property
    def tier(self) -> Tier:
        return self.location.tier


@dataclass(frozen=True)
class ReplicaInfo:
    """An immutable description of a stored replica.

    ``layer_digests`` and ``lengths`` cover every layer of the replica (``first_layer`` to
    ``last_layer``), whether resident or not; a digest is ``None`` only for a layer not yet
    written. ``residency`` lists the layers that can be read now (§4.4).
    """

    key: RecordKey
    replica_id: bytes
    codec: int
    first_layer: int
    last_layer: int
    token_count: int
    lengths: tuple[tuple[int, int], ...]
    layer_digests: tuple[bytes | None, ...]
    residency: tuple[Residency, ...]
    complete: bool  # every layer written (a writer finished, or put/recovered)
    created_at: float  # wall clock seconds (time.time()) when the replica was created
    pinned: bool

    @property
    def layer_count(self) -> int:
        return self.last_layer - self.first_layer + 1

    @property
    def size(self) -> int:
        """Octets of the container of all its layers (what ``GET`` without ``layers`` returns,
        §6.7; the Replica Record's ``size``)."""
        return FIXED_HEADER_SIZE + LENGTH_ENTRY_SIZE * self.layer_count + self.data_size

    @property
    def data_size(self) -> int:
        """Octets of all K and V sections."""
        return sum(k + v for k, v in self.lengths)

    @cached_property
    def digest(self) -> bytes | None:
        """The replica digest (§4.3) over all layer digests; ``None`` until all are known."""
        if not self.complete:
            return None
        return replica_digest(d for d in self.layer_digests if d is not None)

    @property
    def resident_ranges(self) -> tuple[tuple[int, int], ...]:
        """The inclusive layer ranges held, merged across tiers, ascending."""
        layers = (layer for entry in self.residency for layer in entry.layer_range)
        return tuple(ranges_of(sorted(layers)))

    @property
    def fully_resident(self) -> bool:
        return self.resident_ranges == ((self.first_layer, self.last_layer),)

    def holds_layers(self, first: int, last: int) -> bool:
        """Whether every layer of ``first..last`` (inclusive) can be read (§6.7)."""
        return first <= last and any(a <= first and last <= b for a, b in self.resident_ranges)

    def block_name(self) -> BlockName:
        """The replica's MOQT name (binding v1)."""
        return self.key.block_name(self.replica_id)

    def replica_record(self, holder: str, ttl_ms: int) -> ReplicaRecord:
        """The Replica Record a holder publishes for this replica (§4.4, §6.1).

        ``layer_digests`` is included (it is REQUIRED to serve layer ranges, §4.4) when the
        replica starts at layer 0, since the record lists layer ``l`` at index ``l``. For a
        ``moqt://`` holder ``moqt_namespace`` names this replica (binding v1).
        """
        if not self.complete or self.digest is None:
            raise ValueError("a replica still being written has no record yet")
        digests = tuple(d for d in self.layer_digests if d is not None)
        return ReplicaRecord(
            block_key=self.key.block_key,
            compat_id=self.key.compat_id,
            scope_id=self.key.scope_id,
            holder=holder,
            codec=self.codec,
            size=self.size,
            digest=self.digest,
            layer_digests=digests if self.first_layer == 0 else None,
            residency=self.residency,
            ttl_ms=ttl_ms,
            moqt_namespace=self.block_name().moqt_namespace() if holder.startswith("moqt:") else None,
        )


class StoredReplica:
    """The store's bookkeeping of one replica (internal; single-threaded)."""

    def __init__(
        self,
        key: RecordKey,
        replica_id: bytes,
        codec: int,
        first_layer: int,
        token_count: int,
        lengths: tuple[tuple[int, int], ...],
        created_at: float,
    ) -> None:
        self.key = key
        self.replica_id = replica_id
        self.codec = codec
        self.first_layer = first_layer
        self.token_count = token_count
        self.lengths = lengths
        self.digests: list[bytes | None] = [None] * len(lengths)
        self.slots: list[LayerSlot | None] = [None] * len(lengths)
        self.created_at = created_at
        self.writing = True  # a writer is filling it; not evictable, not movable
        self.dead = False  # removed from the store
        self.tick = 0  # last access (the store's logical clock), for LRU
        self.pins = PinSet()
        self.disk_files: dict[Tier, DiskFile] = {}  # the replica's file per disk tier
        self.container_sha256: bytes | None = None  # SHA-256 of the full container, once known
        self._tier_bytes: dict[Tier, int] = {}

    # -- layers -----------------------------------------------------------------------------

    @property
    def last_layer(self) -> int:
        return self.first_layer + len(self.lengths) - 1

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.last_layer + 1)

    def layer_size(self, layer: int) -> int:
        k_len, v_len = self.lengths[layer - self.first_layer]
        return k_len + v_len

    def slot(self, layer: int) -> LayerSlot | None:
        return self.slots[layer - self.first_layer]

    def set_slot(self, layer: int, slot: LayerSlot | None) -> None:
        """Place (or remove) a layer, keeping the per-tier octet counts."""
        i = layer - self.first_layer
        old = self.slots[i]
        if old is not None:
            self._tier_bytes[old.tier] -= old.k_len + old.v_len
        if slot is not None:
            self._tier_bytes[slot.tier] = self._tier_bytes.get(slot.tier, 0) + slot.k_len + slot.v_len
        self.slots[i] = slot

    def readable(self, layer: int) -> bool:
        """Held and written."""
        i = layer - self.first_layer
        return 0 <= i < len(self.slots) and self.slots[i] is not None and self.digests[i] is not None

    def bytes_in(self, tier: Tier) -> int:
        """Payload octets of this replica in ``tier`` (including layers being written)."""
        return self._tier_bytes.get(tier, 0)

    def layers_in(self, tier: Tier) -> list[int]:
        return [layer for layer, slot in self.placed() if slot.tier is tier]

    def placed(self) -> Iterator[tuple[int, LayerSlot]]:
        """(layer, slot) of every allocated layer, ascending."""
        for i, slot in enumerate(self.slots):
            if slot is not None:
                yield self.first_layer + i, slot

    def readable_ranges(self) -> list[tuple[int, int]]:
        return ranges_of(layer for layer in self.layers if self.readable(layer))

    # -- snapshots --------------------------------------------------------------------------

    def residency(self) -> tuple[Residency, ...]:
        return residency_entries(
            (layer, slot.tier) for layer, slot in self.placed() if self.readable(layer)
        )

    def info(self, now: float) -> ReplicaInfo:
        return ReplicaInfo(
            key=self.key,
            replica_id=self.replica_id,
            codec=self.codec,
            first_layer=self.first_layer,
            last_layer=self.last_layer,
            token_count=self.token_count,
            lengths=self.lengths,
            layer_digests=tuple(self.digests),
            residency=self.residency(),
            complete=all(d is not None for d in self.digests),
            created_at=self.created_at,
            pinned=self.pins.active(now),
        )

    def __repr__(self) -> str:
        state = "writing" if self.writing else "dead" if self.dead else "stored"
        return f"StoredReplica({self.key}, {self.replica_id.hex()[:8]}, {state}, tick={self.tick})"
