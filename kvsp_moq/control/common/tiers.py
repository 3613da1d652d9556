"""The block store a holder or an instance runs on, built from its configured tiers
(``[[holder.tiers]]``, ``[[instance.tiers]]``)."""

from __future__ import annotations

from collections.abc import Sequence

from ...storage import BlockStore, DeviceTier, DiskTier, HostTier, Tier
from .clock import Clock
from .config import TierConfig

__all__ = ["build_store"]


def build_store(tiers: Sequence[TierConfig], clock: Clock) -> BlockStore:
    """A block store with the configured tiers (fastest first), on ``clock`` (the store's
    pins and LRU read seconds; leases read the same clock in milliseconds, so a lease and its
    pins expire together)."""
    built: list[Tier] = []
    for tier in tiers:
        name = tier.name or tier.kind
        if tier.kind == "host":
            built.append(HostTier(tier.capacity, read_mbit_per_s=tier.read_mbit_per_s, name=name))
        elif tier.kind == "disk":
            assert tier.path is not None
            built.append(DiskTier(tier.path, tier.capacity, read_mbit_per_s=tier.read_mbit_per_s, name=name))
        else:
            built.append(DeviceTier(tier.capacity, device=tier.device, read_mbit_per_s=tier.read_mbit_per_s, name=name))
    return BlockStore(built, clock=lambda: clock.now_ms() / 1000)
