"""torch helpers for the torch sink; torch is imported only when a torch sink is created, so
``import kvsp_moq.sinks`` works without it (the numpy sink needs no torch)."""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from ..kvsp.registries import ElementType
from .errors import SinkError

__all__ = ["HOST_IS_LITTLE_ENDIAN", "byte_view", "import_torch", "byteswap_elements", "torch_dtype"]

#: kvsp-layout-1 elements are little-endian (§4.3); torch tensors use the host's order.
HOST_IS_LITTLE_ENDIAN = sys.byteorder == "little"


def import_torch() -> ModuleType:
    try:
        import torch
    except ImportError as exc:
        raise SinkError("the torch sink needs torch (pip install kvsp-moq[torch])") from exc
    return torch


def torch_dtype(torch: ModuleType, element: ElementType) -> Any:
    """The ``torch.dtype`` of a registered element type (§11.2.3, ``torch_name``)."""
    dtype = getattr(torch, element.torch_name, None)
    if dtype is None:
        raise SinkError(f"this torch ({torch.__version__}) has no torch.{element.torch_name} "
                        f"for element type {element.name}")
    return dtype


def byte_view(tensor: Any) -> memoryview:
    """A writable flat memoryview over a contiguous CPU (or pinned) ``uint8`` tensor's memory;
    ``Tensor.numpy()`` shares the storage, so writes through the view land in the tensor."""
    return memoryview(tensor.numpy())


def byteswap_elements(octets: Any, itemsize: int) -> None:
    """Reverse the octets of every ``itemsize``-octet element of the flat ``uint8`` tensor
    ``octets`` in place: turns kvsp-layout-1's little-endian elements into a big-endian host's
    order (and back). Only used on big-endian hosts; a no-op for 1-octet elements."""
    if itemsize > 1 and octets.numel():
        elements = octets.view(-1, itemsize)
        elements.copy_(elements.flip(-1))
