"""Errors of the block store (``kvsp_moq.storage``).

Each error names the replica it concerns so that the HTTP layer can map it to a status and a
problem type without parsing messages:

- :class:`ReplicaNotFound` -> 404 (a cache miss, kvsp-draft §6.1: "treat a 404 from a holder
  as a cache miss");
- :class:`LayersUnavailable` -> 404 ``kvsp-layers-unavailable`` (§6.7);
- :class:`ReplicaExists` -> 412 for ``PUT`` with ``If-None-Match: *`` (§6.7: the holder
  "returns 412 and keeps its copy");
- :class:`StoreFull` -> 507 (ours): nothing unpinned is left to evict (§6.6 forbids evicting
  leased replicas).

Malformed containers raise :class:`kvsp_moq.kvsp.errors.ContainerError` (a ``ValueError``),
never a storage error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .keys import RecordKey

__all__ = [
    "IncompleteReplica",
    "LayersUnavailable",
    "NotAddressable",
    "ReplicaBusy",
    "ReplicaExists",
    "ReplicaNotFound",
    "ReplicaPinned",
    "StorageError",
    "StoreFull",
]


class StorageError(Exception):
    """Base of every error raised by the block store."""


class ReplicaNotFound(StorageError, LookupError):
    """The store holds no replica for ``key`` (or not the one with ``replica_id``)."""

    def __init__(self, key: RecordKey, replica_id: bytes | None = None) -> None:
        self.key = key
        self.replica_id = replica_id
        which = f" with replica id {replica_id.hex()}" if replica_id is not None else ""
        super().__init__(f"no replica of {key}{which}")


class ReplicaExists(StorageError):
    """A replica for ``key`` is already stored (or being written); the store keeps it (§6.7)."""

    def __init__(self, key: RecordKey, replica_id: bytes) -> None:
        self.key = key
        self.replica_id = replica_id  # the replica that is kept
        super().__init__(f"{key} already has replica {replica_id.hex()}")


class LayersUnavailable(StorageError, LookupError):
    """Some layer of the inclusive range ``first..last`` is not held (§6.7
    ``kvsp-layers-unavailable``). ``available`` lists the inclusive ranges that are."""

    def __init__(
        self, key: RecordKey, first: int, last: int, available: Sequence[tuple[int, int]]
    ) -> None:
        self.key = key
        self.first = first
        self.last = last
        self.available = tuple(available)
        held = ", ".join(f"{a}-{b}" for a, b in self.available) or "none"
        super().__init__(f"{key}: layers {first}-{last} are not all held (held: {held})")


class StoreFull(StorageError):
    """``needed`` octets do not fit: every octet that could be freed belongs to a pinned
    replica or to a replica still being written. Nothing was changed."""

    def __init__(self, needed: int, message: str) -> None:
        self.needed = needed
        super().__init__(message)


class ReplicaPinned(StorageError):
    """A pinned (leased) replica cannot be removed without ``force`` (§6.6)."""

    def __init__(self, key: RecordKey, owners: Sequence[object]) -> None:
        self.key = key
        self.owners = tuple(owners)
        super().__init__(f"{key} is pinned by {', '.join(map(repr, self.owners))}")


class ReplicaBusy(StorageError):
    """The replica is still being written; the operation needs a complete replica."""

    def __init__(self, key: RecordKey) -> None:
        self.key = key
        super().__init__(f"{key} is still being written")


class IncompleteReplica(StorageError):
    """``finish()`` was called before every layer was written."""

    def __init__(self, key: RecordKey, missing: Sequence[int]) -> None:
        self.key = key
        self.missing = tuple(missing)
        super().__init__(f"{key}: layers {list(self.missing)} were not written")


class NotAddressable(StorageError):
    """The layer is held, but in a tier that cannot give the requested view (host memory
    views of a CUDA tier, tensors of a host tier, disk without ``allow_disk``)."""

    def __init__(self, key: RecordKey, layer: int, tier: str, wanted: str) -> None:
        self.key = key
        self.layer = layer
        self.tier = tier
        super().__init__(f"{key}: layer {layer} is in tier {tier!r}, which gives no {wanted}")
