"""The octet mechanics of a store: putting layers into tiers and moving them between tiers.

Policy (which layers go where, who is evicted) lives in the store and the evictor; this module
only allocates, copies, seals and releases, keeping three rules:

- every copy is made before the old octets are released, so on an I/O error nothing has
  changed and nothing is lost;
- a replica's disk layers always live in exactly one file per disk tier, which is replaced
  atomically (temporary file, fsync, rename) whenever that set of layers changes;
- stored octets are never rewritten in place, so views handed out earlier stay valid.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from ..kvsp.container import layer_digest
from .replica import LayerSlot, StoredReplica
from .sources import Section
from .tiers import DiskFile, DiskLayer, DiskMeta, DiskTier, Extent, Location, MemoryTier, Tier

__all__ = ["LayerMover", "disk_meta", "verify_file"]

log = logging.getLogger(__name__)


def disk_meta(replica: StoredReplica, file_layers: Sequence[int]) -> DiskMeta:
    """The header of ``replica``'s disk file holding ``file_layers``."""
    return DiskMeta(
        replica.key, replica.replica_id, replica.codec, replica.first_layer,
        replica.token_count, replica.lengths, tuple(replica.digests), tuple(file_layers),
        int(replica.created_at * 1000),
    )


def verify_file(file: DiskFile) -> bool:
    """Whether every layer in a replica file matches its digest (§4.3)."""
    meta = file.meta
    for layer in meta.file_layers:
        i = layer - meta.first_layer
        payload = file.layer(layer).payload()
        k_len = meta.lengths[i][0]
        if layer_digest(payload[:k_len], payload[k_len:]) != meta.layer_digests[i]:
            return False
    return True


class LayerMover:
    """Places and moves layers; ``on_placed(replica)`` runs after each placement (the store
    keeps its per-tier LRU index with it)."""

    def __init__(self, on_placed: Callable[[StoredReplica], None]) -> None:
        self._on_placed = on_placed

    def place(self, replica: StoredReplica, layer: int, location: Location) -> None:
        k_len, v_len = replica.lengths[layer - replica.first_layer]
        replica.set_slot(layer, LayerSlot(location, k_len, v_len))
        self._on_placed(replica)

    def allocate(self, replica: StoredReplica, layers: Sequence[int], tier: Tier) -> None:
        """Reserve ``layers`` of a replica being written in ``tier`` (room already made): an
        extent per layer, or one pending file."""
        if isinstance(tier, DiskTier):
            file = tier.create(disk_meta(replica, layers))
            replica.disk_files[tier] = file
            for layer in layers:
                self.place(replica, layer, file.layer(layer))
            return
        assert isinstance(tier, MemoryTier)
        for layer in layers:
            self.place(replica, layer, tier.allocate(replica.layer_size(layer)))

    @staticmethod
    def write(replica: StoredReplica, layer: int, k: Section, v: Section) -> None:
        """Copy K and V (sizes already checked) into the layer's reserved location."""
        slot = replica.slot(layer)
        assert slot is not None
        location = slot.location
        if isinstance(location, Extent):
            location.tier.write(location, 0, k)
            location.tier.write(location, slot.k_len, v)
        else:
            assert isinstance(location, DiskLayer)
            location.file.write(location.offset, k)
            location.file.write(location.offset + slot.k_len, v)

    @staticmethod
    def seal(replica: StoredReplica) -> None:
        """Make the pending disk files of a finished replica durable (fsync, rename)."""
        for tier, file in replica.disk_files.items():
            if not file.sealed:
                assert isinstance(tier, DiskTier)
                tier.seal(file, disk_meta(replica, file.meta.file_layers))

    def relocate(self, replica: StoredReplica, layers: Sequence[int], target: Tier) -> None:
        """Copy ``layers`` into ``target`` (room already made), switch the slots, then release
        the old copies. On an I/O error nothing has changed."""
        old_slots = [slot for slot in map(replica.slot, layers) if slot is not None]
        if isinstance(target, DiskTier):
            file_layers = sorted([*replica.layers_in(target), *layers])
            payloads = [self._source(replica, layer) for layer in file_layers]
            file = target.write_file(
                disk_meta(replica, file_layers), payloads, replaces=replica.disk_files.get(target)
            )
            replica.disk_files[target] = file
            for layer in file_layers:
                self.place(replica, layer, file.layer(layer))
        else:
            assert isinstance(target, MemoryTier)
            fresh: list[tuple[int, Extent]] = []
            try:
                for layer in layers:
                    extent = target.allocate(replica.layer_size(layer))
                    fresh.append((layer, extent))
                    target.write(extent, 0, self._source(replica, layer))
            except BaseException:
                for _, extent in fresh:
                    target.release(extent)
                raise
            for layer, extent in fresh:
                self.place(replica, layer, extent)
        self._release_moved(replica, old_slots)

    @staticmethod
    def _source(replica: StoredReplica, layer: int) -> Section:
        slot = replica.slot(layer)
        assert slot is not None
        return slot.location.source()

    def _release_moved(self, replica: StoredReplica, slots: Sequence[LayerSlot]) -> None:
        """Free the old copies of moved layers; rewrite (or remove) disk files that lost some."""
        touched: set[DiskTier] = set()
        for slot in slots:
            location = slot.location
            if isinstance(location, Extent):
                location.tier.release(location)
            elif isinstance(location, DiskLayer):
                touched.add(location.tier)
        for disk in touched:
            file = replica.disk_files[disk]
            remaining = replica.layers_in(disk)
            if not remaining:
                disk.discard(file)
                del replica.disk_files[disk]
                continue
            try:
                payloads = [file.layer(layer).payload() for layer in remaining]
                new = disk.write_file(disk_meta(replica, remaining), payloads, replaces=file)
            except OSError as exc:
                # The old file still holds the remaining layers (and the moved ones, now dead
                # weight still counted against the tier); keep it rather than lose anything.
                log.warning("rewriting %s after a move failed (%s); keeping the old file", file, exc)
                continue
            replica.disk_files[disk] = new
            for layer in remaining:
                self.place(replica, layer, new.layer(layer))

    @staticmethod
    def release_all(replica: StoredReplica, *, keep_disk_files: bool = False) -> None:
        """Release every octet of a replica leaving the store. With ``keep_disk_files`` (a
        shutdown) its files stay on disk for recovery and only the accounting is undone."""
        for layer, slot in list(replica.placed()):
            if isinstance(slot.location, Extent):
                slot.location.tier.release(slot.location)
            replica.set_slot(layer, None)
        for disk, file in replica.disk_files.items():
            assert isinstance(disk, DiskTier)
            if keep_disk_files and file.sealed:
                disk.forget(file)
                continue
            try:
                disk.discard(file)
            except OSError as exc:
                log.warning("removing %s failed: %s", file, exc)
        replica.disk_files.clear()
