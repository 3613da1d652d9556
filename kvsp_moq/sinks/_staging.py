"""Pinned host staging for device sinks: a small ring of layer-sized buffers.

The CUDA path (docs/sinks.md) receives a layer's payload into page-locked host memory, verifies
it there (kvsp-draft §4.3 layer digest), and only then copies it to the device asynchronously
on a side stream, recording one event after the copy. A staging buffer is reused as soon as
its copy has completed (``event.query()``), so host memory stays bounded by a few layers
however many layers the block has.

The transfer backend is a :class:`CopyEngine`; :class:`~kvsp_moq.sinks.cuda.CudaCopyEngine` is
the real one, and tests drive the same logic with a CPU stand-in.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count
from typing import Any, Protocol

from ._torch import byte_view
from .errors import SinkError

__all__ = ["CopyEngine", "CopyEvent", "StagingRing", "StagingSlot"]


class CopyEvent(Protocol):
    """What the sink needs of a ``torch.cuda.Event`` recorded after a copy."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class CopyEngine(Protocol):
    """Host-to-device transfer backend of a staged :class:`~kvsp_moq.sinks.TorchSink`."""

    device: Any  # torch.device of the destination tensors

    def alloc_device(self, nbytes: int) -> Any:
        """A flat ``uint8`` tensor of ``nbytes`` on :attr:`device` (the layers' home)."""
        ...

    def alloc_staging(self, nbytes: int) -> Any:
        """A flat, contiguous, page-locked host ``uint8`` tensor of ``nbytes``."""
        ...

    def copy_async(self, dst: Any, src: Any, swap_itemsize: int) -> CopyEvent:
        """Enqueue ``dst.copy_(src)`` (host staging to device) without waiting; when
        ``swap_itemsize`` > 1 also reverse each element's octets on the device (big-endian
        hosts). Return an event recorded after that work."""
        ...

    def stream_wait(self, event: CopyEvent, stream: Any | None) -> None:
        """Make ``stream`` (None: the current stream) wait for ``event`` on the device; the
        host does not block."""
        ...


@dataclass(eq=False)
class StagingSlot:
    tensor: Any  # pinned uint8 host tensor
    view: memoryview  # writable view of its memory
    receiving: bool = False
    copy: CopyEvent | None = None  # the pending device copy reading from this slot
    submitted: int = 0  # submission order, to find the oldest pending copy


class StagingRing:
    """Layer-sized pinned buffers: ``initial`` allocated now, grown on demand to ``maximum``."""

    def __init__(self, engine: CopyEngine, slot_bytes: int, *, initial: int, maximum: int) -> None:
        if not 1 <= initial <= maximum:
            raise SinkError(f"staging slots: need 1 <= initial ({initial}) <= maximum ({maximum})")
        self._engine = engine
        self._slot_bytes = slot_bytes
        self._maximum = maximum
        self._order = count(1)
        self._slots = [self._new_slot() for _ in range(initial)]

    @property
    def slots(self) -> int:
        """Staging buffers allocated (each :attr:`slot_bytes` octets)."""
        return len(self._slots)

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    def acquire(self) -> StagingSlot:
        """A slot to receive one layer into.

        Prefers a slot that is idle or whose copy has completed; else grows the ring up to
        ``maximum``; else waits for the oldest pending copy (bounded by one layer's host-to-
        device time; only reached with more than ``maximum`` layers in flight at once). All
        slots receiving: SinkError.
        """
        for slot in self._slots:
            if not slot.receiving and (slot.copy is None or slot.copy.query()):
                return self._take(slot)
        if len(self._slots) < self._maximum:
            slot = self._new_slot()
            self._slots.append(slot)
            return self._take(slot)
        pending = [s for s in self._slots if not s.receiving]
        if not pending:
            raise SinkError(
                f"all {self._maximum} staging buffers are receiving layers; "
                "raise max_staging_slots for more layers in flight at once"
            )
        oldest = min(pending, key=lambda s: s.submitted)
        assert oldest.copy is not None
        oldest.copy.synchronize()
        return self._take(oldest)

    def release(self, slot: StagingSlot) -> None:
        """The delivery into ``slot`` failed: the slot is free again (no copy was made)."""
        slot.receiving = False

    def submitted(self, slot: StagingSlot, event: CopyEvent) -> None:
        """A copy reading from ``slot`` was enqueued; the slot is free once ``event`` is done."""
        slot.receiving = False
        slot.copy = event
        slot.submitted = next(self._order)

    def _new_slot(self) -> StagingSlot:
        tensor = self._engine.alloc_staging(self._slot_bytes)
        return StagingSlot(tensor, byte_view(tensor))

    @staticmethod
    def _take(slot: StagingSlot) -> StagingSlot:
        slot.receiving = True
        slot.copy = None
        return slot
