"""A layer sink into preallocated torch tensors: CPU in place, CUDA through pinned staging.

Memory: one flat ``uint8`` tensor holds all layers; layer ``l``'s slice is its binding-v1
payload K || V (kvsp-layout-1, kvsp-draft §4.3) and is viewed as ``[2, tokens, kv_heads,
head_dim]`` of the descriptor's dtype (``torch_name`` of §11.2.3: bf16, fp16, fp32,
float8_e4m3fn, float8_e5m2, int8); K = block[0] and V = block[1] are views.

- CPU (``device="cpu"``, the default): the transport writes the payload straight into the
  tensor's storage; verified layers are used in place: zero copies after receipt.
- CUDA (``device="cuda[:i]"``): the payload lands in a pinned host staging buffer from a small
  ring (:mod:`._staging`); once the layer digest matched, one non-blocking copy to the device
  tensor is enqueued on a side stream and an event recorded after it (:mod:`.cuda`).
  ``wait_for_layer`` returns right after that, without waiting for the GPU; the consumer's
  stream waits on the event (:meth:`TorchSink.layer` does it for the current stream,
  :meth:`TorchSink.wait_event_on` for another). Unverified octets never reach the device.

Byte order: kvsp-layout-1 elements are little-endian. On little-endian hosts (all practical
ones) the tensors view the payload as is; on a big-endian host each verified layer's elements
are byte-swapped in place (on the device, for CUDA) before it is published.
"""

from __future__ import annotations

from hashlib import sha256
from typing import TYPE_CHECKING, Any

from ..kvsp.layout import Geometry
from ._reception import HashFactory
from ._staging import CopyEngine, CopyEvent, StagingRing, StagingSlot
from ._torch import HOST_IS_LITTLE_ENDIAN, byte_view, byteswap_elements, import_torch, torch_dtype
from .base import DEFAULT_HASH_OFFLOAD_BYTES, Digests, LayerSink
from .errors import SinkError

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor
else:
    Tensor = Any

__all__ = ["TorchSink"]


class TorchSink(LayerSink[tuple["Tensor", "Tensor"]]):
    """Layers as torch tensors ``[tokens, kv_heads, head_dim]`` on ``device``.

    ``staging_slots`` pinned buffers (each one layer) are allocated up front on the CUDA path
    and the ring grows to at most ``max_staging_slots`` when more layers are in flight at once.
    ``copy_engine`` replaces the CUDA backend (a :class:`~kvsp_moq.sinks.CopyEngine`); tests
    use it to run the staged path on a CPU.
    """

    def __init__(
        self,
        geometry: Geometry,
        tokens: int,
        layers: tuple[int, int],
        digests: Digests,
        *,
        device: Any = None,
        staging_slots: int = 2,
        max_staging_slots: int = 4,
        copy_engine: CopyEngine | None = None,
        hash_factory: HashFactory = sha256,
        hash_offload_bytes: int | None = DEFAULT_HASH_OFFLOAD_BYTES,
        shared_memory: bool = False,
        storage: Tensor | None = None,
    ) -> None:
        """``shared_memory`` (CPU only): allocate the layers in shared memory
        (``Tensor.share_memory_``), so that worker processes of a parallel load
        (``kvsp_moq.bridge.parallel``) write payloads straight into them.
        ``storage`` (CPU only): receive into this flat contiguous ``uint8`` CPU tensor of
        exactly ``layer_count x payload`` octets instead of allocating (a worker's view of
        the parent's shared buffer)."""
        super().__init__(geometry, tokens, layers, digests, hash_factory=hash_factory,
                         hash_offload_bytes=hash_offload_bytes)
        torch = import_torch()
        self.dtype = torch_dtype(torch, geometry.dtype)
        self._engine = copy_engine if copy_engine is not None else _default_engine(torch, device)
        if self._engine is not None:
            self.device = torch.device(self._engine.device)
            if device is not None and _resolved(torch, device) != self.device:
                raise SinkError(f"device {device} differs from the copy engine's {self.device}")
        else:
            self.device = torch.device("cpu")
        n = self.payload_bytes
        count = self.layer_count
        if (shared_memory or storage is not None) and self._engine is not None:
            raise SinkError("shared or external storage is for CPU sinks only "
                            f"(this sink stages into {self.device})")
        if storage is not None:
            if (storage.dtype != torch.uint8 or storage.device.type != "cpu"
                    or storage.dim() != 1 or not storage.is_contiguous()
                    or storage.numel() != n * count):
                raise SinkError(f"storage must be a flat contiguous uint8 CPU tensor of "
                                f"{n * count} octets, got {tuple(storage.shape)} "
                                f"{storage.dtype} on {storage.device}")
            self._storage = storage
            self._ring: StagingRing | None = None
        elif self._engine is None:
            self._storage = torch.empty(n * count, dtype=torch.uint8)
            if shared_memory:
                self._storage.share_memory_()
            self._ring = None
        else:
            if not 1 <= staging_slots <= max_staging_slots:
                raise SinkError(f"staging slots: need 1 <= staging_slots ({staging_slots}) "
                                f"<= max_staging_slots ({max_staging_slots})")
            self._storage = self._engine.alloc_device(n * count)
            # Never more buffers than layers up front; the ring grows on demand.
            self._ring = StagingRing(self._engine, n, initial=min(staging_slots, count),
                                     maximum=max_staging_slots)
        shape = (2, *geometry.shape(tokens))
        self._octets = [self._storage[i * n : (i + 1) * n] for i in range(count)]
        self._blocks = [octets.view(self.dtype).view(shape) for octets in self._octets]
        self._swap = 0 if HOST_IS_LITTLE_ENDIAN else geometry.dtype.itemsize
        self._staged: dict[int, StagingSlot] = {}  # position -> slot being received into
        self._events: list[CopyEvent | None] = [None] * count

    # -- description ----------------------------------------------------------------------

    @property
    def staged(self) -> bool:
        """Whether payloads go through pinned host staging (the CUDA path)."""
        return self._engine is not None

    @property
    def staging_slots(self) -> int:
        """Pinned staging buffers allocated (0 on the CPU path)."""
        return self._ring.slots if self._ring is not None else 0

    @property
    def storage(self) -> Tensor:
        """The flat ``uint8`` tensor holding every layer's payload, layer ``first`` first
        (on the device for the CUDA path). Unverified regions hold arbitrary octets: read
        layers through :meth:`layer`."""
        return self._storage

    @property
    def is_shared(self) -> bool:
        """Whether the layers live in shared memory (CPU path, see :meth:`share_memory`)."""
        return self._engine is None and bool(self._storage.is_shared())

    def share_memory(self) -> None:
        """Move the layers to shared memory in place (``Tensor.share_memory_``: one copy of
        the buffer; verified layers keep their octets; a no-op when already shared), so that
        worker processes can receive into them. SinkError on the CUDA path and while a layer
        is being received (its destination view would point at the old memory)."""
        if self._engine is not None:
            raise SinkError(f"only a CPU sink can be shared with worker processes "
                            f"(this one stages into {self.device})")
        if any(self.delivering(layer) for layer in self.layer_range):  # RECEIVING, or ahead
            raise SinkError("cannot move the sink to shared memory while layers are received")
        self._storage.share_memory_()  # views (_octets, _blocks) share the moved storage

    def release_storage(self) -> None:
        """Drop this sink's references to its memory (a worker's view of a shared buffer:
        the mapping goes as soon as nothing else holds it). The sink is unusable afterwards:
        every unverified layer fails."""
        self.abort_all("the sink's storage was released")
        self._octets, self._blocks = [], []
        self._storage = self._storage.new_empty(0)

    # -- consumer side ----------------------------------------------------------------------

    def layer(self, layer: int, stream: Any | None = None) -> tuple[Tensor, Tensor]:
        """(K, V) of a verified layer. On the CUDA path ``stream`` (None: the current stream)
        is first made to wait, on the device, for the layer's copy event."""
        kv = super().layer(layer)
        event = self._events[layer - self.first_layer]
        if event is not None and self._engine is not None:
            self._engine.stream_wait(event, stream)
        return kv

    def layer_event(self, layer: int) -> CopyEvent | None:
        """The ``torch.cuda.Event`` recorded after ``layer``'s device copy (None on CPU)."""
        super().layer(layer)  # verified, else LayerFailed / SinkError
        return self._events[layer - self.first_layer]

    def wait_event_on(self, stream: Any, layer: int) -> None:
        """Make ``stream`` wait for ``layer``'s device copy (device-side; no host wait)."""
        event = self.layer_event(layer)
        if event is not None and self._engine is not None:
            self._engine.stream_wait(event, stream)

    # -- hooks ------------------------------------------------------------------------------

    def destinations_at_once(self) -> bool:
        return self._ring is None  # a staging ring has fewer slots than layers

    def _acquire(self, position: int) -> memoryview:
        if self._ring is None:
            return byte_view(self._octets[position])  # the tensor's own storage
        slot = self._ring.acquire()
        self._staged[position] = slot
        return slot.view[: self.payload_bytes]

    def _publish(self, position: int) -> None:
        if self._ring is None or self._engine is None:
            if self._swap:
                byteswap_elements(self._octets[position], self._swap)
            return
        slot = self._staged.pop(position)
        src = slot.tensor[: self.payload_bytes]
        try:
            event = self._engine.copy_async(self._octets[position], src, self._swap)
        except Exception:
            self._ring.release(slot)
            raise
        self._ring.submitted(slot, event)
        self._events[position] = event

    def _release(self, position: int) -> None:
        slot = self._staged.pop(position, None)
        if slot is not None and self._ring is not None:
            self._ring.release(slot)

    def _view(self, position: int) -> tuple[Tensor, Tensor]:
        block = self._blocks[position]
        return block[0], block[1]


def _resolved(torch: Any, device: Any) -> Any:
    """``device`` as a ``torch.device`` with its index: a bare "cuda" is the current CUDA
    device (as ``CudaCopyEngine`` resolves it), so "cuda" and "cuda:0" compare equal there."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _default_engine(torch: Any, device: Any) -> CopyEngine | None:
    """None (in place, CPU) for ``cpu``/None; the CUDA engine for ``cuda[:i]``."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cpu":
        return None
    if dev.type == "cuda":
        from .cuda import CudaCopyEngine  # lazy: the CUDA backend only where asked for

        return CudaCopyEngine(dev)
    raise SinkError(f"device {dev} is not supported (cpu or cuda)")
