"""The PC's state store (DESIGN.md §8): the interface (``base.py``), its records
(``records.py``), the embedded memory store and the Redis store (``shared.py``, with its Lua
scripts in ``scripts.py``), chosen by ``[pc] store`` through :func:`open_pc_store`."""

from __future__ import annotations

from ...common.clock import Clock
from ...common.store import StoreSpec
from .base import PcStore
from .memory import MemoryPcStore
from .records import ABORT, COMMIT, IssuedDirective, PcSnapshot, StoredInstance, StoredReshard, StoredSession
from .shared import RedisPcStore

__all__ = [
    "ABORT", "COMMIT", "IssuedDirective", "MemoryPcStore", "PcSnapshot", "PcStore", "RedisPcStore", "StoredInstance",
    "StoredReshard", "StoredSession", "open_pc_store",
]


def open_pc_store(spec: StoreSpec, clock: Clock | None = None) -> PcStore:
    """The store ``spec`` names: in memory, or Redis (not connected yet: the first call connects)."""
    return MemoryPcStore(clock) if spec.is_memory else RedisPcStore(spec)
