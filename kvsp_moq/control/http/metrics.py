"""``GET {base}metrics`` on every role's own listen port (docs/metrics.md).

The role's :class:`~.common.metrics.RoleMetrics` rendered in the Prometheus text format 0.0.4.
Access: any principal's bearer token (401 otherwise, like every other route), or none when the
role's section says ``metrics_public = true``.
"""

from __future__ import annotations

from aiohttp import web

from ..common.metrics import CONTENT_TYPE, RoleMetrics
from .server import authenticate

__all__ = ["metrics_routes"]


def metrics_routes(base_path: str, metrics: RoleMetrics, *, public: bool = False) -> list[web.RouteDef]:
    """The ``{base_path}metrics`` route of a role serving ``metrics``."""

    async def get_metrics(request: web.Request) -> web.Response:
        if not public:
            authenticate(request)  # any principal
        body = await metrics.render()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE, "Cache-Control": "no-store"})

    return [web.get(f"{base_path}metrics", get_metrics)]
