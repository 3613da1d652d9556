"""Structured relay logs: ``event(name, **fields)`` on the ``relay.events`` logger.

With ``--log-format json`` every record on stderr is ONE JSON object per line::

    {"ts": "2026-08-01T12:00:00.123Z", "level": "INFO", "logger": "relay.events",
     "event": "session_open", "msg": "session_open", "peer": "127.0.0.1:50432", ...}

Events (fields beyond ts/level/logger/event/msg):

==================  ==========================================================================
session_open        peer, version (ALPN or WT-Protocol), role, transport ("quic" or
                    "webtransport"), principals (names from SETUP tokens)
session_close       peer, code, reason, seconds
request             peer, request_id, type, namespace, [track], principals, decision
                    ("allowed" / "refused"), [code] — one per request the relay receives
request_error       peer, request_id, code, reason — other refusals (no route, upstream error)
session_refused     peer, code, reason — SETUP token unknown, token cache violations
too_far_behind      peer, request_id, namespace, track — slow-subscriber cut-off
upstream_subscribe  namespace, track, request_id — ONE upstream SUBSCRIBE per track
upstream_cancel     namespace, track, request_id — the last subscriber left
upstream_fetch      namespace, track, start, end
cache_hit / cache_miss   namespace, track, start, end (FETCH)
cache_partial_hit        namespace, track, start, end (FETCH partly held: relay/fetch/held.py)
digest_mismatch     namespace, track, group, object — WARNING: an object that does not match
                    its track's LAYER_DIGESTS, not cached (relay/fetch/digests.py)
upstream_announce   namespace, request_id, upstream — our PUBLISH_NAMESPACE to the upstream
upstream_withdraw   namespace, request_id, upstream — its last local publisher left
upstream_subscribe_namespace    prefix, request_id, upstream — ONE per watched prefix
upstream_unsubscribe_namespace  prefix, request_id, upstream — the last watcher left
namespace_solicit   peer, prefix, request_id — our SUBSCRIBE_NAMESPACE to a downstream session
namespace_solicit_refused / _skipped   peer, prefix, code/reason — it refused / no publish grant
namespace_solicit_timeout  peer, prefix, request_id — no answer in request_timeout: cancelled
publish_refused     peer, namespace, track, code, reason — a PUBLISH we sent was refused
publish_timeout     peer, namespace, track, request_id — our PUBLISH up the chain got no
                    answer in request_timeout: cancelled, the track stays local
solicited_namespace peer, namespace, decision, principals — a NAMESPACE answer (routed / refused)
solicited_namespace_done  peer, namespace — its route withdrawn
upstream_connect    upstream, target — a session to the upstream relay opened (relay/subscribe/uplink.py)
upstream_dead       upstream, reason — closed: a liveness PING was not acknowledged in time
upstream_goaway     upstream, new_session_uri — the upstream sent GOAWAY: moving to a new session
upstream_switchover namespace, track, request_id — a subscription's SUBSCRIBE on the new session
upstream_switched / upstream_switchover_timeout  namespace, track, request_id — it took over /
                    got no answer in request_timeout (the old subscription stays)
==================  ==========================================================================

Namespaces are written as in the configuration (:mod:`relay.ops.names`).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

__all__ = ["EVENTS", "JsonFormatter", "TextFormatter", "configure_logging", "event"]

EVENTS = logging.getLogger("relay.events")
_STD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


def event(name: str, level: int = logging.INFO, /, **fields: Any) -> None:
    """Log event ``name`` with ``fields`` (cheap when the level is disabled). ``name`` and
    ``level`` are positional only, so a field may be called ``name`` or ``level``."""
    if EVENTS.isEnabledFor(level):
        EVENTS.log(level, name, extra={"event": name, "fields": fields})


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes | bytearray | memoryview):
        return bytes(v).decode("utf-8", "backslashreplace")
    if isinstance(v, tuple | list):
        return [_jsonable(x) for x in v]
    if isinstance(v, int | float | str | bool) or v is None:
        return v
    return str(v)


class JsonFormatter(logging.Formatter):
    """One JSON object per record (also for records not made by :func:`event`)."""

    def format(self, record: logging.LogRecord) -> str:
        t = record.created
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "event": getattr(record, "event", None) or "log",
            "msg": record.getMessage(),
        }
        for k, v in (getattr(record, "fields", None) or {}).items():
            doc.setdefault(k, _jsonable(v))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(name)s %(levelname)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            text += " " + " ".join(f"{k}={_jsonable(v)}" for k, v in fields.items())
        return text


def configure_logging(fmt: str = "text", level: int = logging.WARNING) -> None:
    """Root logging to stderr in ``fmt`` ("text" or "json")."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
