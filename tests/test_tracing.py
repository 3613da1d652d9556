"""Request tracing across the roles (W3C ``traceparent``; ``control/common/tracing.py``,
``control/http/tracing.py``; docs/tracing.md).

The parser against the spec's rules, the server middleware (a valid caller's span continued, a
malformed header ignored and a new trace started, the span on every answer, streamed ones too),
and one request followed for real: ``POST {fe}sessions`` with a known ``traceparent`` on a
cluster of real role servers (IS, holder, PC and front end in this process, their request lines
captured with caplog; an inference instance as a ``python -m kvsp_moq instance`` process with
``KVSP_ACCESS_LOG=1``, its lines read from its stderr): every role's request line carries the
trace ID, and the parent IDs form a chain (each server span a child of a client span of the
caller, each client span a child of the caller's server span).
"""

from __future__ import annotations

import logging
import re
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvsp_moq.control.common import tracing
from kvsp_moq.control.common.auth import Authorizer
from kvsp_moq.control.common.tracing import TraceContext, parse_traceparent
from kvsp_moq.control.http.server import build_app, serve_app

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
VALID = f"00-{TRACE}-{PARENT}-01"


# ---------------------------------------------------------------------------------------------
# the header


def test_parse_valid_traceparent() -> None:
    ctx = parse_traceparent(VALID)
    assert ctx == TraceContext(TRACE, PARENT, None, 1)
    assert ctx is not None and ctx.traceparent == VALID and ctx.sampled
    assert parse_traceparent([f"00-{TRACE}-{PARENT}-00"]) == TraceContext(TRACE, PARENT, None, 0)
    # a later version: its first four fields, more after a '-' (§3.2.4 / §4.3)
    assert parse_traceparent(f"cc-{TRACE}-{PARENT}-01-what-the-future-holds") == TraceContext(TRACE, PARENT, None, 1)
    assert parse_traceparent(f"cc-{TRACE}-{PARENT}-01") is not None


@pytest.mark.parametrize("value", [
    "", "garbage", f"00-{TRACE}-{PARENT}-1", f"00-{TRACE}-{PARENT}-01-", f"00-{TRACE}-{PARENT}-010",
    f"ff-{TRACE}-{PARENT}-01",  # version ff is invalid
    f"00-{TRACE.upper()}-{PARENT}-01",  # uppercase hex is invalid
    f"00-{'0' * 32}-{PARENT}-01", f"00-{TRACE}-{'0' * 16}-01",  # all zeros is invalid
    f"00-{TRACE}-{PARENT}-0g", f"0-{TRACE}-{PARENT}-01", f"00_{TRACE}-{PARENT}-01",
    f"cc-{TRACE}-{PARENT}-01x",  # a later version, but no '-' after the flags
])
def test_malformed_traceparent_is_ignored(value: str) -> None:
    assert parse_traceparent(value) is None


def test_several_traceparent_headers_are_invalid() -> None:
    assert parse_traceparent([VALID, VALID]) is None
    assert parse_traceparent([]) is None and parse_traceparent(None) is None


def test_child_keeps_trace_and_flags() -> None:
    root = TraceContext.new()
    assert re.fullmatch("[0-9a-f]{32}", root.trace_id) and re.fullmatch("[0-9a-f]{16}", root.span_id)
    child = root.child()
    assert (child.trace_id, child.parent_id, child.flags) == (root.trace_id, root.span_id, root.flags)
    assert child.span_id != root.span_id


# ---------------------------------------------------------------------------------------------
# the middleware on a real server


LINE = re.compile(r"(?P<role>\S+) (?P<method>\S+) (?P<target>\S+) (?P<status>\S+) [0-9.]+ms "
                  r"trace_id=(?P<trace_id>[0-9a-f]{32}) span_id=(?P<span_id>[0-9a-f]{16}) "
                  r"parent_id=(?P<parent_id>[0-9a-f]{16}|-)")


def parse_line(text: str) -> dict[str, str] | None:
    m = LINE.search(text)
    return m.groupdict() if m else None


async def _server_with(routes: list[web.RouteDef]) -> Any:
    return await serve_app(build_app(auth=Authorizer.from_tokens({}), routes=routes))


async def test_server_continues_a_valid_trace_and_answers_its_span(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[TraceContext | None] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(tracing.current())
        return web.json_response({})

    async def streamed(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)  # headers go now: the span must already be on them
        await response.write(b"x\n")
        return response

    caplog.set_level(logging.INFO, logger="kvsp.access")
    async with await _server_with([web.get("/t", handler), web.get("/s", streamed)]) as server, \
            aiohttp.ClientSession() as http:
        async with http.get(f"{server.url}t", headers={"traceparent": VALID}) as resp:
            answered = parse_traceparent(resp.headers["traceparent"])
        async with http.get(f"{server.url}s", headers={"traceparent": VALID}) as resp:
            streamed_answer = parse_traceparent(resp.headers["traceparent"])
            await resp.read()
        async with http.get(f"{server.url}nowhere", headers={"traceparent": VALID}) as resp:
            assert resp.status == 404  # a problem answer is traced too
            problem_answer = parse_traceparent(resp.headers["traceparent"])
    (ctx,) = seen
    assert ctx is not None and ctx.trace_id == TRACE and ctx.parent_id == PARENT
    assert answered is not None and answered.trace_id == TRACE and answered.span_id == ctx.span_id
    for other in (streamed_answer, problem_answer):
        assert other is not None and other.trace_id == TRACE and other.span_id not in (PARENT, ctx.span_id)
    lines = [parse_line(r.getMessage()) for r in caplog.records if r.name == "kvsp.access"]
    assert [(line["target"], line["status"]) for line in lines if line] == [("/t", "200"), ("/s", "200"),
                                                                             ("/nowhere", "404")]
    first = caplog.records[0]
    assert (first.trace_id, first.span_id, first.parent_id) == (TRACE, ctx.span_id, PARENT)  # type: ignore[attr-defined]


async def test_malformed_traceparent_starts_a_new_trace(caplog: pytest.LogCaptureFixture) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({})

    caplog.set_level(logging.INFO, logger="kvsp.access")
    bad = f"00-{TRACE}-{PARENT}-01-extra"  # version 00 must be exactly 55 characters
    async with await _server_with([web.get("/t", handler)]) as server, aiohttp.ClientSession() as http:
        async with http.get(f"{server.url}t", headers={"traceparent": bad}) as resp:
            answered = parse_traceparent(resp.headers["traceparent"])
        async with http.get(f"{server.url}t") as resp:
            fresh = parse_traceparent(resp.headers["traceparent"])
    assert answered is not None and answered.trace_id != TRACE
    assert fresh is not None and fresh.trace_id not in (TRACE, answered.trace_id)
    lines = [parse_line(r.getMessage()) for r in caplog.records if r.name == "kvsp.access"]
    assert [(line["trace_id"], line["parent_id"]) for line in lines if line] == [
        (answered.trace_id, "-"), (fresh.trace_id, "-")]


async def test_client_library_propagates_only_inside_a_trace(caplog: pytest.LogCaptureFixture) -> None:
    """The client library's middleware: a call made while serving a request (or in a task it
    spawned) is a child span; one made outside any trace sends no header."""
    from kvsp_moq.control.client.http import HttpClient

    got: list[str | None] = []
    import asyncio

    async def callee(request: web.Request) -> web.Response:
        got.append(request.headers.get("traceparent"))
        return web.json_response({})

    caplog.set_level(logging.INFO, logger="kvsp.access")
    async with await _server_with([web.get("/callee", callee)]) as b:
        client = HttpClient(None)

        async def caller(request: web.Request) -> web.Response:
            await client._call("GET", f"{b.url}callee")
            task = asyncio.ensure_future(client._call("GET", f"{b.url}callee"))  # background work
            await task
            return web.json_response({})

        async with await _server_with([web.get("/caller", caller)]) as a, aiohttp.ClientSession() as http:
            await client._call("GET", f"{b.url}callee")  # no trace here: no header
            async with http.get(f"{a.url}caller", headers={"traceparent": VALID}) as resp:
                assert resp.status == 200
        await client.close()
    assert got[0] is None
    children = [parse_traceparent(v) for v in got[1:]]
    records = [r for r in caplog.records if r.name == "kvsp.access"]
    caller_line = next(r for r in records if getattr(r, "route", "") == "/caller")
    client_lines = [r for r in records if getattr(r, "kind", "") == "client"]
    assert len(client_lines) == 2
    for child, line in zip(children, client_lines):
        assert child is not None and child.trace_id == TRACE
        assert child.span_id == line.span_id and line.parent_id == caller_line.span_id  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# one request across the roles


def _lines_of(texts: list[str]) -> list[dict[str, str]]:
    return [line for text in texts if (line := parse_line(text)) is not None]


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], bytes]:
    torch = pytest.importorskip("torch")
    from kvsp_moq.kvsp.compat import compat_id
    from kvsp_moq.model import build_descriptor, ensure_model_files

    from test_migration_support import B

    torch.set_num_threads(1)
    files = ensure_model_files(directory=tmp_path_factory.mktemp("model"))
    descriptor = build_descriptor(files, block_tokens=B)
    return files.directory, descriptor, compat_id(descriptor)


async def test_one_session_followed_from_the_front_end_to_the_holder(
        tmp_path: Path, model_files: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvsp_moq.model import ByteTokenizer

    from test_migration_support import PROMPT, SCOPE_ID, TOKEN, cluster, guarded, sampler_json

    model_dir, descriptor, compat = model_files
    monkeypatch.setenv("KVSP_ACCESS_LOG", "1")  # the instance process writes its lines to stderr
    caplog.set_level(logging.INFO, logger="kvsp.access")
    ids = ByteTokenizer().encode(PROMPT)  # 55 tokens: 3 complete blocks of 16, computed and published
    async with cluster(tmp_path, model_dir, descriptor, compat) as c:
        instance = await c.start_instance("a")
        before = len(caplog.records)
        body = {"compat_id": compat.hex(), "scope_id": SCOPE_ID.hex(), "prompt_blocks": [], "prompt_tail": ids,
                "tokens": len(ids), "sampler": sampler_json("greedy"), "max_tokens": 12}
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/kvsp+json",
                   "traceparent": VALID}
        async with c.http.post(f"{c.fe.url}sessions", json=body, headers=headers) as resp:
            assert resp.status == 201, await resp.text()
            started = await resp.json()
            answered = parse_traceparent(resp.headers["traceparent"])
        uuid.UUID(started["session"])
        lines = await guarded(c.stream(started["tokens_url"]))
        assert lines[-1] == {"end": 12}
    # the instance process has exited (the cluster stopped it): its stderr is complete
    here = _lines_of([r.getMessage() for r in caplog.records[before:] if r.name == "kvsp.access"])
    there = _lines_of(c.instances[instance].log.read_text().splitlines())
    traced = [line for line in here + there if line["trace_id"] == TRACE]
    servers = [line for line in traced if line["role"] != "client"]
    clients = {line["span_id"]: line for line in traced if line["role"] == "client"}
    by_span = {line["span_id"]: line for line in servers}
    assert {line["role"] for line in servers} >= {"frontend", "pc", "instance", "index", "holder"}, servers

    # the front end's span is the caller's child and is what the answer names
    (fe,) = [line for line in servers if line["role"] == "frontend" and line["target"] == "/sessions"]
    assert fe["parent_id"] == PARENT
    assert answered is not None and (answered.trace_id, answered.span_id) == (TRACE, fe["span_id"])
    # every other server span: child of a client span, itself a child of the calling role's span
    for line in servers:
        if line is fe:
            continue
        call = clients.get(line["parent_id"])
        assert call is not None, (line, clients)
        assert call["target"].endswith(line["target"]), (call, line)
        assert call["parent_id"] in by_span, call
    # the chain FE -> PC -> instance -> IS and holder, each hop one parent link
    def chain(line: dict[str, str]) -> list[str]:
        roles = [line["role"]]
        while line is not fe:
            line = by_span[clients[line["parent_id"]]["parent_id"]]
            roles.append(line["role"])
        return roles[::-1]

    chains = {tuple(chain(line)) for line in servers}
    assert ("frontend", "pc") in chains
    # the session's work on the instance (spawned by the PC's start order) keeps the trace: its
    # IS lookup, its block PUT to the holder (whose replica record goes on to the IS), its
    # tokens to the front end and its checkpoints to the PC
    assert {("frontend", "pc", "instance", "index"), ("frontend", "pc", "instance", "holder"),
            ("frontend", "pc", "instance", "holder", "index"), ("frontend", "pc", "instance", "frontend"),
            ("frontend", "pc", "instance", "pc")} <= chains, chains
