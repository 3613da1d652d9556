"""Layer sinks (DESIGN.md §2 ``sinks/``, §4 binding v1, §6 data path): receive each layer's
MOQT object payload (K || V, kvsp-layout-1) straight into preallocated numpy arrays or torch
tensors, verify it against its layer digest (kvsp-draft §4.3) with a SHA-256 computed while the
octets arrive, and hand verified layers to compute in ascending order while later layers are
still in flight. See docs/sinks.md.

Imports only ``kvsp_moq.kvsp``, the standard library and numpy; torch is imported when a
:class:`TorchSink` is created, so the numpy sink works without torch.
"""

from .base import Digests, LayerSink, LayerState
from .errors import LayerFailed, SinkError
from .factory import make_sink
from .numpy_sink import NumpySink
from ._staging import CopyEngine, CopyEvent
from ._torch import import_torch
from .torch_sink import TorchSink

__all__ = [
    "CopyEngine",
    "CopyEvent",
    "Digests",
    "LayerFailed",
    "LayerSink",
    "LayerState",
    "NumpySink",
    "SinkError",
    "TorchSink",
    "import_torch",
    "make_sink",
]
