"""HTTP routes of the dashboard (docs/dashboard.md): the page and the JSON it polls.

``GET {base}`` the page (``static/dashboard.html``, shipped as package data); ``GET
{base}api/snapshot`` one :meth:`Collector.latest` snapshot. No token: the dashboard holds the
roles' token itself and serves on loopback by default (docs/dashboard.md "Access").
"""

from __future__ import annotations

import json
from importlib import resources

from aiohttp import web

from .collect import Collector

__all__ = ["DashboardRoutes", "page_html"]

NO_STORE = {"Cache-Control": "no-store"}


def page_html() -> bytes:
    return resources.files(__package__).joinpath("static", "dashboard.html").read_bytes()


class DashboardRoutes:
    def __init__(self, collector: Collector, base_path: str = "/") -> None:
        self.collector = collector
        self.base = base_path
        self.page = page_html()

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get(self.base, self.get_page),
            web.get(f"{self.base}api/snapshot", self.get_snapshot),
        ]

    async def get_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.page, content_type="text/html", charset="utf-8", headers=NO_STORE)

    async def get_snapshot(self, request: web.Request) -> web.Response:
        snap = await self.collector.latest()
        return web.Response(body=json.dumps(snap).encode(), content_type="application/json", headers=NO_STORE)
