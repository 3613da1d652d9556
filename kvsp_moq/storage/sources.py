"""Section sources: what a K or V section may be handed to the store as.

A section is either a host buffer (``bytes``, ``bytearray``, ``memoryview``, a C-contiguous
numpy array: anything exposing the buffer protocol) or a torch tensor (CPU or CUDA). Buffers
become flat unsigned-byte memoryviews without copying; tensors are kept as tensors so that a
device tier can copy them device to device. torch is never imported here: a tensor is
recognised by its type's module, so a relay-only install without torch still works.
"""

from __future__ import annotations

from typing import Any, TypeAlias

from ..kvsp.errors import ContainerError

__all__ = ["Section", "as_section", "host_view", "is_tensor", "section_nbytes"]

#: A flat uint8 memoryview, or a flat uint8 torch tensor (typed ``Any``: torch is optional).
Section: TypeAlias = "memoryview | Any"


def is_tensor(obj: object) -> bool:
    """Whether ``obj`` is a torch tensor (without importing torch)."""
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def as_section(obj: object, what: str = "section") -> Section:
    """A flat byte view of ``obj`` (no copy for contiguous inputs).

    Tensors are flattened to uint8 (``contiguous()`` copies only non-contiguous ones); buffers
    must be C-contiguous. ContainerError(field "data") for anything else.
    """
    if is_tensor(obj):
        import torch  # lazy: only reached with a tensor in hand, so torch is installed

        tensor: Any = obj
        return tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    try:
        view = obj if isinstance(obj, memoryview) else memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise ContainerError("data", f"{what} must be a buffer or a tensor, got {type(obj).__name__}") from None
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise ContainerError("data", f"{what} must be C-contiguous")
    return view.cast("B")


def section_nbytes(section: Section) -> int:
    """Octets of a section."""
    if isinstance(section, memoryview):
        return section.nbytes
    return int(section.numel())


def host_view(section: Section) -> memoryview:
    """Host-memory octets of a section: the view itself, a zero-copy view of a CPU tensor, or
    a copy of a CUDA tensor (needed to hash it, §4.3)."""
    if isinstance(section, memoryview):
        return section
    tensor = section if section.device.type == "cpu" else section.cpu()
    return memoryview(tensor.numpy())
