"""HTTP routes of the instance's inference engine (ours; docs/http-api.md "Generation")."""

from __future__ import annotations

from aiohttp import web

from ..common.media import KVSP_JSON
from ..http.server import RoutesConfig, authenticate, read_record, record_response
from .engine import InferenceEngine
from .records import GenerateRequest

__all__ = ["EngineRoutes"]


class EngineRoutes:
    """The engine's routes under the instance's base path (``config``) (ours; docs/http-api.md "Generation"):
    ``POST generate`` runs one request on the model, ``GET engine`` returns its counters."""

    def __init__(self, config: RoutesConfig, engine: InferenceEngine) -> None:
        self.engine = engine
        self.base = config.base_path
        self.max_body = config.max_body_octets

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post(f"{self.base}generate", self.post_generate),
            web.get(f"{self.base}engine", self.get_engine, allow_head=False),
        ]

    async def post_generate(self, request: web.Request) -> web.Response:
        """200 with the output tokens, their indices and where the prompt's KV came from;
        403 without the scope (or its key here), 409 ``kvsp-not-active`` when not active."""
        principal = authenticate(request)
        body = await read_record(request, GenerateRequest, self.max_body)
        return record_response(await self.engine.generate(principal, body))

    async def get_engine(self, request: web.Request) -> web.Response:
        authenticate(request)
        return web.json_response(self.engine.stats(), content_type=KVSP_JSON)
