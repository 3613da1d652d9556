"""The host tier: layers in host RAM, one numpy ``uint8`` buffer per layer."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..sources import Section
from .base import Extent, MemoryTier

__all__ = ["HostTier"]


class HostTier(MemoryTier):
    """Host memory. Buffers come from ``np.empty`` (no zero fill: every octet is written
    before it can be read) and are viewed without copying."""

    kind = "host"
    host_addressable = True

    def __init__(
        self, capacity: int, *, read_mbit_per_s: float | None = None, name: str = "host"
    ) -> None:
        super().__init__(name, capacity, read_mbit_per_s)

    def _new_buffer(self, nbytes: int) -> Any:
        return np.empty(nbytes, dtype=np.uint8)

    def write(self, extent: Extent, offset: int, section: Section) -> None:
        if isinstance(section, memoryview):
            n = section.nbytes
            if n:
                memoryview(extent.buf)[offset : offset + n] = section
            return
        # A torch tensor (from a device tier or a caller): one copy straight into the buffer.
        import torch  # lazy: only reached with a tensor in hand

        n = int(section.numel())
        if n:
            torch.from_numpy(extent.buf[offset : offset + n]).copy_(section)

    def payload(self, extent: Extent) -> memoryview:
        return memoryview(extent.buf).toreadonly()
