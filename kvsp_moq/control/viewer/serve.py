"""Serving the block viewer: :func:`serve_viewer` (docs/viewer.md)."""

from __future__ import annotations

from collections.abc import Sequence

from ..common.auth import Authorizer
from ..http.server import RunningServer, build_app, serve_app
from .block import ViewerBlock
from .routes import ViewerRoutes

__all__ = ["serve_viewer"]


async def serve_viewer(blocks: Sequence[ViewerBlock], host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    """Serve the page for ``blocks`` on ``host:port`` (plain HTTP: a browser treats
    ``http://127.0.0.1`` / ``localhost`` as a secure context, which WebTransport and
    ``crypto.subtle`` need; served elsewhere, put it behind HTTPS) until the server closes."""
    if not blocks:
        raise ValueError("serve_viewer needs at least one block")
    app = build_app(auth=Authorizer.from_tokens({}), routes=ViewerRoutes(blocks).routes())
    return await serve_app(app, host, port)
