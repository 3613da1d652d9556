"""Storage tiers, fastest first: device (accelerator memory), host (RAM), disk (files).

The device tier imports torch lazily (only when one is created)."""

from .base import Extent, Location, MemoryTier, Tier
from .device import DeviceTier
from .disk import DiskFile, DiskLayer, DiskMeta, DiskTier
from .host import HostTier

__all__ = [
    "DeviceTier",
    "DiskFile",
    "DiskLayer",
    "DiskMeta",
    "DiskTier",
    "Extent",
    "HostTier",
    "Location",
    "MemoryTier",
    "Tier",
]
