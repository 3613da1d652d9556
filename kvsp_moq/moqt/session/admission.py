"""Which of the peer's requests the session serves (sans-IO; part of
:class:`~.machine.SessionMachine`).

A request the session refuses itself is answered REQUEST_ERROR and FIN and never reaches the
application (draft-ietf-moq-transport-22 §"REQUEST_ERROR"):

* GOING_AWAY (0x6) once we sent GOAWAY ("The endpoint has received a GOAWAY and MAY reject
  new requests"; this one is handled by the machine, which still reports the request);
* EXCESSIVE_LOAD (0x9) beyond ``SessionConfig.max_concurrent_requests`` live requests of the
  peer (§"Subscription Amplification": "MAY reject excessive subscriptions with REQUEST_ERROR
  using the EXCESSIVE_LOAD error code"; §"State maintenance"; "The sender SHOULD use the
  Retry Interval to indicate when the request can be retried");
* DOES_NOT_EXIST (0x10) for a Track Namespace (or Prefix) whose first field is exactly ``.``
  or ``.session`` (§"Reserved Namespaces", §"Session-Level Tracks and Namespaces"; see
  :mod:`kvsp_moq.moqt.reserved`).
"""

from __future__ import annotations

from ..errors import RequestErrorCode
from ..messages import PUBLISH_NAMESPACE_TYPE, PUBLISH_TYPE, Message
from ..reserved import rejected_namespace
from .config import SessionConfig

__all__ = ["Refusal", "check_local_namespace", "refusal", "request_namespace"]

#: (REQUEST_ERROR code, reason, Retry Interval as sent on the wire).
Refusal = tuple[int, str, int]


def request_namespace(msg: Message) -> tuple[bytes, ...] | None:
    """The Track Namespace or Track Namespace Prefix a request names (None: a Joining FETCH,
    which names a subscription instead)."""
    for attr in ("track_namespace", "track_namespace_prefix"):
        ns = getattr(msg, attr, None)
        if ns is not None:
            return tuple(ns)
    return None


def refusal(first: Message, config: SessionConfig, live_requests: int) -> Refusal | None:
    """The REQUEST_ERROR the session answers the peer's request ``first`` with itself, or
    None to pass it to the application. ``live_requests``: the peer's requests open now."""
    limit = config.max_concurrent_requests
    if limit is not None and live_requests >= limit:
        return (RequestErrorCode.EXCESSIVE_LOAD,
                f"more than {limit} concurrent requests", config.excessive_load_retry_ms + 1)
    ns = request_namespace(first)
    if ns is not None and rejected_namespace(ns):
        return (RequestErrorCode.DOES_NOT_EXIST, f"reserved namespace {ns[0]!r}", 0)
    return None


def check_local_namespace(msg: Message) -> None:
    """``ValueError`` if we would publish under a namespace the draft forbids: "endpoints MUST
    NOT publish tracks or namespaces under [``.``]" (§"Reserved Namespaces"); "The
    Application MUST NOT publish tracks or namespaces whose first field is ``.session``"
    (§"Session-Level Tracks and Namespaces"). Requests for them (SUBSCRIBE, FETCH, ...) may
    be sent: the peer answers DOES_NOT_EXIST."""
    if msg.TYPE not in (PUBLISH_TYPE, PUBLISH_NAMESPACE_TYPE):
        return
    ns = request_namespace(msg)
    if ns is not None and rejected_namespace(ns):
        raise ValueError(f"requests under the reserved namespace {ns[0]!r} are refused "
                         "(draft-ietf-moq-transport-22 §Reserved Namespaces)")
