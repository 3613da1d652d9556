"""Errors of the layer sinks (DESIGN.md §2 ``sinks/``).

:class:`SinkError` is a misuse or a protocol violation seen by the sink (a payload length that
is not the layer's K || V size, a layer outside the sink's range, a layer delivered twice, more
octets than announced). :class:`LayerFailed` is what a consumer waiting for a layer gets when
that layer will not become usable from this delivery: its digest did not match (kvsp-draft
§4.3), the transport aborted it, or the whole sink was aborted. A consumer recomputes what
:meth:`~kvsp_moq.sinks.base.LayerSink.missing_layers` lists.
"""

from __future__ import annotations

__all__ = ["LayerFailed", "SinkError"]


class SinkError(ValueError):
    """A layer sink was used against its contract; the message names the layer and the rule."""


class LayerFailed(SinkError):
    """Layer ``layer`` failed (digest mismatch, abort); ``reason`` says why."""

    def __init__(self, layer: int, reason: str) -> None:
        self.layer = layer
        self.reason = reason
        super().__init__(f"layer {layer} failed: {reason}")
