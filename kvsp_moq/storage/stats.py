"""Counters and gauges of a block store."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StoreStats", "TierStats"]


@dataclass(frozen=True)
class TierStats:
    name: str
    kind: str  # "device", "host", "disk"
    capacity: int  # payload octets
    used: int
    replicas: int  # replicas with at least one layer here
    layers: int
    read_mbit_per_s: float | None

    @property
    def free(self) -> int:
        return self.capacity - self.used


@dataclass(frozen=True)
class StoreStats:
    tiers: tuple[TierStats, ...]  # fastest first
    replicas: int  # stored, including those being written
    writing: int  # being written
    pinned: int
    hits: int  # reads (open_reader, layer_views, layer_payload) that found their layers
    misses: int  # reads that did not (no replica, or layers not held)
    evictions: int  # replicas dropped to make room
    demotions: int  # (replica, tier) demotions made to make room
    removals: int  # replicas removed on request (remove, abort)
    puts: int  # replicas stored (put, put_layers, finished writers)

    def tier(self, name: str) -> TierStats:
        return next(t for t in self.tiers if t.name == name)

    @property
    def used(self) -> int:
        return sum(t.used for t in self.tiers)
