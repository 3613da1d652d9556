"""Request tracing across the roles: W3C Trace Context (https://www.w3.org/TR/trace-context/)
on the HTTP control plane, OpenTelemetry when it is installed (docs/tracing.md).

- :class:`TraceContext` is one span: the trace ID (32 hex digits), its own span ID (16), the
  span ID of its parent (None for a trace's first span) and the trace flags; its
  :attr:`~TraceContext.traceparent` is the header that makes a callee its child.
- :func:`parse_traceparent` reads an incoming ``traceparent`` per the spec §3.2: version 00
  exactly (55 characters), a later version by its first four fields, ``ff`` never; lowercase
  hex only, an all-zero trace ID or parent ID invalid, several header values invalid. What is
  invalid is ignored, and the receiver starts a new trace.
- The span of the request being served is in a contextvar (:func:`current`): asyncio tasks
  spawned while serving it copy the context, so background work keeps the trace.
- :func:`server_span` (the control plane's server middleware, ``control/http/tracing.py``)
  and :func:`client_span` (the client library's middleware, ``control/client/http.py``) open
  spans. With ``opentelemetry`` importable, each is also an OpenTelemetry span of the tracer
  ``"kvsp"`` (server: attributes ``kvsp.role``, ``http.route``, ``http.request.method``,
  ``http.response.status_code``; client: ``http.request.method``, ``url.full``,
  ``http.response.status_code``), whose IDs are the ones on the wire, so an operator's SDK and
  exporter see the same trace; without an SDK (or without the package) the IDs are our own.

This module imports no web framework: the middlewares hand it header values and statuses.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


def _load_otel() -> tuple[Any, Any]:
    """OpenTelemetry's ``context`` and ``trace`` API modules, or (None, None): optional (the
    extra ``kvsp-moq[otel]``), never a dependency."""
    try:
        return importlib.import_module("opentelemetry.context"), importlib.import_module("opentelemetry.trace")
    except ImportError:
        return None, None


_otel_context, _otel_trace = _load_otel()

__all__ = [
    "ACCESS_LOG",
    "OTEL_AVAILABLE",
    "TRACEPARENT",
    "TRACER_NAME",
    "Span",
    "TraceContext",
    "client_span",
    "current",
    "log_call",
    "new_span_id",
    "new_trace_id",
    "parse_traceparent",
    "server_span",
    "use",
]

#: The header (lowercase: HTTP header names are case-insensitive).
TRACEPARENT = "traceparent"
#: The OpenTelemetry tracer's name.
TRACER_NAME = "kvsp"
#: Whether the OpenTelemetry API is importable here.
OTEL_AVAILABLE = _otel_trace is not None
#: The logger of the request lines (one per request served, one per call made).
ACCESS_LOG = logging.getLogger("kvsp.access")

_HEX = frozenset("0123456789abcdef")
_SAMPLED = 0x01


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and _HEX.issuperset(text)


def new_trace_id() -> str:
    while (value := secrets.token_hex(16)) == "0" * 32:  # all zeros is invalid (§3.2.2.3)
        pass
    return value


def new_span_id() -> str:
    while (value := secrets.token_hex(8)) == "0" * 16:  # all zeros is invalid (§3.2.2.4)
        pass
    return value


@dataclass(frozen=True)
class TraceContext:
    """One span of a trace (module notes)."""

    trace_id: str
    span_id: str
    parent_id: str | None = None
    flags: int = _SAMPLED

    @property
    def traceparent(self) -> str:
        """``00-{trace_id}-{span_id}-{flags}``: the header naming this span as the parent."""
        return f"00-{self.trace_id}-{self.span_id}-{self.flags:02x}"

    @property
    def sampled(self) -> bool:
        return bool(self.flags & _SAMPLED)

    def child(self, span_id: str | None = None) -> TraceContext:
        """A new span of the same trace whose parent is this one."""
        return TraceContext(self.trace_id, span_id or new_span_id(), self.span_id, self.flags)

    @classmethod
    def new(cls) -> TraceContext:
        """The first span of a new trace (sampled: every request is logged)."""
        return cls(new_trace_id(), new_span_id())


def parse_traceparent(values: str | Sequence[str] | None) -> TraceContext | None:
    """The caller's span named by an incoming ``traceparent`` (its parent-id as ``span_id``),
    or None when absent or invalid (module notes)."""
    if values is None:
        return None
    if not isinstance(values, str):
        if len(values) != 1:
            return None  # absent, or several headers: invalid
        values = values[0]
    value = values.strip(" \t")
    version = value[:2]
    if not _is_hex(version, 2) or version == "ff":
        return None
    if version == "00":
        if len(value) != 55:
            return None
    elif len(value) < 55 or (len(value) > 55 and value[55] != "-"):
        return None  # a later version: its first four fields, then '-' if more
    if value[2] != "-" or value[35] != "-" or value[52] != "-":
        return None
    trace_id, parent_id, flags = value[3:35], value[36:52], value[53:55]
    if not (_is_hex(trace_id, 32) and _is_hex(parent_id, 16) and _is_hex(flags, 2)):
        return None
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    return TraceContext(trace_id, parent_id, None, int(flags, 16))


_current: contextvars.ContextVar[TraceContext | None] = contextvars.ContextVar("kvsp_trace", default=None)


def current() -> TraceContext | None:
    """The span of the request this code serves (or of the call it makes), if any."""
    return _current.get()


@contextlib.contextmanager
def use(ctx: TraceContext | None) -> Iterator[None]:
    """Make ``ctx`` the current span while the block runs."""
    token = _current.set(ctx)
    try:
        yield
    finally:
        _current.reset(token)


# ---------------------------------------------------------------------------------------------
# Spans (ours, and OpenTelemetry's when importable)


@dataclass
class Span:
    """A span being timed; :meth:`finish` once, with the outcome."""

    context: TraceContext
    kind: str  # "server" | "client"
    name: str
    attributes: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    otel: Any = None

    @property
    def elapsed_ms(self) -> float:
        return (time.monotonic() - self.started) * 1000.0

    def finish(self, status: int | None, error: BaseException | None = None) -> None:
        if self.otel is not None:
            if status is not None:
                self.otel.set_attribute("http.response.status_code", status)
            if error is not None:
                self.otel.record_exception(error)
            if error is not None or (status is not None and status >= 500):
                self.otel.set_status(_otel_trace.Status(_otel_trace.StatusCode.ERROR))
            self.otel.end()
            self.otel = None


def _otel_parent(ctx: TraceContext | None) -> Any:
    """An OpenTelemetry context whose current span is ``ctx`` (a remote span), or the empty
    context (a root span)."""
    assert _otel_trace is not None
    if ctx is None:
        return _otel_context.Context()
    remote = _otel_trace.SpanContext(trace_id=int(ctx.trace_id, 16), span_id=int(ctx.span_id, 16),
                                     is_remote=True, trace_flags=_otel_trace.TraceFlags(ctx.flags))
    return _otel_trace.set_span_in_context(_otel_trace.NonRecordingSpan(remote))


def _start(parent: TraceContext | None, kind: str, name: str, attributes: dict[str, Any]) -> Span:
    """A new span, child of ``parent`` (a new trace when None): OpenTelemetry's IDs when its
    SDK made a real span, ours otherwise."""
    own = parent.child() if parent is not None else TraceContext.new()
    span = Span(own, kind, name, attributes)
    if _otel_trace is not None:
        tracer = _otel_trace.get_tracer(TRACER_NAME)
        otel_kind = _otel_trace.SpanKind.SERVER if kind == "server" else _otel_trace.SpanKind.CLIENT
        parent_context, parent_id = _otel_parent(parent), parent.span_id if parent else None
        if kind == "client" and parent is not None:
            # inside a request: the current OpenTelemetry span (ours, or an operator's own span
            # within it) is the parent, a local one
            current_span = _otel_trace.get_current_span()
            here = current_span.get_span_context()
            if current_span.is_recording() and format(here.trace_id, "032x") == parent.trace_id:
                parent_context, parent_id = _otel_context.get_current(), format(here.span_id, "016x")
        made = tracer.start_span(name, context=parent_context, kind=otel_kind, attributes=attributes)
        sc = made.get_span_context()
        if sc.is_valid and sc.span_id != _otel_trace.get_current_span(parent_context).get_span_context().span_id:
            # an SDK span: its IDs go on the wire (a no-op tracer echoes its parent's)
            span.context = TraceContext(format(sc.trace_id, "032x"), format(sc.span_id, "016x"),
                                        parent_id, int(sc.trace_flags))
        span.otel = made
    return span


@contextlib.contextmanager
def server_span(incoming: TraceContext | None, *, role: str, route: str, method: str) -> Iterator[Span]:
    """The span of one request served: a child of the caller's span ``incoming`` (from
    :func:`parse_traceparent`), or a new trace; current (ours and OpenTelemetry's) inside the
    block. The caller finishes it."""
    span = _start(incoming, "server", f"{method} {route}",
                  {"kvsp.role": role, "http.route": route, "http.request.method": method})
    otel_token = None
    if span.otel is not None:
        otel_token = _otel_context.attach(_otel_trace.set_span_in_context(span.otel))
    try:
        with use(span.context):
            yield span
    finally:
        if otel_token is not None:
            _otel_context.detach(otel_token)


def client_span(method: str, url: str) -> Span | None:
    """The span of one call made while a trace is current (None otherwise): a child of the
    current span; its :attr:`~Span.context`'s ``traceparent`` goes on the request."""
    parent = current()
    if parent is None:
        return None
    return _start(parent, "client", method, {"http.request.method": method, "url.full": url})


def log_call(span: Span, status: int | None, error: BaseException | None = None) -> None:
    """The ``kvsp.access`` line of a call made (``client``, then the callee's URL): the callee's
    request line has this span's ``span_id`` as its ``parent_id``."""
    if not ACCESS_LOG.isEnabledFor(logging.INFO):
        return
    ctx = span.context
    url = span.attributes.get("url.full", "")
    shown = status if status is not None else type(error).__name__ if error is not None else "-"
    ACCESS_LOG.info("client %s %s %s %.1fms trace_id=%s span_id=%s parent_id=%s", span.name, url, shown,
                    span.elapsed_ms, ctx.trace_id, ctx.span_id, ctx.parent_id or "-",
                    extra={"trace_id": ctx.trace_id, "span_id": ctx.span_id, "parent_id": ctx.parent_id,
                           "role": "client", "route": url, "status": status, "kind": "client"})
