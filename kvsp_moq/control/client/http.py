"""HTTP clients of the control-plane roles (DESIGN.md §5; docs/http-api.md), each behind the
transport-neutral interface the service that calls it defines. An engine embeds them without
importing any route code:

- :class:`HttpIndexClient` — the Index Service (``client.publisher.IndexClient``, ``pc.service.PcIndex``,
  ``instance.prefetch.ReplicaSource``): publish, withdraw, lookup, instance status, replicas;
- :class:`HttpBlockFetcher` — blocks from holders (``client.retrieval.BlockFetcher``, §6.7);
- :class:`HttpBlockStorer` — a holder's block PUT (§6.7); its leases (§6.6): ``client/http_leases.py``;
- :class:`HttpInstanceClient` — the PC's calls to instances (§6.3, §6.5, §6.8, §6.9);
- :class:`HttpPcClient` — an instance's and a front end's calls to the PC (§6.3, §6.8);
- :class:`HttpFrontEndClient` — output delivery and a client's session stream (§6.8);
- :class:`HttpShardFetcher` — token ranges from a peer instance (§6.9).

TLS (docs/security.md): the sessions they make verify servers per ``tls`` (``[tls]``,
``common/tls.py``: ``ca_file`` or the system store), and a request carrying a bearer token to a
``http://`` URL other than loopback is refused before it is sent (:class:`PlainHttpRefused`, an
``aiohttp.ClientError``) unless ``[tls] allow_plain_http``; the clients with a base URL refuse it
at construction (``ConfigError``). While a trace is current, every request carries its
``traceparent`` (a child span; docs/tracing.md). A ``session`` passed in is used as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from urllib.parse import quote, urljoin

import aiohttp

from ...kvsp import problems
from ...kvsp.container import decode_container
from ...kvsp.errors import KvspError, RecordError
from ...kvsp.records import (
    InstanceStatusRecord,
    LookupRequest,
    LookupResponse,
    MatchedBlock,
    PrefetchDirective,
    Problem,
    Record,
    ReplicaRecord,
    ReshardMessage,
    ReshardPlan,
    SessionCheckpoint,
    StateChange,
    decode_json,
    dump_json,
    parse_json,
)
from ...kvsp.records.lookup_wire import (COMPACT_LOOKUP_MEDIA_TYPE, DEFAULT_MAX_ANSWER_OCTETS, decode_compact_answer,
                                          encode_compact_request, json_lookup_request)
from ...kvsp.records.replica_json import dump_replica
from ...storage import RecordKey
from ..common.errors import (
    ConfigError,
    FrontEndUnreachable,
    InstanceUnreachable,
    PeerUnreachable,
    SessionOpenFailed,
    ShardFetchFailed,
    Superseded,
)
from ..common.media import BLOCK_MEDIA_TYPE, KVSP_JSON
from ..common.records import StatusAnswer
from ..common.session_records import (
    MAX_OUTPUT_TOKENS,
    CheckpointAck,
    ClientSession,
    ClientSessionRequest,
    OutputToken,
    OutputTokens,
    ReshardAck,
    SessionDone,
    SessionFailed,
    SessionOpen,
    SessionOrder,
    SessionView,
    StreamEnd,
    StreamFailed,
)
from ..common.shard_store import ShardSlice, TokenRange
from ..common import tracing
from ..common.tls import TlsConfig
from .publisher import IndexRefused, IndexUnreachable
from .retrieval import parse_repr_digest

__all__ = [
    "HttpBlockFetcher",
    "HttpBlockResponse",
    "HttpBlockStorer",
    "HttpClient",
    "HttpFrontEndClient",
    "HttpIndexClient",
    "HttpInstanceClient",
    "HttpPcClient",
    "HttpShardFetcher",
    "PcRefused",
    "ANSWER_LOST",
    "NOT_REACHED",
    "TRANSPORT_ERRORS",
    "PlainHttpRefused",
]


class PlainHttpRefused(aiohttp.ClientError):
    """A bearer token would have crossed plain HTTP to a host other than loopback (refused
    before sending; ``[tls] allow_plain_http`` allows it)."""


def _token_guard(tls: TlsConfig) -> aiohttp.ClientMiddlewareType:
    """A client middleware: every request with an Authorization header goes to a URL
    :meth:`TlsConfig.token_url_allowed` accepts, or :class:`PlainHttpRefused` is raised."""

    async def guard(request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType) -> aiohttp.ClientResponse:
        if "Authorization" in request.headers and not tls.token_url_allowed(str(request.url)):
            raise PlainHttpRefused(f"refusing to send a bearer token over plain HTTP to {request.url.host}"
                                   " (use https://, or [tls] allow_plain_http)")
        return await handler(request)

    return guard


async def _trace(request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType) -> aiohttp.ClientResponse:
    """A client middleware: while a trace is current (a request being served, or work it
    spawned), each call is a child span whose ``traceparent`` the request carries
    (``common/tracing.py``; docs/tracing.md)."""
    span = tracing.client_span(request.method, str(request.url))
    if span is None:
        return await handler(request)
    request.headers[tracing.TRACEPARENT] = span.context.traceparent
    try:
        response = await handler(request)
    except BaseException as exc:
        span.finish(None, exc)
        tracing.log_call(span, None, exc)
        raise
    span.finish(response.status)
    tracing.log_call(span, response.status)
    return response


def _new_session(tls: TlsConfig) -> aiohttp.ClientSession:
    """A client session verifying servers per ``tls``, guarding tokens and propagating the
    current trace (module notes)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls.client_ssl),
                                 middlewares=(_token_guard(tls), _trace))


def _check_base_url(tls: TlsConfig, what: str, url: str, token: str | None) -> None:
    if token and not tls.token_url_allowed(url):
        raise ConfigError(what, f"{url}: a bearer token would cross plain HTTP to a host other than"
                                " loopback; use https:// (or [tls] allow_plain_http = true)")


async def _problem_of(response: aiohttp.ClientResponse) -> tuple[str | None, str]:
    """(KVSP problem name, detail) of an error response's problem details, if it has one."""
    if response.content_type != problems.PROBLEM_MEDIA_TYPE:
        return None, response.reason or ""
    try:
        body = await response.content.read(64 * 1024)
        problem = Problem.from_json(json.loads(body))
    except (ValueError, KvspError, aiohttp.ClientError):
        return None, response.reason or ""
    return problem.name, problem.detail or ""


#: What a lookup accepts: the compact answer, else the §6.2 JSON (docs/http-api.md).
_LOOKUP_ACCEPT = f"{COMPACT_LOOKUP_MEDIA_TYPE}, {KVSP_JSON};q=0.5"


async def _read_bounded(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body, at most ``limit`` octets (RecordError beyond: a declared Content-Length is
    refused before anything is read, an undeclared body once it passes the limit)."""
    if response.content_length is not None:
        if response.content_length > limit:
            raise RecordError("$", f"answer of {response.content_length} octets exceeds the limit of {limit}")
        return await response.read()
    body = bytearray()
    async for chunk in response.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > limit:
            raise RecordError("$", f"answer exceeds the limit of {limit} octets")
    return bytes(body)


class HttpIndexClient:
    """:class:`~.client.publisher.IndexClient` over HTTP (docs/http-api.md "Index Service")."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        *,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float = 10.0,
        tls: TlsConfig | None = None,
        max_answer_octets: int = DEFAULT_MAX_ANSWER_OCTETS,
    ) -> None:
        self.base_url = base_url if base_url.endswith("/") else base_url + "/"
        self._tls = tls or TlsConfig()
        _check_base_url(self._tls, "index_url", self.base_url, token)
        self._token = token
        self._session = session
        self._owned = session is None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.max_answer_octets = max_answer_octets  #: the largest lookup answer read (either form)
        self._compact_requests = True  # until the IS refuses a compact request with 415

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = _new_session(self._tls)
        return self._session

    def _url(self, key_path: str) -> str:
        return f"{self.base_url}replicas/{key_path}"

    async def publish(self, record: ReplicaRecord) -> ReplicaRecord:
        path = f"{record.compat_id.hex()}/{record.scope_id.hex()}/{record.block_key.hex()}"
        headers = self._headers() | {"Content-Type": KVSP_JSON}
        try:
            async with self._client().put(self._url(path), data=dump_json(record), headers=headers, timeout=self._timeout) as resp:
                if resp.status in (200, 201):
                    return parse_json(await resp.read(), ReplicaRecord)
                await self._raise(resp)
        except (aiohttp.ClientError, asyncio.TimeoutError, KvspError) as exc:
            raise IndexUnreachable(f"PUT {path}: {type(exc).__name__}: {exc}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def publish_many(self, records: list[ReplicaRecord]) -> list[ReplicaRecord]:
        """``POST {is}replicas:batch`` (ours): PUT of each record in one request (a holder's
        batched refresh, §6.1); the records as stored (``ttl_ms`` = the granted TTL), in order.
        An IS without the route answers 404 or 405: :class:`IndexRefused` with that status."""
        body = b'{"records":[' + b",".join([dump_replica(r) for r in records]) + b"]}"  # dump_json's octets
        headers = self._headers() | {"Content-Type": KVSP_JSON}
        url = f"{self.base_url}replicas:batch"
        try:
            async with self._client().post(url, data=body, headers=headers, timeout=self._timeout) as resp:
                if resp.status == 200:
                    results = decode_json(await resp.read()).get("results")
                    if not isinstance(results, list) or len(results) != len(records):
                        raise RecordError("results", "must list one result per record")
                    return [_granted(record, result) for record, result in zip(records, results)]
                await self._raise(resp)
        except (aiohttp.ClientError, asyncio.TimeoutError, KvspError) as exc:
            raise IndexUnreachable(f"POST replicas:batch: {type(exc).__name__}: {exc}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def withdraw(self, key: RecordKey, holder: str, moqt_namespace: str | None) -> bool:
        params = {"holder": holder}
        if moqt_namespace is not None:
            params["moqt_namespace"] = moqt_namespace
        try:
            async with self._client().delete(self._url(key.path), params=params, headers=self._headers(), timeout=self._timeout) as resp:
                if resp.status == 204:
                    return True
                if resp.status == 404:
                    return False  # already gone (expired, or withdrawn before)
                await self._raise(resp)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise IndexUnreachable(f"DELETE {key.path}: {type(exc).__name__}: {exc}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def lookup(self, request: LookupRequest) -> LookupResponse:
        """``POST {is}lookup`` (§6.2), for the PC (``pc.service.PcIndex``) and the engines:
        request and answer in the compact form (docs/http-api.md "Compact lookup answer"), or
        JSON from an IS without it (a 415 to the compact request: JSON from then on). The
        answer is read up to ``max_answer_octets`` and checked as an answer to ``request``;
        anything else is :class:`IndexUnreachable` naming the fault."""
        try:
            if self._compact_requests:
                answer = await self._lookup(request, encode_compact_request(request), COMPACT_LOOKUP_MEDIA_TYPE)
                if answer is not None:
                    return answer
                self._compact_requests = False  # 415: an IS without the compact request
            answer = await self._lookup(request, json_lookup_request(request), KVSP_JSON)
            if answer is None:
                raise IndexUnreachable("lookup: status 415: the IS refuses the JSON request")
            return answer
        except (aiohttp.ClientError, asyncio.TimeoutError, KvspError) as exc:
            raise IndexUnreachable(f"lookup: {type(exc).__name__}: {exc}") from exc

    async def _lookup(self, request: LookupRequest, body: bytes, media_type: str) -> LookupResponse | None:
        """One lookup with ``body`` of ``media_type``; None when the IS answers 415."""
        headers = self._headers() | {"Content-Type": media_type, "Accept": _LOOKUP_ACCEPT}
        async with self._client().post(f"{self.base_url}lookup", data=body, headers=headers, timeout=self._timeout) as resp:
            if resp.status == 415:
                return None
            if resp.status != 200:
                name, detail = await _problem_of(resp)
                raise IndexUnreachable(f"lookup: status {resp.status} {name or ''}: {detail}")
            data = await _read_bounded(resp, self.max_answer_octets)
            if resp.content_type == COMPACT_LOOKUP_MEDIA_TYPE:
                return decode_compact_answer(data, request)
            if resp.content_type != KVSP_JSON:
                raise RecordError("$", f"lookup answer of media type {resp.content_type!r}")
            answer = parse_json(data, LookupResponse, max_size=self.max_answer_octets)
            if not answer.answers(request):
                raise RecordError("blocks", "the answer's blocks are not the request's leading keys, compat_id and scope_id (§6.2)")
            return answer

    async def report_status(self, record: InstanceStatusRecord) -> None:
        """``PUT {is}instance-status``: the PC passes on the statuses it receives (§6.4 inputs)."""
        status, _, name, detail = await _call(self._client(), "PUT", f"{self.base_url}instance-status", self._token, record, self._timeout)
        if status != 200:
            raise IndexRefused(status, name, detail)

    async def replicas(self, key: RecordKey) -> list[ReplicaRecord]:
        """``GET {is}replicas/{compat}/{scope}/{key}`` (ours): the unexpired records of a block,
        for an instance executing a directive (``instance.prefetch.ReplicaSource``); [] on 404."""
        status, body, name, detail = await _call(self._client(), "GET", self._url(key.path), self._token, None, self._timeout)
        if status == 404:
            return []
        if status != 200:
            raise IndexUnreachable(f"replicas of {key}: status {status} {name or ''}: {detail}")
        return list(parse_json(body, MatchedBlock).replicas)

    @staticmethod
    async def _raise(resp: aiohttp.ClientResponse) -> None:
        name, detail = await _problem_of(resp)
        if 400 <= resp.status < 500 and resp.status not in (408, 429):
            raise IndexRefused(resp.status, name, detail)
        raise IndexUnreachable(f"status {resp.status} {name or ''}: {detail}")

    async def close(self) -> None:
        if self._owned and self._session is not None:
            await self._session.close()
            self._session = None


def _granted(record: ReplicaRecord, result: object) -> ReplicaRecord:
    """``record`` with the TTL one batch result granted it."""
    ttl = result.get("ttl_ms") if isinstance(result, dict) else None
    if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1:
        raise RecordError("results[].ttl_ms", "must be an integer >= 1")
    return record if ttl == record.ttl_ms else dataclasses.replace(record, ttl_ms=ttl)


@dataclass
class HttpBlockResponse:
    """:class:`~.client.retrieval.BlockResponse` of an aiohttp response."""

    response: aiohttp.ClientResponse
    problem: str | None
    chunk_octets: int

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def content_type(self) -> str | None:
        return self.response.headers.get("Content-Type")

    @property
    def content_length(self) -> int | None:
        return self.response.content_length

    @property
    def repr_digest(self) -> str | None:
        return self.response.headers.get("Repr-Digest")

    async def chunks(self) -> AsyncIterator[bytes]:
        async for chunk in self.response.content.iter_chunked(self.chunk_octets):
            yield chunk


class HttpBlockFetcher:
    """:class:`~.client.retrieval.BlockFetcher` over HTTP: GET with the client's bearer token.

    ``read_timeout_s`` bounds the wait for each read from the holder (connecting, the status
    line, every part of the body): a holder that stops sending mid-body fails this replica
    with a timeout after that long, and ``client.retrieval.retrieve_block`` tries the next replica,
    instead of the request waiting up to ``timeout_s`` (the bound on the whole transfer).
    """

    def __init__(
        self,
        token: str | None,
        *,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float = 60.0,
        read_timeout_s: float | None = 5.0,
        chunk_octets: int = 256 * 1024,
        tls: TlsConfig | None = None,
    ) -> None:
        self._tls = tls or TlsConfig()
        self._token = token
        self._session = session
        self._owned = session is None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=read_timeout_s, sock_read=read_timeout_s)
        self.chunk_octets = chunk_octets

    @contextlib.asynccontextmanager
    async def get(self, url: str) -> AsyncIterator[HttpBlockResponse]:
        if self._session is None:
            self._session = _new_session(self._tls)
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        # No automatic decompression: Repr-Digest covers the representation as sent.
        async with self._session.get(url, headers=headers, timeout=self._timeout, auto_decompress=False) as resp:
            problem = None
            if resp.status >= 400:
                problem, _ = await _problem_of(resp)
            yield HttpBlockResponse(resp, problem, self.chunk_octets)

    async def close(self) -> None:
        if self._owned and self._session is not None:
            await self._session.close()
            self._session = None


async def _call(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    token: str | None,
    body: Record | None,
    timeout: aiohttp.ClientTimeout,
    extra_headers: Mapping[str, str] | None = None,
) -> tuple[int, bytes, str | None, str]:
    """One JSON request: (status, body, problem name, problem detail). Transport errors raise
    ``aiohttp.ClientError`` / ``asyncio.TimeoutError``."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    headers.update(extra_headers or {})
    data = None
    if body is not None:
        data = dump_json(body)
        headers["Content-Type"] = KVSP_JSON
    async with session.request(method, url, data=data, headers=headers, timeout=timeout) as resp:
        if resp.status >= 400:
            name, detail = await _problem_of(resp)
            return resp.status, b"", name, detail
        return resp.status, await resp.read(), None, ""


#: What a call raises when no answer came (the peer unreachable, the connection lost, a timeout).
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, asyncio.TimeoutError)
#: Of those, the errors after which the request may have been applied and only its answer lost
#: (the connection dropped once it was sent): a call safe to repeat may be tried again ...
ANSWER_LOST: tuple[type[BaseException], ...] = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                                                aiohttp.ClientPayloadError)
#: ... except where it never reached the peer (connection refused, no route): nothing to recover.
NOT_REACHED: tuple[type[BaseException], ...] = (aiohttp.ClientConnectorError,)


class HttpClient:
    """A lazily created aiohttp session and a bearer token."""

    def __init__(self, token: str | None, *, session: aiohttp.ClientSession | None = None, timeout_s: float = 10.0,
                 tls: TlsConfig | None = None) -> None:
        self._tls = tls or TlsConfig()
        self._token = token
        self._session = session
        self._owned = session is None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = _new_session(self._tls)
        return self._session

    async def _call(self, method: str, url: str, body: Record | None = None,
                    headers: Mapping[str, str] | None = None) -> tuple[int, bytes, str | None, str]:
        return await _call(self._client(), method, url, self._token, body, self._timeout, headers)

    async def close(self) -> None:
        if self._owned and self._session is not None:
            await self._session.close()
            self._session = None


def _base(url: str) -> str:
    return url if url.endswith("/") else url + "/"


class HttpBlockStorer(HttpClient):
    """:class:`~.computed.BlockStorer` over HTTP: ``PUT {holder}blocks/...`` with
    ``If-None-Match: *`` (§6.7); an instance storing the blocks it computed."""

    async def put_block(self, holder: str, key: RecordKey, container: bytes) -> bool:
        headers = {"Content-Type": BLOCK_MEDIA_TYPE, "If-None-Match": "*"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        url = f"{_base(holder)}blocks/{key.path}"
        async with self._client().put(url, data=container, headers=headers, timeout=self._timeout) as resp:
            if resp.status == 201:
                return True
            if resp.status == 412:
                return False  # §6.7: the holder already has a replica and keeps it
            name, detail = await _problem_of(resp)
            raise IndexRefused(resp.status, name, f"PUT {url}: {detail}")


class HttpInstanceClient(HttpClient):
    """:class:`~.pc.service.InstanceClient` over HTTP: the PC's ``PUT state`` and ``POST prefetch``."""

    async def put_state(self, instance: str, state: str) -> str:
        try:
            status, body, name, detail = await self._call("PUT", f"{_base(instance)}state", StateChange(state=state))
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise InstanceUnreachable(f"{type(exc).__name__}: {exc}") from exc
        if status != 200:
            raise InstanceUnreachable(f"status {status} {name or ''}: {detail}")
        return parse_json(body, StatusAnswer).state

    async def prefetch(self, instance: str, directive: PrefetchDirective) -> str:
        url = f"{_base(instance)}prefetch"
        headers = {"Content-Type": KVSP_JSON} | ({"Authorization": f"Bearer {self._token}"} if self._token else {})
        try:
            async with self._client().post(url, data=dump_json(directive), headers=headers, timeout=self._timeout) as resp:
                if resp.status != 202:
                    name, detail = await _problem_of(resp)
                    raise InstanceUnreachable(f"status {resp.status} {name or ''}: {detail}")
                location = resp.headers.get("Location")
                if not location:
                    raise InstanceUnreachable("202 without Location")
                return urljoin(url, location)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise InstanceUnreachable(f"{type(exc).__name__}: {exc}") from exc

    async def _instance_call(self, method: str, url: str, body: Record | None, expect: int) -> bytes:
        try:
            status, data, name, detail = await self._call(method, url, body)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise InstanceUnreachable(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        if status != expect:
            raise InstanceUnreachable(f"{method} {url}: status {status} {name or ''}: {detail}")
        return data

    async def start_session(self, instance: str, order: SessionOrder) -> None:
        """``POST {ii}sessions/{id}/start`` (``pc.sessions.SessionInstanceClient``)."""
        await self._instance_call("POST", f"{_base(instance)}sessions/{order.session}/start", order, 202)

    async def resume_session(self, instance: str, order: SessionOrder) -> None:
        """``POST {ii}sessions/{id}/resume`` (§6.8)."""
        await self._instance_call("POST", f"{_base(instance)}sessions/{order.session}/resume", order, 202)

    async def reshard(self, instance: str, message: ReshardMessage) -> ReshardAck | None:
        """``POST {ii}reshard`` (§6.9, ``pc.reshard.ReshardClient``): a plan waits for the
        instance's fetches, so it gets no timeout of its own (the PC's deadline ends it)."""
        url = f"{_base(instance)}reshard"
        if isinstance(message, ReshardPlan):
            try:
                status, data, name, detail = await _call(self._client(), "POST", url, self._token, message,
                                                         aiohttp.ClientTimeout(total=None))
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise InstanceUnreachable(f"POST {url}: {type(exc).__name__}: {exc}") from exc
            if status != 200:
                raise InstanceUnreachable(f"POST {url}: status {status} {name or ''}: {detail}")
            try:
                return parse_json(data, ReshardAck)
            except RecordError as exc:
                raise InstanceUnreachable(f"POST {url}: bad acknowledgement: {exc}") from None
        await self._instance_call("POST", url, message, 200)
        return None


class PcRefused(Exception):
    """The PC refused a status report (e.g. 409 ``kvsp-stale-epoch``)."""

    def __init__(self, status: int, problem: str | None, detail: str) -> None:
        self.status = status
        self.problem = problem
        super().__init__(f"{status} {problem or ''}: {detail}")


#: 503 problems after which the next PC is tried: a standby, or one whose store is down.
PC_FAILOVER_PROBLEMS = (problems.NOT_LEADER, problems.UNAVAILABLE)
PC_ROUND_PAUSE_S = 0.1  # between two rounds over every PC URL, while the deadline allows


class HttpPcClient(HttpClient):
    """:class:`~.instance.reporter.PcClient` over HTTP: ``PUT {pc}instance-status``.

    ``pc_url`` may name several PCs (active/standby, ``pc/leader.py``). A call goes to the
    one that answered last; on a refused connection, a timeout or a 503 ``kvsp-not-leader`` /
    ``kvsp-unavailable`` it tries the next, each at most once per round, and rounds repeat
    (``PC_ROUND_PAUSE_S`` apart) until ``failover_ms`` has passed since the call began: enough
    for a standby to take over (about 4/3 of the PC's ``leader_lease_ms``). The last answer,
    or transport error, is the call's. With one URL: one attempt, as with a single PC.
    """

    def __init__(self, pc_url: str | tuple[str, ...] | list[str], token: str | None, *, failover_ms: int = 10_000,
                 **kw: object) -> None:
        super().__init__(token, **kw)  # type: ignore[arg-type]
        urls = [pc_url] if isinstance(pc_url, str) else list(pc_url)
        if not urls:
            raise ValueError("at least one PC URL is required")
        self.pc_urls = tuple(_base(u) for u in urls)
        for url in self.pc_urls:
            _check_base_url(self._tls, "pc_url", url, token)
        self.failover_s = failover_ms / 1000
        self._current = 0

    @property
    def pc_url(self) -> str:
        """The PC that answered last (the first, before any call)."""
        return self.pc_urls[self._current]

    async def _pc_call(self, method: str, path: str, body: Record | None = None) -> tuple[int, bytes, str | None, str]:
        """One call to the PCs, ``path`` relative to a PC's URL (see the class notes)."""
        if len(self.pc_urls) == 1:
            return await self._call(method, f"{self.pc_urls[0]}{path}", body)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.failover_s
        last: tuple[int, bytes, str | None, str] | BaseException | None = None
        while True:
            for step in range(len(self.pc_urls)):
                at = (self._current + step) % len(self.pc_urls)
                try:
                    answer = await self._call(method, f"{self.pc_urls[at]}{path}", body)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    last = exc
                    continue
                if answer[0] == 503 and answer[2] in PC_FAILOVER_PROBLEMS:
                    last = answer
                    continue
                self._current = at
                return answer
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            await asyncio.sleep(min(PC_ROUND_PAUSE_S, remaining))
        if isinstance(last, BaseException):
            raise last
        assert last is not None
        return last

    async def report(self, record: InstanceStatusRecord) -> StatusAnswer:
        status, body, name, detail = await self._pc_call("PUT", "instance-status", record)
        if status != 200:
            raise PcRefused(status, name, detail)
        return parse_json(body, StatusAnswer)

    async def _session_call(self, method: str, path: str, body: Record, expect: int) -> bytes:
        """For a running session (``instance.sessions.CheckpointSink``): ``Superseded`` on
        ``kvsp-stale-epoch``, ``PeerUnreachable`` on anything else."""
        try:
            status, data, name, detail = await self._pc_call(method, path, body)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise PeerUnreachable(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        if status == 409 and name == problems.STALE_EPOCH:
            raise Superseded(detail)
        if status != expect:
            raise PeerUnreachable(f"{method} {path}: status {status} {name or ''}: {detail}")
        return data

    async def checkpoint(self, checkpoint: SessionCheckpoint) -> CheckpointAck:
        """``PUT {pc}sessions/{id}/checkpoint`` (§6.8)."""
        data = await self._session_call("PUT", f"sessions/{checkpoint.session}/checkpoint", checkpoint, 200)
        try:
            return parse_json(data, CheckpointAck)
        except RecordError as exc:
            raise PeerUnreachable(f"bad checkpoint acknowledgement: {exc}") from None

    async def session_done(self, session: uuid.UUID, done: SessionDone) -> None:
        """``POST {pc}sessions/{id}/done`` (ours)."""
        await self._session_call("POST", f"sessions/{session}/done", done, 204)

    async def session_failed(self, session: uuid.UUID, failed: SessionFailed) -> None:
        """``POST {pc}sessions/{id}/failed`` (ours): this instance cannot serve the session."""
        await self._session_call("POST", f"sessions/{session}/failed", failed, 200)

    async def open_session(self, body: SessionOpen) -> SessionView:
        """``POST {pc}sessions`` (ours; ``frontend.service.SessionOpener``)."""
        try:
            status, data, name, detail = await self._pc_call("POST", "sessions", body)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise SessionOpenFailed(f"{type(exc).__name__}: {exc}") from exc
        if status != 201:
            raise SessionOpenFailed(f"status {status} {name or ''}: {detail}")
        try:
            return parse_json(data, SessionView)
        except RecordError as exc:
            raise SessionOpenFailed(f"bad answer: {exc}") from None


class HttpFrontEndClient(HttpClient):
    """Front ends over HTTP: an instance delivering output (``instance.sessions.TokenSink``),
    and a client starting a session and reading its stream."""

    async def deliver(self, front_end: str, batch: OutputTokens) -> None:
        """``POST {fe}sessions/{id}/tokens``; ``Superseded`` on ``kvsp-stale-epoch``."""
        url = f"{_base(front_end)}sessions/{batch.session}/tokens"
        try:
            status, _, name, detail = await self._call("POST", url, batch)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise PeerUnreachable(f"POST {url}: {type(exc).__name__}: {exc}") from exc
        if status == 409 and name == problems.STALE_EPOCH:
            raise Superseded(detail)
        if status != 200:
            raise PeerUnreachable(f"POST {url}: status {status} {name or ''}: {detail}")

    async def session_failed(self, front_end: str, session: uuid.UUID, notice: SessionFailed) -> None:
        """``POST {fe}sessions/{id}/failed`` (ours; ``pc.sessions.FrontEndNotifier``): the PC
        gave the session up. ``FrontEndUnreachable`` on anything but 204."""
        url = f"{_base(front_end)}sessions/{session}/failed"
        try:
            status, _, name, detail = await self._call("POST", url, notice)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise FrontEndUnreachable(f"POST {url}: {type(exc).__name__}: {exc}") from exc
        if status != 204:
            raise FrontEndUnreachable(f"POST {url}: status {status} {name or ''}: {detail}")

    async def start(self, front_end: str, request: ClientSessionRequest) -> ClientSession:
        """``POST {fe}sessions``: a new session, placed and started; ``PeerUnreachable`` otherwise."""
        status, data, name, detail = await self._call("POST", f"{_base(front_end)}sessions", request)
        if status != 201:
            raise PeerUnreachable(f"status {status} {name or ''}: {detail}")
        return parse_json(data, ClientSession)

    async def tokens(self, front_end: str, session: uuid.UUID,
                     start: int = 0) -> AsyncIterator[OutputToken | StreamEnd | StreamFailed]:
        """``GET {fe}sessions/{id}/tokens``: the output, in index order, then its end (or the
        session's failure); ``PeerUnreachable`` for a line that is none of these."""
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        url = f"{_base(front_end)}sessions/{session}/tokens"
        async with self._client().get(url, params={"from": str(start)}, headers=headers,
                                      timeout=aiohttp.ClientTimeout(total=None, sock_read=None)) as resp:
            if resp.status != 200:
                name, detail = await _problem_of(resp)
                raise PeerUnreachable(f"status {resp.status} {name or ''}: {detail}")
            async for line in resp.content:
                try:
                    item = decode_json(line)
                    if "failed" in item:
                        reason = item["failed"]
                        if not isinstance(reason, str):
                            raise RecordError("failed", "must be a string")
                        yield StreamFailed(reason=reason, next=_stream_count(item, "next"))
                        return
                    if "end" in item:
                        yield StreamEnd(end=_stream_count(item, "end"))
                        return
                    token = OutputToken.from_json(item)
                except RecordError as exc:
                    raise PeerUnreachable(f"{url}: bad stream line: {exc}") from None
                yield token


def _stream_count(line: Mapping[str, object], name: str) -> int:
    """``end`` or ``next`` of a token stream's last line: a number of output tokens."""
    value = line.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_OUTPUT_TOKENS:
        raise RecordError(name, f"must be a number of output tokens, got {value!r:.40}")
    return value


class HttpShardFetcher(HttpClient):
    """:class:`~.instance.reshard.ShardFetcher` over HTTP: ``GET {peer}shards/{map}/{v}?tokens=a-b``,
    the container's Repr-Digest verified (RFC 9530) and its Token Count checked."""

    def __init__(self, token: str | None, *, max_octets: int = 1 << 34, **kw: object) -> None:
        super().__init__(token, **kw)  # type: ignore[arg-type]
        self.max_octets = max_octets

    async def fetch(self, source: str, map_id: str, version: int, tokens: TokenRange) -> ShardSlice:
        url = f"{_base(source)}shards/{quote(map_id, safe='')}/{version}"
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        try:
            async with self._client().get(url, params={"tokens": f"{tokens[0]}-{tokens[1]}"}, headers=headers,
                                          timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False) as resp:
                if resp.status != 200:
                    name, detail = await _problem_of(resp)
                    raise ShardFetchFailed(f"{url}: status {resp.status} {name or ''}: {detail}")
                if resp.content_length is not None and resp.content_length > self.max_octets:
                    raise ShardFetchFailed(f"{url}: {resp.content_length} octets exceed {self.max_octets}")
                body = await resp.read()
                announced = resp.headers.get("Repr-Digest")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise ShardFetchFailed(f"{url}: {type(exc).__name__}: {exc}") from exc
        digest = parse_repr_digest(announced)
        if digest is None or digest != hashlib.sha256(body).digest():
            raise ShardFetchFailed(f"{url}: Repr-Digest missing or wrong")
        try:
            box = decode_container(body)
        except KvspError as exc:
            raise ShardFetchFailed(f"{url}: bad container: {exc}") from None
        if box.header.token_count != tokens[1] - tokens[0] or box.header.first_layer != 0:
            raise ShardFetchFailed(f"{url}: the container holds {box.header.token_count} tokens, not {tokens}")
        try:
            return ShardSlice(tokens, tuple((bytes(layer.k), bytes(layer.v)) for layer in box.layers()))
        except ValueError as exc:
            raise ShardFetchFailed(f"{url}: {exc}") from None
