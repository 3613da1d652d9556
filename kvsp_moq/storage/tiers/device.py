"""The device tier: layers in accelerator memory as torch ``uint8`` tensors.

On a machine with CUDA the tensors live on the GPU; without one a CPU tensor stands in, so
the same code paths run everywhere (tests use the CPU stand-in). torch is imported only when a
:class:`DeviceTier` is created, never at module import (a relay-only install has no torch).

Reading a CUDA layer for the network stages it in host memory (one device-to-host copy per
layer, never the whole container); :meth:`DeviceTier.tensor` gives the device tensor itself
to code that stays on the device (layer sinks).
"""

from __future__ import annotations

import warnings
from typing import Any

from ..errors import StorageError
from ..sources import Section
from .base import Extent, MemoryTier

__all__ = ["DeviceTier"]


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise StorageError("the device tier needs torch (pip install kvsp-moq[torch])") from exc
    return torch


class DeviceTier(MemoryTier):
    """Accelerator memory. ``device`` defaults to ``cuda`` when available, else ``cpu``."""

    kind = "device"

    def __init__(
        self,
        capacity: int,
        *,
        device: str | None = None,
        read_mbit_per_s: float | None = None,
        name: str = "device",
    ) -> None:
        super().__init__(name, capacity, read_mbit_per_s)
        torch = _import_torch()
        self._torch = torch
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        # A CPU stand-in is host memory: its layers can be viewed without a copy.
        self.host_addressable = self.device.type == "cpu"

    @property
    def is_cuda(self) -> bool:
        return bool(self.device.type == "cuda")

    def _new_buffer(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8, device=self.device)

    def write(self, extent: Extent, offset: int, section: Section) -> None:
        if isinstance(section, memoryview):
            n = section.nbytes
            if not n:
                return
            dst = extent.buf[offset : offset + n]
            if self.host_addressable:
                memoryview(dst.numpy())[:] = section
                return
            with warnings.catch_warnings():
                # The source is only read; torch warns about read-only buffers regardless.
                warnings.simplefilter("ignore", UserWarning)
                src = self._torch.frombuffer(section, dtype=self._torch.uint8)
            dst.copy_(src)  # host to device
            return
        n = int(section.numel())
        if n:
            extent.buf[offset : offset + n].copy_(section)  # device to device, or host to device

    def payload(self, extent: Extent) -> memoryview:
        tensor = extent.buf
        if not self.host_addressable:
            tensor = tensor.cpu()  # staged copy of this one layer (device to host)
        return memoryview(tensor.numpy()).toreadonly()

    def source(self, extent: Extent) -> Section:
        return extent.buf

    def tensor(self, extent: Extent) -> Any:
        """The layer's K || V as a ``uint8`` tensor on :attr:`device` (no copy)."""
        return extent.buf
