"""The server side of request tracing (``common/tracing.py``; docs/tracing.md): one aiohttp
middleware for every role's application.

Each request gets a span: a child of the caller's when its ``traceparent`` is valid, else the
first span of a new trace. The span is current while the handler runs (and in the tasks it
spawns), its ``traceparent`` is on the response (also a streamed one: set when the response is
prepared), and one line per request goes to the ``kvsp.access`` logger at INFO::

    kvsp.access: frontend POST /sessions 201 12.3ms trace_id=4bf9... span_id=00f0... parent_id=b7ad...

with ``trace_id``, ``span_id``, ``parent_id``, ``role``, ``route``, ``status`` also as attributes of
the log record (for a JSON formatter). The role is the package of the route's handler
(``kvsp_moq.control.<role>``). ``KVSP_ACCESS_LOG=1`` in a role process's environment writes
these lines (and the client calls' lines) to stderr without any logging configuration.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Awaitable, Callable

from aiohttp import web

from ..common.tracing import ACCESS_LOG, TRACEPARENT, Span, parse_traceparent, server_span

__all__ = ["ACCESS_LOG_ENV", "install_access_log", "on_prepare", "trace_middleware"]

#: Environment variable: non-empty (and not ``0``) adds a stderr handler to ``kvsp.access``.
ACCESS_LOG_ENV = "KVSP_ACCESS_LOG"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SPAN = web.RequestKey("kvsp_trace_span", Span)  # the request's Span


def _role_of(request: web.Request) -> str:
    handler = request.match_info.handler
    module = getattr(handler, "__module__", "") or ""
    parts = module.split(".")
    if len(parts) >= 3 and parts[:2] == ["kvsp_moq", "control"]:
        return parts[2]
    return "-"


def _route_of(request: web.Request) -> str:
    route = request.match_info.route
    resource = route.resource if route is not None else None
    return resource.canonical if resource is not None else request.path


@web.middleware
async def trace_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    incoming = parse_traceparent(request.headers.getall(TRACEPARENT, []))
    role, route = _role_of(request), _route_of(request)
    with server_span(incoming, role=role, route=route, method=request.method) as span:
        request[SPAN] = span
        status: int | None = None
        error: BaseException | None = None
        try:
            response = await handler(request)
            status = response.status
            response.headers.setdefault(TRACEPARENT, span.context.traceparent)
            return response
        except web.HTTPException as exc:  # a redirect or a status the problem middleware left
            status = exc.status
            exc.headers[TRACEPARENT] = span.context.traceparent
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            span.finish(status, error)
            _log(request, span, role, route, status, error)


async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: a streamed response gets its ``traceparent`` before its
    headers are sent."""
    span = request.get(SPAN)
    if span is not None and TRACEPARENT not in response.headers:
        response.headers[TRACEPARENT] = span.context.traceparent


def _log(request: web.Request, span: Span, role: str, route: str, status: int | None,
         error: BaseException | None) -> None:
    if not ACCESS_LOG.isEnabledFor(logging.INFO):
        return
    ctx = span.context
    shown = status if status is not None else type(error).__name__ if error is not None else "-"
    ACCESS_LOG.info("%s %s %s %s %.1fms trace_id=%s span_id=%s parent_id=%s", role, request.method,
                    request.path, shown, span.elapsed_ms, ctx.trace_id, ctx.span_id, ctx.parent_id or "-",
                    extra={"trace_id": ctx.trace_id, "span_id": ctx.span_id, "parent_id": ctx.parent_id,
                           "role": role, "route": route, "status": status, "kind": "server"})


_installed = False


def install_access_log() -> None:
    """With ``KVSP_ACCESS_LOG`` set, a stderr handler at INFO on ``kvsp.access`` (once)."""
    global _installed
    value = os.environ.get(ACCESS_LOG_ENV, "")
    if _installed or value in ("", "0"):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    ACCESS_LOG.addHandler(handler)
    ACCESS_LOG.setLevel(logging.INFO)
    _installed = True
