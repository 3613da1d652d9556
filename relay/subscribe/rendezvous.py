"""RENDEZVOUS_TIMEOUT (SUBSCRIBE parameter 0x04, draft-20 §"RENDEZVOUS TIMEOUT Parameter").

A SUBSCRIBE for a track with no publisher (no announced namespace prefix, no PUBLISH of the
track, no upstream relay to ask) that carries RENDEZVOUS_TIMEOUT > 0 is **held**: no answer
until a publisher appears — a PUBLISH_NAMESPACE of a prefix of its namespace, or a PUBLISH
of its full track name — when it is routed as if it had just arrived; or until the timeout
(capped at :data:`MAX_RENDEZVOUS_MS`, "The relay MAY use a shorter timeout") expires, when it
gets REQUEST_ERROR TIMEOUT (0x2). Absent or 0: DOES_NOT_EXIST at once, as before. One event
loop timer (``call_later``) per held SUBSCRIBE, no polling; cancelled when the subscriber
cancels, its session ends, or a publisher appears. ``relay.observers`` get
``("rendezvous_hold", held)`` when one is held.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from kvsp_moq.moqt.errors import RequestErrorCode
from kvsp_moq.moqt.messages import Subscribe

from ..session.peer import PeerSession, RequestHandler
from .routing import is_prefix

if TYPE_CHECKING:  # pragma: no cover
    from ..ports import RelayContext

__all__ = ["MAX_RENDEZVOUS_MS", "Rendezvous"]

#: The longest a SUBSCRIBE is held, whatever it asks for.
MAX_RENDEZVOUS_MS = 30_000
Namespace = tuple[bytes, ...]


class _Held(RequestHandler):
    def __init__(self, holder: Rendezvous, peer: PeerSession, rid: int, msg: Subscribe,
                 timeout_ms: int) -> None:
        self.holder, self.peer, self.rid, self.msg = holder, peer, rid, msg
        self.namespace: Namespace = tuple(msg.track_namespace)
        self.name = bytes(msg.track_name)
        self.timer = asyncio.get_running_loop().call_later(timeout_ms / 1000, self._expired)

    def drop(self) -> None:
        """No longer held (answered, re-routed, cancelled or its session gone)."""
        self.timer.cancel()
        self.holder.held = [h for h in self.holder.held if h is not self]
        if self.peer.served.get(self.rid) is self:
            del self.peer.served[self.rid]

    def _expired(self) -> None:
        self.drop()
        self.holder.relay.reject(self.peer, self.rid, RequestErrorCode.TIMEOUT,
                                  "no publisher within RENDEZVOUS_TIMEOUT")

    def on_cancelled(self, code: int) -> None:
        self.drop()

    def on_session_closed(self, peer: PeerSession) -> None:
        self.drop()


class Rendezvous:
    """The SUBSCRIBEs held for a publisher."""

    def __init__(self, relay: RelayContext) -> None:
        self.relay = relay
        self.held: list[_Held] = []

    def hold(self, peer: PeerSession, rid: int, msg: Subscribe) -> bool:
        """Hold ``msg`` if it asked to wait (RENDEZVOUS_TIMEOUT > 0); False otherwise."""
        ms = msg.parameters.rendezvous_timeout
        if not ms or self.relay.closing:
            return False
        h = _Held(self, peer, rid, msg, min(int(ms), MAX_RENDEZVOUS_MS))
        peer.served[rid] = h
        self.held.append(h)
        self.relay.emit("rendezvous_hold", h)
        return True

    def publisher_appeared(self, namespace: Namespace, name: bytes | None = None) -> None:
        """A PUBLISH_NAMESPACE of ``namespace`` (``name`` None) or a PUBLISH of
        (``namespace``, ``name``): the SUBSCRIBEs it can serve proceed."""
        ready = [h for h in self.held
                 if (is_prefix(namespace, h.namespace) if name is None
                     else (h.namespace, h.name) == (tuple(namespace), name))]
        for h in ready:
            h.drop()
            moqt = h.peer.moqt
            if moqt is not None and not moqt.closed and h.rid in moqt.requests:
                self.relay.on_subscribe(h.peer, h.rid, h.msg)
