"""Request tracing with OpenTelemetry installed (docs/tracing.md "OpenTelemetry").

OpenTelemetry is no dependency of kvsp_moq. This test installs ``opentelemetry-api`` and
``opentelemetry-sdk`` test-locally (``pip install --target`` into the test's temporary folder;
or uses ``$KVSP_TEST_OTEL_SITE``, a folder where they are, or this venv's own copy) and runs the
check in a child process with that folder on its path, so nothing of it reaches this process or
the venv; it is skipped, saying why, where they cannot be installed (no index reachable).

The child: an in-memory span exporter behind the SDK's tracer provider; server A (the control
plane's application, ``build_app``) whose handler calls server B through the KVSP client
library; one request to A with a known ``traceparent``. Spans: A's server span (tracer "kvsp",
kind SERVER, parent the caller's remote span, attributes kvsp.role, http.route, method and
status), the client span of the call (kind CLIENT, child of A's span), B's server span (child
of the client span); the IDs on the wire are the SDK's (A's answer names A's span).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHILD = r'''
import asyncio, json, sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)

import aiohttp
from aiohttp import web
from kvsp_moq.control.client.http import HttpClient
from kvsp_moq.control.common import tracing
from kvsp_moq.control.common.auth import Authorizer
from kvsp_moq.control.http.server import build_app, serve_app

TRACE, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"

async def main():
    assert tracing.OTEL_AVAILABLE
    auth = Authorizer.from_tokens({})
    async def callee(request):
        return web.json_response({})
    async with await serve_app(build_app(auth=auth, routes=[web.get("/b/{x}", callee)])) as b:
        client = HttpClient(None)
        async def caller(request):
            status, *_ = await client._call("GET", f"{b.url}b/1")
            return web.json_response({"status": status})
        async with await serve_app(build_app(auth=auth, routes=[web.get("/a", caller)])) as a, \
                aiohttp.ClientSession() as http:
            async with http.get(f"{a.url}a", headers={"traceparent": f"00-{TRACE}-{PARENT}-01"}) as resp:
                answered = resp.headers["traceparent"]
                assert resp.status == 200
        await client.close()
    spans = exporter.get_finished_spans()
    out = []
    for s in spans:
        out.append({"name": s.name, "kind": s.kind.name, "tracer": s.instrumentation_scope.name,
                    "trace_id": format(s.context.trace_id, "032x"), "span_id": format(s.context.span_id, "016x"),
                    "parent": None if s.parent is None else format(s.parent.span_id, "016x"),
                    "parent_remote": None if s.parent is None else s.parent.is_remote,
                    "attributes": dict(s.attributes)})
    print(json.dumps({"answered": answered, "spans": out}))

asyncio.run(main())
'''


# The API without an SDK (no tracer provider set): its no-op spans echo their parent's IDs, so
# the IDs on the wire stay ours, each span a new one.
CHILD_API_ONLY = r'''
import asyncio
from kvsp_moq.control.common import tracing
assert tracing.OTEL_AVAILABLE
inc = tracing.parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
with tracing.server_span(inc, role="x", route="/r", method="GET") as s:
    assert s.context.parent_id == inc.span_id and s.context.span_id != inc.span_id, s.context
    c = tracing.client_span("GET", "http://h/")
    assert c.context.parent_id == s.context.span_id and c.context.span_id not in (s.context.span_id, inc.span_id), c.context
    c.finish(200)
with tracing.server_span(None, role="x", route="/r", method="GET") as s2:
    assert s2.context.parent_id is None
    s2.finish(200)
s.finish(200)
print("noop ok")
'''


def _otel_site(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder holding opentelemetry-api and -sdk (module notes), or skip."""
    probe = [sys.executable, "-c", "import opentelemetry.sdk.trace"]
    if subprocess.run(probe, capture_output=True).returncode == 0:
        return ""  # this venv has them
    given = os.environ.get("KVSP_TEST_OTEL_SITE")
    if given:
        return given
    site = tmp_path_factory.mktemp("otel-site")
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                               "--target", str(site), "opentelemetry-api>=1.20", "opentelemetry-sdk>=1.20"],
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip("opentelemetry-api/-sdk could not be installed test-locally (pip timed out)")
    if done.returncode != 0:
        pytest.skip(f"opentelemetry-api/-sdk could not be installed test-locally: {done.stderr.strip()[-300:]}")
    return str(site)


def _child(tmp_path_factory: pytest.TempPathFactory, script: str) -> subprocess.CompletedProcess[str]:
    site = _otel_site(tmp_path_factory)
    path = os.pathsep.join(p for p in (site, str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": path}, cwd=ROOT)


def test_api_without_sdk_keeps_our_ids(tmp_path_factory: pytest.TempPathFactory) -> None:
    done = _child(tmp_path_factory, CHILD_API_ONLY)
    assert done.returncode == 0 and "noop ok" in done.stdout, done.stderr[-4000:]


def test_spans_with_parent_links_under_the_sdk(tmp_path_factory: pytest.TempPathFactory) -> None:
    import json

    done = _child(tmp_path_factory, CHILD)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    spans = {s["name"] + ":" + s["kind"]: s for s in result["spans"]}
    server_a, call, server_b = spans["GET /a:SERVER"], spans["GET:CLIENT"], spans["GET /b/{x}:SERVER"]
    assert len(result["spans"]) == 3
    assert {s["tracer"] for s in result["spans"]} == {"kvsp"}
    assert {s["trace_id"] for s in result["spans"]} == {"4bf92f3577b34da6a3ce929d0e0e4736"}
    # the links: the caller's remote span -> A -> the call -> B
    assert (server_a["parent"], server_a["parent_remote"]) == ("00f067aa0ba902b7", True)
    assert (call["parent"], call["parent_remote"]) == (server_a["span_id"], False)
    assert (server_b["parent"], server_b["parent_remote"]) == (call["span_id"], True)  # over the wire
    assert result["answered"] == f"00-4bf92f3577b34da6a3ce929d0e0e4736-{server_a['span_id']}-01"
    for span in (server_a, server_b):
        assert span["attributes"]["http.response.status_code"] == 200
        assert span["attributes"]["http.request.method"] == "GET"
        assert "kvsp.role" in span["attributes"]
    assert server_b["attributes"]["http.route"] == "/b/{x}"
    assert call["attributes"]["url.full"].endswith("/b/1") and call["attributes"]["http.response.status_code"] == 200
