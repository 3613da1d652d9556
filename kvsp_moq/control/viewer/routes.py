"""HTTP routes of the block viewer (docs/viewer.md).

``GET {base}`` the page (``static/viewer.html``), ``GET {base}moqt.js`` its MOQT client
(``static/moqt.js``), ``GET {base}api/blocks`` the blocks it can show and ``GET
{base}api/blocks/{n}`` what the page needs about block ``n`` (:meth:`ViewerBlock.page_config`).
Both files are package data; the page carries no secret (the record is public to whoever may
read the block, and the browser still has to be allowed by the relay).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources

from aiohttp import web

from .block import ViewerBlock

__all__ = ["ViewerRoutes", "static_file"]

NO_STORE = {"Cache-Control": "no-store"}


def static_file(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


class ViewerRoutes:
    def __init__(self, blocks: Sequence[ViewerBlock], base_path: str = "/") -> None:
        self.blocks = tuple(blocks)
        self.base = base_path
        self.page = static_file("viewer.html")
        self.script = static_file("moqt.js")

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get(self.base, self.get_page),
            web.get(f"{self.base}moqt.js", self.get_script),
            web.get(f"{self.base}api/blocks", self.get_blocks),
            web.get(f"{self.base}api/blocks/{{n}}", self.get_block),
        ]

    async def get_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.page, content_type="text/html", charset="utf-8", headers=NO_STORE)

    async def get_script(self, request: web.Request) -> web.Response:
        return web.Response(body=self.script, content_type="text/javascript", charset="utf-8",
                            headers=NO_STORE)

    async def get_blocks(self, request: web.Request) -> web.Response:
        listing = [{"n": n, "block_key": b.record.block_key.hex(), "layers": b.layer_count}
                   for n, b in enumerate(self.blocks)]
        return self._json({"blocks": listing})

    async def get_block(self, request: web.Request) -> web.Response:
        text = request.match_info["n"]
        if not text.isdigit() or int(text) >= len(self.blocks):
            raise web.HTTPNotFound(text=f"no block {text}")
        return self._json(self.blocks[int(text)].page_config())

    @staticmethod
    def _json(doc: object) -> web.Response:
        return web.Response(body=json.dumps(doc).encode(), content_type="application/json", headers=NO_STORE)
