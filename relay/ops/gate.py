"""The relay's front door: SETUP tokens, request tokens and the authorization decision for
every request a peer opens (draft-20 §"AUTHORIZATION TOKEN Parameter"; DESIGN.md §4;
decisions in :mod:`relay.ops.auth`). Every decision is logged (``request`` event).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvsp_moq.moqt.errors import RequestErrorCode, SessionErrorCode
from kvsp_moq.moqt.messages import (
    Message,
    PublishNamespace,
    RequestUpdate,
    Setup,
    SubscribeNamespace,
    SubscribeTracks,
)

from .auth import Action, Authorizer, Principal
from .logs import event
from .names import Namespace, format_namespace
from .tokens import TokenError

if TYPE_CHECKING:  # pragma: no cover
    from ..session.peer import PeerSession
    from .stats import RelayStats

__all__ = ["Gate", "RequestTarget", "request_target"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestTarget:
    action: Action
    namespace: Namespace
    track: bytes | None = None
    #: SUBSCRIBE_NAMESPACE / SUBSCRIBE_TRACKS: ``namespace`` is a prefix to watch.
    watch: bool = False


def request_target(msg: Message) -> RequestTarget | None:
    """What a request asks to do where; None for requests that name no namespace (a joining
    FETCH names a subscription of the same session, which was authorized itself)."""
    if isinstance(msg, SubscribeNamespace | SubscribeTracks):
        return RequestTarget(Action.SUBSCRIBE, tuple(msg.track_namespace_prefix), watch=True)
    ns = getattr(msg, "track_namespace", None)
    if ns is None:
        return None
    name = getattr(msg, "track_name", None)
    # PUBLISH_NAMESPACE and PUBLISH publish; SUBSCRIBE, FETCH, TRACK_STATUS read.
    action = Action.PUBLISH if isinstance(msg, PublishNamespace) or msg.NAME == "PUBLISH" \
        else Action.SUBSCRIBE
    return RequestTarget(action, tuple(ns), None if name is None else bytes(name))


class Gate:
    def __init__(self, authorizer: Authorizer | None, stats: RelayStats) -> None:
        self.authorizer = authorizer
        self.stats = stats

    # -- SETUP ------------------------------------------------------------------------------
    def on_setup(self, peer: PeerSession, setup: Setup) -> bool:
        """The peer's SETUP arrived (server side); False if the session was closed."""
        peer.opened_at = time.monotonic()
        try:
            values = peer.tokens.resolve(setup.authorization_tokens, in_setup=True)
        except TokenError as exc:  # pragma: no cover - in_setup never raises today
            return self._refuse_session(peer, exc.code, exc.reason)
        if self.authorizer is not None and values:
            peer.principals = self.authorizer.principals_for(values)
            if not peer.principals:
                # §"AUTHORIZATION TOKEN" (Setup): tokens "to authorize MOQT session
                # establishment"; one we do not know ends the session.
                self.stats.auth_refusals += 1
                return self._refuse_session(peer, SessionErrorCode.UNAUTHORIZED,
                                            "unknown authorization token in SETUP")
        self.stats.sessions_opened += 1
        conn = peer.connection
        event("session_open", peer=peer.address, version=peer.alpn, role=peer.role.value,
              transport="webtransport" if conn is not None and conn.is_webtransport
              else "quic",
              principals=[p.name for p in peer.principals],
              implementation=setup.moqt_implementation)
        return True

    def _refuse_session(self, peer: PeerSession, code: int, reason: str) -> bool:
        event("session_refused", logging.WARNING, peer=peer.address, code=int(code),
              reason=reason)
        peer.close(code, reason)
        return False

    # -- requests ---------------------------------------------------------------------------
    def tokens_of(self, peer: PeerSession, msg: Message) -> list[bytes] | None:
        """Apply the message's tokens to the session's token cache; None if that closed
        the session (draft-20 §"AUTHORIZATION TOKEN Parameter")."""
        params = getattr(msg, "parameters", None)
        tokens = getattr(params, "authorization_tokens", ()) if params is not None else ()
        if not tokens:
            return []
        try:
            return peer.tokens.resolve(tokens)
        except TokenError as exc:
            self._refuse_session(peer, exc.code, exc.reason)
            return None

    def on_request_update(self, peer: PeerSession, msg: RequestUpdate) -> None:
        """REQUEST_UPDATE may REGISTER / DELETE aliases too (the update itself is not
        re-authorized: the relay does not act on updates yet)."""
        self.tokens_of(peer, msg)

    def check(self, peer: PeerSession, rid: int, msg: Message) -> list[Principal] | None:
        """The principals the request acts as if the relay should go on with it; None if it
        was refused with REQUEST_ERROR UNAUTHORIZED (or the session closed for a token-cache
        violation)."""
        self.stats.requests += 1
        values = self.tokens_of(peer, msg)
        if values is None:
            return None
        target = request_target(msg)
        fields = {"peer": peer.address, "request_id": rid, "type": msg.NAME}
        if target is not None:
            fields["namespace"] = format_namespace(target.namespace)
            if target.track is not None:
                fields["track"] = target.track.decode("utf-8", "backslashreplace")
        if self.authorizer is None or target is None:
            event("request", decision="allowed", **fields)
            return []
        if peer.upstream:
            # Our own session to the --upstream relay (we connected to it, with our
            # upstream_token): it routes its clients' requests for namespaces we announced
            # to it, and has authorized those clients itself.
            event("request", decision="allowed", principals=["(upstream relay)"], **fields)
            return []
        principals = list(peer.principals)
        for p in self.authorizer.principals_for(values):
            if p not in principals:
                principals.append(p)
        if target.watch:
            ok = self.authorizer.allows_prefix_watch(principals, target.namespace)
        else:
            ok = self.authorizer.allows(principals, target.action, target.namespace)
        names = [p.name for p in principals]
        if ok:
            event("request", decision="allowed", principals=names, **fields)
            return principals
        # Checked before any lookup: the answer is the same whether or not the namespace or
        # track exists, so a refusal reveals nothing about it.
        self.stats.auth_refusals += 1
        event("request", logging.WARNING, decision="refused",
              code=int(RequestErrorCode.UNAUTHORIZED), principals=names, **fields)
        moqt = peer.moqt
        if moqt is not None and not moqt.closed and rid in moqt.requests:
            moqt.reject(rid, RequestErrorCode.UNAUTHORIZED, "not authorized")
            peer.flush()
        return None

    def may_publish(self, principals: list[Principal], ns: Namespace) -> bool:
        """A solicited NAMESPACE answer (relay/subscribe/solicit.py) is routed: the session's
        principals may publish ``ns``."""
        if self.authorizer is None:
            return True
        return self.authorizer.allows(principals, Action.PUBLISH, ns)

    def may_publish_under(self, principals: list[Principal], prefix: Namespace) -> bool:
        """The session may be solicited on ``prefix``: some publish grant overlaps it."""
        if self.authorizer is None:
            return True
        return self.authorizer.allows_prefix_publish(principals, prefix)

    def visible(self, principals: list[Principal], ns: Namespace) -> bool:
        """Whether ``ns`` may be shown (NAMESPACE / NAMESPACE_DONE) to a watcher acting as
        ``principals``: only namespaces they may subscribe to."""
        if self.authorizer is None:
            return True
        return self.authorizer.allows(principals, Action.SUBSCRIBE, ns)
