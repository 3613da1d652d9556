"""The block viewer (docs/viewer.md): a page that, in a browser, receives a KV block over MOQT
over WebTransport (through a relay), verifies each layer against its Replica Record and shows
each layer's arrival. :func:`serve_viewer` serves it; ``kvsp moq view`` runs it."""

from .block import ViewerBlock, ViewerError
from .serve import serve_viewer

__all__ = ["ViewerBlock", "ViewerError", "serve_viewer"]
