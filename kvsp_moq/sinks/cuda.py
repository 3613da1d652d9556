"""The CUDA transfer backend of :class:`~kvsp_moq.sinks.TorchSink` (docs/sinks.md "CUDA path").

- Staging buffers are page-locked (``pin_memory=True``), so the host-to-device copy is a real
  asynchronous DMA that does not go through a pageable bounce buffer.
- Copies run on one side stream (``torch.cuda.Stream``) per sink, never on the compute stream;
  each copy is followed by one ``torch.cuda.Event`` recorded on that side stream.
- Consumers order their compute after a layer with ``stream.wait_event(event)``: a device-side
  dependency; the host (and the asyncio event loop) never waits for the GPU.

This module needs a CUDA build of torch and a GPU at run time; it is imported lazily and is
exercised only where ``torch.cuda.is_available()`` (tests/test_sinks_torch.py).
"""

from __future__ import annotations

from typing import Any

from ._torch import import_torch, byteswap_elements
from .errors import SinkError

__all__ = ["CudaCopyEngine"]


class CudaCopyEngine:
    """Pinned host staging -> CUDA device copies on a side stream, one event per copy."""

    def __init__(self, device: Any) -> None:
        torch = import_torch()
        if not torch.cuda.is_available():
            raise SinkError(f"device {device} requested but CUDA is not available")
        self._torch = torch
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise SinkError(f"CudaCopyEngine needs a cuda device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(device=self.device)

    def alloc_device(self, nbytes: int) -> Any:
        torch = self._torch
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        # Allocated on the current stream, written on the side stream: order the side stream
        # after the allocation, and tell the caching allocator the side stream uses the memory
        # so that freeing it (the sink dropped) waits for pending copies.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        tensor.record_stream(self.stream)
        return tensor

    def alloc_staging(self, nbytes: int) -> Any:
        torch = self._torch
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy_async(self, dst: Any, src: Any, swap_itemsize: int) -> Any:
        torch = self._torch
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)  # pinned source: asynchronous DMA
            byteswap_elements(dst, swap_itemsize)  # no-op but on big-endian hosts
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def stream_wait(self, event: Any, stream: Any | None) -> None:
        target = stream if stream is not None else self._torch.cuda.current_stream(self.device)
        target.wait_event(event)
