"""``make_sink``: choose a layer sink for the receiving side of binding v1 (DESIGN.md §4)."""

from __future__ import annotations

from typing import Any, Literal

from ..kvsp.layout import Geometry
from .base import Digests, LayerSink
from .errors import SinkError
from ._torch import import_torch
from .numpy_sink import NumpySink

__all__ = ["make_sink"]

Backend = Literal["auto", "numpy", "torch"]


def make_sink(
    geometry: Geometry,
    tokens: int,
    layers: tuple[int, int],
    digests: Digests,
    *,
    backend: Backend = "auto",
    device: Any = None,
    **options: Any,
) -> LayerSink[Any]:
    """A sink for layers ``layers`` = (first, last) of a block of ``tokens`` tokens.

    ``backend``: ``"torch"`` (:class:`TorchSink` on ``device``: None/"cpu" in place,
    "cuda[:i]" through pinned staging), ``"numpy"`` (:class:`NumpySink`; ``device`` must be
    None or "cpu"), or ``"auto"``: torch when it is installed, else numpy. ``options`` go to
    the sink (``hash_factory``; torch: ``staging_slots``, ``max_staging_slots``).
    """
    if backend == "auto":
        backend = "torch" if _torch_available() else "numpy"
    if backend == "torch":
        from .torch_sink import TorchSink  # torch itself is imported by the sink

        return TorchSink(geometry, tokens, layers, digests, device=device, **options)
    if backend == "numpy":
        if device is not None and str(device) != "cpu":
            raise SinkError(f"the numpy sink holds layers in host memory, not on {device}")
        return NumpySink(geometry, tokens, layers, digests, **options)
    raise SinkError(f"unknown sink backend {backend!r} (auto, numpy, torch)")


def _torch_available() -> bool:
    try:
        import_torch()
    except SinkError:
        return False
    return True
