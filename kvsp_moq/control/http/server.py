"""HTTP glue of the control-plane roles (DESIGN.md §5): one application per process, served
by aiohttp. Role-neutral; each role's ``routes.py`` builds on it and its ``serve.py`` runs it.

- :class:`ServiceRoutes` — the base of a role's route table, under its ``config.base_path``;
- :func:`authenticate` — the principal of a request (401 problem otherwise);
- :func:`read_record` / :func:`read_json_object` — JSON bodies, ``application/kvsp+json`` or
  ``application/json`` (415 otherwise), at most a per-route number of octets (413), validated
  into a record (400 ``kvsp-bad-record`` naming the member); :func:`read_block_body` for
  ``application/kvsp-block`` bodies;
- :func:`record_response` / :func:`problem_response` — ``application/kvsp+json`` and RFC 9457
  ``application/problem+json``;
- :func:`problem_middleware` — every refusal (``ServiceError``, ``RecordError``, routing errors,
  unexpected exceptions) leaves as a problem details response;
- :func:`build_app` / :func:`serve_app` / :class:`RunningServer` — the application and its server;
  every request traced (W3C ``traceparent``, ``tracing.py``; docs/tracing.md).

Endpoints and their shapes: docs/http-api.md.
"""

from __future__ import annotations

import http
import json
import logging
import ssl
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from aiohttp import web

from ...kvsp import problems
from ...kvsp.errors import KvspError, RecordError
from ...kvsp.records import Problem, Record, decode_json, dump_json, parse_json
from ..common.auth import Authorizer, Principal
from ..common.errors import ServiceError
from ..common.media import BLOCK_MEDIA_TYPE, KVSP_JSON
from .tracing import install_access_log, on_prepare, trace_middleware

log = logging.getLogger(__name__)

#: Request media types accepted for JSON bodies.
JSON_MEDIA_TYPES = frozenset({KVSP_JSON, "application/json"})

AUTHORIZER = web.AppKey("kvsp_authorizer", Authorizer)

R = TypeVar("R", bound=Record)


class RoutesConfig(Protocol):
    """What a route table reads of its role's configuration."""

    @property
    def base_path(self) -> str: ...
    @property
    def max_body_octets(self) -> int: ...


class Configured(Protocol):
    """A service with a :class:`RoutesConfig`."""

    @property
    def config(self) -> RoutesConfig: ...


S = TypeVar("S", bound=Configured)


class ServiceRoutes(Generic[S]):
    """Routes of one service under its ``config.base_path``, reading bodies of at most its
    ``config.max_body_octets`` (what every role's Routes class shares)."""

    def __init__(self, service: S) -> None:
        self.service = service
        self.base = service.config.base_path
        self.max_body = service.config.max_body_octets


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Path segments of §6.7: {compat} hex32, {scope} hex16, {block_key} hex32. A malformed segment
# matches no route, hence 404 kvsp-not-found.
HEX32_SEGMENT = "[0-9a-f]{64}"
HEX16_SEGMENT = "[0-9a-f]{32}"
BLOCK_PATH = f"{{compat:{HEX32_SEGMENT}}}/{{scope:{HEX16_SEGMENT}}}/{{key:{HEX32_SEGMENT}}}"
#: A UUID in a path (sessions, directives).
UUID_SEGMENT = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
#: A Shard Map identifier in a path (ours: unreserved characters only, so it needs no escaping).
MAP_SEGMENT = "[A-Za-z0-9._~-]{1,256}"



# ---------------------------------------------------------------------------------------------
# Problems and responses


class HttpProblem(Exception):
    """A refusal that exists only at the HTTP level (413, 415): ``about:blank`` problems."""

    def __init__(self, status: int, detail: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = dict(headers or {})


def problem_response(
    problem: Problem,
    *,
    headers: Mapping[str, str] | None = None,
    extensions: Mapping[str, object] | None = None,
) -> web.Response:
    """An RFC 9457 problem details response; ``extensions`` are extra members (``member``)."""
    body = problem.to_json()
    if extensions:
        body.update(extensions)
    status = problem.status or 500
    return web.Response(
        status=status,
        body=json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8"),
        content_type=problems.PROBLEM_MEDIA_TYPE,
        headers=headers,
    )


def blank_problem(status: int, detail: str | None = None) -> Problem:
    """An ``about:blank`` problem: the status code says it all (RFC 9457 §4.2.1)."""
    return Problem(type="about:blank", title=http.HTTPStatus(status).phrase, status=status, detail=detail)


def record_response(record: Record, *, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    """A record as ``application/kvsp+json``."""
    return web.Response(status=status, body=dump_json(record), content_type=KVSP_JSON, headers=headers)


@web.middleware
async def problem_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every refusal into problem details (DESIGN.md §5)."""
    try:
        return await handler(request)
    except ServiceError as exc:
        return problem_response(Problem.of(exc.problem, exc.detail), headers=exc.headers)
    except RecordError as exc:
        return problem_response(Problem.of(problems.BAD_RECORD, str(exc)), extensions={"member": exc.member})
    except KvspError as exc:  # a descriptor (DescriptorError) or another core validation
        member = getattr(exc, "member", None) or "$"
        return problem_response(Problem.of(problems.BAD_RECORD, str(exc)), extensions={"member": member})
    except HttpProblem as exc:
        return problem_response(blank_problem(exc.status, exc.detail), headers=exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "www-authenticate")}
        if exc.status == 404:
            problem = Problem.of(problems.NOT_FOUND, f"no resource at {request.path}")
        else:
            problem = blank_problem(exc.status)
        return problem_response(problem, headers=headers)
    except ConnectionError:
        raise  # the client went away: nobody to answer
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return problem_response(blank_problem(500))


# ---------------------------------------------------------------------------------------------
# Requests


def authenticate(request: web.Request) -> Principal:
    """The principal of a request's bearer token; ``Unauthorized`` (401) otherwise."""
    return request.app[AUTHORIZER].authenticate(request.headers.get("Authorization"))


async def read_body(request: web.Request, max_octets: int, media_types: frozenset[str] = JSON_MEDIA_TYPES) -> bytes:
    """The request body, if its media type is one of ``media_types`` (415 otherwise) and it
    has at most ``max_octets`` octets (413 otherwise, before reading when Content-Length says
    so)."""
    if request.content_type not in media_types or not _utf8_charset(request):
        accepted = ", ".join(sorted(media_types))
        raise HttpProblem(415, f"the body must be one of {accepted} (UTF-8), not {request.content_type}")
    if request.content_length is not None and request.content_length > max_octets:
        raise HttpProblem(413, f"the body exceeds {max_octets} octets")
    body = bytearray()
    async for chunk in request.content.iter_chunked(64 * 1024):
        if len(body) + len(chunk) > max_octets:
            raise HttpProblem(413, f"the body exceeds {max_octets} octets")
        body += chunk
    return bytes(body)


def _utf8_charset(request: web.Request) -> bool:
    charset = request.charset
    return charset is None or charset.lower() in ("utf-8", "utf8")


async def read_json_object(request: web.Request, max_octets: int) -> dict[str, object]:
    """A JSON object body (I-JSON, ``decode_json``); ``RecordError`` at ``$`` otherwise."""
    return decode_json(await read_body(request, max_octets), max_size=max_octets)


async def read_record(request: web.Request, record_type: type[R], max_octets: int) -> R:
    """A JSON body validated as ``record_type`` (unknown members ignored, §4.4)."""
    return parse_json(await read_body(request, max_octets), record_type, max_size=max_octets)


def path_session(request: web.Request) -> uuid.UUID:
    """The ``{session}`` segment (already matched as a UUID)."""
    return uuid.UUID(request.match_info["session"])


async def read_block_body(request: web.Request, max_octets: int) -> memoryview:
    """A ``application/kvsp-block`` body (415 otherwise) of at most ``max_octets`` (413),
    read into one buffer: with Content-Length it is allocated once at its final size and
    filled in place, so the body is held once (the store then copies each section once into
    its tier)."""
    if request.content_type != BLOCK_MEDIA_TYPE:
        raise HttpProblem(415, f"the body must be {BLOCK_MEDIA_TYPE}, not {request.content_type}")
    length = request.content_length
    if length is not None and length > max_octets:
        raise HttpProblem(413, f"the body exceeds {max_octets} octets")
    if length is not None:
        buf = bytearray(length)
        view = memoryview(buf)
        pos = 0
        async for chunk in request.content.iter_chunked(256 * 1024):
            view[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
        return view[:pos]
    grown = bytearray()
    async for chunk in request.content.iter_chunked(256 * 1024):
        if len(grown) + len(chunk) > max_octets:
            raise HttpProblem(413, f"the body exceeds {max_octets} octets")
        grown += chunk
    return memoryview(grown)


# ---------------------------------------------------------------------------------------------
# Application and server


def build_app(*, auth: Authorizer, routes: Iterable[web.RouteDef] = ()) -> web.Application:
    """One application serving ``routes`` (the route tables of the roles it runs), all
    authenticated by ``auth``; each role's ``serve.py`` adds its service and background work."""
    install_access_log()
    # tracing outermost: it sees the status of every answer, problems included
    app = web.Application(middlewares=[trace_middleware, problem_middleware])
    app.on_response_prepare.append(on_prepare)
    app[AUTHORIZER] = auth
    app.add_routes(list(routes))
    return app


@dataclass
class RunningServer:
    """A started server; ``port`` is the bound port (also when 0 was asked for)."""

    runner: web.AppRunner
    host: str
    port: int
    base_path: str = "/"
    #: ``https`` when served with a certificate (``[tls] cert`` / ``key``).
    scheme: str = "http"

    @property
    def app(self) -> web.Application:
        return self.runner.app

    @property
    def url(self) -> str:
        """The base URL of the served role (``http://127.0.0.1:PORT/base/``, or ``https://``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.base_path}"

    async def close(self) -> None:
        await self.runner.cleanup()

    async def __aenter__(self) -> RunningServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def serve_app(app: web.Application, host: str = "127.0.0.1", port: int = 0, *, base_path: str = "/",
                    ssl_context: ssl.SSLContext | None = None) -> RunningServer:
    """Serve ``app`` on ``host:port`` until :meth:`RunningServer.close`: HTTPS with
    ``ssl_context`` (``TlsConfig.server_ssl_context``: the ``[tls]`` certificate and key, TLS
    1.2 or later), plain HTTP without."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
        await site.start()
        bound = runner.addresses[0]
    except BaseException:
        await runner.cleanup()
        raise
    return RunningServer(runner, host, int(bound[1]), base_path, "https" if ssl_context is not None else "http")


class BoundUrl:
    """A role's own URL, known once the server is bound when the configuration names none."""

    def __init__(self, url: str | None) -> None:
        self.url = url

    def __call__(self) -> str:
        if self.url is None:
            raise RuntimeError("the URL is not known yet")
        return self.url
