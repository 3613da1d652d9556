"""The disaggregation router's HTTP API (:mod:`.service`): OpenAI's ``POST /v1/completions``
and ``GET /health``."""

from __future__ import annotations

from aiohttp import web

from .service import MAX_PROMPT_TOKENS, CompletionError, DisaggRouter

__all__ = ["make_app"]

ROUTER = web.AppKey("router", DisaggRouter)


def make_app(router: DisaggRouter) -> web.Application:
    """The router's HTTP API: ``POST /v1/completions`` (OpenAI's shape), ``GET /health``."""
    app = web.Application(client_max_size=16 * MAX_PROMPT_TOKENS)
    app[ROUTER] = router
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/health", _health)
    return app


def _problem(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error" if status == 400
                                        else "server_error", "code": status}}, status=status)


async def _completions(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except ValueError:
        return _problem(400, "the body is not JSON")
    try:
        answer = await request.app[ROUTER].complete(body)
    except CompletionError as exc:
        return _problem(400, str(exc))
    except RuntimeError as exc:
        return _problem(502, str(exc))
    return web.json_response(answer)


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True, "requests": request.app[ROUTER].requests})
