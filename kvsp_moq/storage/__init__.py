"""The holder's block store (DESIGN.md §2 ``storage/``): replicas of KV blocks in tiers.

Tiers (fastest first): :class:`DeviceTier` (torch tensors, CUDA when present), :class:`HostTier`
(RAM), :class:`DiskTier` (one file per replica). :class:`BlockStore` places replicas, reports
their residency (kvsp-draft §4.4), streams layer ranges as KVB1 containers (§4.3, §6.7),
evicts by LRU without ever touching pinned (leased, §6.6) replicas, and announces every
eviction before the octets go (§6.1). See ``docs/storage.md``.

Imports only ``kvsp_moq.kvsp``, the standard library and numpy; torch is imported lazily by
the device tier.
"""

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
from .keys import REPLICA_ID_SIZE, RecordKey, check_replica_id, new_replica_id
from .reader import BlockReader
from .replica import ReplicaInfo
from .residency import plan_placement, residency_entries
from .stats import StoreStats, TierStats
from .store import BlockStore, EvictListener, ResidencyListener
from .tiers import DeviceTier, DiskTier, HostTier, MemoryTier, Tier
from .writer import BlockWriter, LayerListener, LayerWritten

__all__ = [
    "REPLICA_ID_SIZE",
    "BlockReader",
    "BlockStore",
    "BlockWriter",
    "DeviceTier",
    "DiskTier",
    "EvictListener",
    "HostTier",
    "IncompleteReplica",
    "LayerListener",
    "LayerWritten",
    "LayersUnavailable",
    "MemoryTier",
    "NotAddressable",
    "RecordKey",
    "ReplicaBusy",
    "ReplicaExists",
    "ReplicaInfo",
    "ReplicaNotFound",
    "ReplicaPinned",
    "ResidencyListener",
    "StorageError",
    "StoreFull",
    "StoreStats",
    "Tier",
    "TierStats",
    "check_replica_id",
    "new_replica_id",
    "plan_placement",
    "residency_entries",
]
