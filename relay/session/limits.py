"""What the relay refuses before it routes a request (issue 18: hostile peers).

* **Reserved namespaces** (draft-22 §"Reserved Namespaces", §"Session-Level Tracks and
  Namespaces"; the same text in draft 18 and the draft-20 editor's copy): a Track Namespace
  whose first field is exactly ``.`` "MUST NOT be used for any purpose; endpoints ... MUST
  reject requests referencing it with DOES_NOT_EXIST"; one whose first field is
  ``.session`` names session-level tracks, and "Relays MUST NOT forward requests for
  session-level tracks and namespaces to other sessions"; "An endpoint that receives a
  request for an unrecognized session-level track or namespace MUST reject it with
  REQUEST_ERROR using error code DOES_NOT_EXIST". The relay defines no session-level
  track, so every such request (SUBSCRIBE, FETCH, TRACK_STATUS, PUBLISH, PUBLISH_NAMESPACE,
  SUBSCRIBE_NAMESPACE, SUBSCRIBE_TRACKS) is answered DOES_NOT_EXIST here and never reaches
  routing, the upstream relay or a publisher. Other first fields beginning with ``.`` are
  "passed to the Application" (routed as usual: future extensions).
  The sans-IO session already answers such requests itself
  (:mod:`kvsp_moq.moqt.reserved`); the relay checks again before routing (and drops
  reserved NAMESPACE answers of publishers and of the upstream relay), so nothing reserved
  is ever routed, listed or forwarded whatever the session lets through.
* **Requests per session** (§"Subscription Amplification": "Relays SHOULD implement rate
  limiting on subscription requests and MAY reject excessive subscriptions with
  REQUEST_ERROR using the EXCESSIVE_LOAD error code"): a downstream session with more than
  ``RelayConfig.max_requests_per_session`` open requests of its own gets REQUEST_ERROR
  EXCESSIVE_LOAD (0x9) with a Retry Interval for each request beyond it: the relay sets the
  sans-IO session's ``max_concurrent_requests`` to it (the session refuses first) and
  counts again before routing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvsp_moq.moqt.messages import Message, SubscribeNamespace, SubscribeTracks
from kvsp_moq.moqt.reserved import rejected_namespace

if TYPE_CHECKING:  # pragma: no cover
    from kvsp_moq.moqt.session import SessionMachine

__all__ = ["RETRY_INTERVAL_MS", "is_reserved_namespace",
           "open_peer_requests", "request_namespace"]

#: Retry Interval sent with EXCESSIVE_LOAD: "the minimum time (in milliseconds) before the
#: request SHOULD be sent again, plus one" (§"REQUEST_ERROR").
RETRY_INTERVAL_MS = 1000


def is_reserved_namespace(ns: tuple[bytes, ...]) -> bool:
    """First field exactly ``.`` or ``.session``: never routed, never forwarded (the sans-IO
    session's rule, :func:`kvsp_moq.moqt.reserved.rejected_namespace`)."""
    return rejected_namespace(ns)


def request_namespace(msg: Message) -> tuple[bytes, ...] | None:
    """The Track Namespace (or Namespace Prefix) a request names; None when it names none
    (a draft-18 Joining FETCH names a subscription of the same session)."""
    if isinstance(msg, SubscribeNamespace | SubscribeTracks):
        return tuple(msg.track_namespace_prefix)
    ns = getattr(msg, "track_namespace", None)
    return tuple(ns) if ns is not None else None


def open_peer_requests(moqt: SessionMachine) -> int:
    """How many requests the peer opened on this session are still open."""
    return sum(1 for r in moqt.requests.values() if not r.local)
