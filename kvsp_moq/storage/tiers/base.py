"""What every storage tier offers the store: a byte budget, a read rate, and locations.

A *location* holds one layer of one replica: its K section followed by its V section
(K || V, so the SHA-256 of the location's octets is the layer digest, kvsp-draft §4.3, and
the octets are the MOQT object payload of binding v1). Memory tiers (device, host) give every
layer its own :class:`Extent`; the disk tier keeps all the disk layers of a replica in one
file (see :mod:`.disk`).

Capacities count payload octets (K and V sections); the few octets of per-file headers are
not counted. The store guarantees room before it allocates, so a charge beyond the capacity
is a bug and raises :class:`~kvsp_moq.storage.errors.StoreFull`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from ..errors import StoreFull
from ..sources import Section

__all__ = ["Extent", "Location", "MemoryTier", "Tier"]


class Tier(ABC):
    """A storage tier with a byte ``capacity`` and an optional ``read_mbit_per_s``, the rate
    reported in Replica Record residency entries (§4.4) and used by placement (§6.4)."""

    kind: ClassVar[str]

    def __init__(self, name: str, capacity: int, read_mbit_per_s: float | None) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"tier capacity must be an integer >= 0, got {capacity!r}")
        if read_mbit_per_s is not None and not read_mbit_per_s > 0:
            raise ValueError(f"read_mbit_per_s must be > 0, got {read_mbit_per_s!r}")
        self.name = name
        self.capacity = capacity
        self.read_mbit_per_s = read_mbit_per_s
        self._used = 0

    @property
    def used(self) -> int:
        """Payload octets held (or reserved for layers still being written)."""
        return self._used

    @property
    def free(self) -> int:
        return self.capacity - self._used

    def charge(self, nbytes: int) -> None:
        """Count ``nbytes`` more payload octets as held (tier implementations call this when
        they allocate): StoreFull beyond :attr:`free`."""
        if nbytes > self.free:
            raise StoreFull(nbytes, f"tier {self.name!r}: {nbytes} octets exceed the {self.free} free")
        self._used += nbytes

    def credit(self, nbytes: int) -> None:
        """Give back ``nbytes`` octets charged earlier (tier implementations, on release)."""
        assert 0 <= nbytes <= self._used, (nbytes, self._used)
        self._used -= nbytes

    def close(self) -> None:
        """Release resources held by the tier itself (not the replicas)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, used={self._used}, capacity={self.capacity})"


class Location(ABC):
    """Where the K || V octets of one layer live."""

    __slots__ = ()

    tier: Tier
    nbytes: int

    @property
    @abstractmethod
    def in_memory(self) -> bool:
        """Whether :meth:`payload` is a zero-copy view of host RAM."""

    @property
    def zero_copy(self) -> bool:
        """Whether :meth:`payload` is a view (of RAM or of a mapped file), not a copy."""
        return self.in_memory

    @abstractmethod
    def payload(self) -> memoryview:
        """The K || V octets as a read-only host-memory view: zero-copy for host memory and
        mapped files, a staged copy for accelerator memory."""

    def source(self) -> Section:
        """The best source to copy the layer from (a tensor for a device tier)."""
        return self.payload()


class Extent(Location):
    """One layer in a memory tier: a buffer of ``nbytes`` octets owned by ``tier``."""

    __slots__ = ("tier", "nbytes", "buf", "released")

    def __init__(self, tier: MemoryTier, nbytes: int, buf: Any) -> None:
        self.tier: MemoryTier = tier
        self.nbytes = nbytes
        self.buf = buf  # numpy uint8 array (host) or torch uint8 tensor (device)
        self.released = False

    @property
    def in_memory(self) -> bool:
        return self.tier.host_addressable

    def payload(self) -> memoryview:
        return self.tier.payload(self)

    def source(self) -> Section:
        return self.tier.source(self)


class MemoryTier(Tier):
    """A tier of per-layer buffers (host RAM, accelerator memory)."""

    #: Whether extents are host memory that :meth:`payload` views without copying.
    host_addressable: bool = True

    def allocate(self, nbytes: int) -> Extent:
        """A buffer for one layer; charges ``nbytes`` to the tier."""
        self.charge(nbytes)
        try:
            return Extent(self, nbytes, self._new_buffer(nbytes))
        except BaseException:
            self.credit(nbytes)
            raise

    def release(self, extent: Extent) -> None:
        """Give the octets back. Views handed out earlier keep the buffer alive (it is never
        written again), so a reader streaming an evicted layer still sees the right octets."""
        if extent.released:
            return
        extent.released = True
        self.credit(extent.nbytes)

    @abstractmethod
    def _new_buffer(self, nbytes: int) -> Any: ...

    @abstractmethod
    def write(self, extent: Extent, offset: int, section: Section) -> None:
        """Copy ``section`` into ``extent`` at ``offset`` (one copy)."""

    @abstractmethod
    def payload(self, extent: Extent) -> memoryview: ...

    def source(self, extent: Extent) -> Section:
        return self.payload(extent)
