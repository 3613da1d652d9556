"""Soliciting namespaces from publishers (the "ingest model"; docs/relay.md "Soliciting").

Some publishers never send PUBLISH_NAMESPACE: they wait for the relay's SUBSCRIBE_NAMESPACE
and answer it with NAMESPACE for what they publish (moq-relay's ingest model, caprid-relay's
publisher). Nothing in their SETUP says so: caprid's SOLICIT Setup Option 0x40B5A
(draft-lcurley-moq-solicit) is sent by its *subscriber* and asks the relay to advertise
namespaces to it only on its own SUBSCRIBE_NAMESPACE, never as unsolicited PUBLISH_NAMESPACE
(which this relay never sends anyway). Peers that do not publish answer REQUEST_ERROR
(caprid's subscriber: NOT_SUPPORTED) or REQUEST_OK with nothing. The draft allows it: a relay
MAY send SUBSCRIBE_NAMESPACE to a publisher it has a session with (§"Subscribing to
Namespaces" / §"Namespace Discovery").

With ``RelayConfig.solicit_namespaces`` (default on; ``--no-solicit-namespaces`` turns it
off) the relay sends ONE SUBSCRIBE_NAMESPACE on ``RelayConfig.solicit_prefix`` (default: the
empty prefix) to every downstream session allowed to publish, right after SETUP, as moq-relay
does, and :class:`Solicitation` turns the answers into routes exactly like PUBLISH_NAMESPACE:

* NAMESPACE ``suffix`` → ``prefix + suffix`` maps to that session (routing, listings to
  SUBSCRIBE_NAMESPACE watchers, announcement to the ``--upstream`` relay, held
  RENDEZVOUS_TIMEOUT subscribes);
* NAMESPACE_DONE, the publisher ending the request (cancel / FIN / REQUEST_ERROR) or the
  session ending withdraw them.

Its REQUEST_OK / REQUEST_ERROR must come within ``request_timeout`` (relay/session/deadline.py):
otherwise the request is cancelled (RESET_STREAM / STOP_SENDING CANCELLED) and treated as
refused (``namespace_solicit_timeout`` event, counted in ``upstream_timeouts``); the
session is not solicited again.

Authorization: only sessions whose principals (SETUP tokens, or ``[anonymous]``) have a
``publish`` prefix overlapping the solicited prefix are solicited; a NAMESPACE outside their
``publish`` prefixes is ignored (``solicited_namespace`` event, decision ``refused``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvsp_moq.moqt.messages import Message, NamespaceDone, RequestError, Setup
from kvsp_moq.moqt.messages import Namespace as NamespaceMsg

from ..session.deadline import Deadline
from ..session.limits import is_reserved_namespace
from ..ops.logs import event
from ..ops.names import format_namespace
from ..session.peer import PeerSession, RequestHandler

if TYPE_CHECKING:  # pragma: no cover
    from ..ports import RelayContext

__all__ = ["Solicitation", "maybe_solicit"]

logger = logging.getLogger(__name__)
Namespace = tuple[bytes, ...]

class Solicitation(RequestHandler):
    """Our SUBSCRIBE_NAMESPACE to one downstream publisher and the routes its answers made."""

    def __init__(self, relay: RelayContext, peer: PeerSession, prefix: Namespace) -> None:
        self.relay, self.peer, self.prefix = relay, peer, prefix
        self.rid: int | None = None
        #: full namespaces this publisher answered (and we accepted), each a route.
        self.names: set[Namespace] = set()
        self.ended = False
        #: REQUEST_OK / REQUEST_ERROR must come within the request timeout.
        self.timer = Deadline(relay.config.request_timeout, self._timed_out)

    def _timed_out(self) -> None:
        """No answer in time: cancelled, as if refused."""
        if self.ended:
            return
        event("namespace_solicit_timeout", logging.WARNING, peer=self.peer.address,
              prefix=format_namespace(self.prefix), request_id=self.rid)
        self.relay.stats.upstream_timeouts += 1
        self._end()
        moqt = self.peer.moqt
        if self.rid is not None and moqt is not None and not moqt.closed:
            moqt.cancel(self.rid)
            self.peer.flush()
        self.relay.emit("namespace_solicit_timeout", self)

    def open(self) -> None:
        moqt = self.peer.moqt
        assert moqt is not None
        self.rid = moqt.subscribe_namespace(self.prefix)
        self.peer.local[self.rid] = self
        event("namespace_solicit", peer=self.peer.address, prefix=format_namespace(self.prefix),
              request_id=self.rid)
        self.timer.arm()
        self.peer.flush()

    def _key(self, ns: Namespace) -> tuple[str, int | None, Namespace]:
        # Routing-table key of one solicited namespace; never equal to a Request ID (int),
        # so a PUBLISH_NAMESPACE of the same session is withdrawn independently.
        return ("solicited", self.rid, ns)

    def _allowed(self, ns: Namespace) -> bool:
        return self.relay.gate.may_publish(self.peer.principals, ns)

    # -- RequestHandler ----------------------------------------------------------------------
    def on_response(self, msg: Message) -> None:
        self.timer.cancel()
        if isinstance(msg, RequestError):
            event("namespace_solicit_refused", logging.WARNING, peer=self.peer.address,
                  prefix=format_namespace(self.prefix), code=int(msg.error_code),
                  reason=msg.error_reason)
            self._end()

    def on_message(self, msg: Message) -> None:
        if self.ended:
            return
        if isinstance(msg, NamespaceMsg):
            ns = self.prefix + tuple(msg.track_namespace_suffix)
            if ns in self.names:
                return
            if is_reserved_namespace(ns) or not self._allowed(ns):
                # Outside the principal's publish prefixes: no route, nothing propagated.
                event("solicited_namespace", logging.WARNING, peer=self.peer.address,
                      namespace=format_namespace(ns), decision="refused",
                      principals=[p.name for p in self.peer.principals])
                self.relay.emit("solicited_namespace_refused", ns)
                return
            self.names.add(ns)
            event("solicited_namespace", peer=self.peer.address, namespace=format_namespace(ns),
                  decision="allowed", principals=[p.name for p in self.peer.principals])
            self.relay.routing.announce(ns, self.peer, self._key(ns))
            self.relay.local_namespaces_changed([ns])
            self.relay.publisher_appeared(ns)
            self.relay.emit("solicited_namespace", ns)
        elif isinstance(msg, NamespaceDone):
            ns = self.prefix + tuple(msg.track_namespace_suffix)
            if ns in self.names:
                self.names.discard(ns)
                self._withdraw([ns])

    def _withdraw(self, names: list[Namespace]) -> None:
        for ns in names:
            self.relay.routing.withdraw(self.peer, self._key(ns))
            event("solicited_namespace_done", peer=self.peer.address,
                  namespace=format_namespace(ns))
        if names:
            self.relay.local_namespaces_changed(names)
            for ns in names:
                self.relay.emit("solicited_namespace_done", ns)

    def _end(self) -> None:
        """The publisher ended our request: its namespaces are gone."""
        self.timer.cancel()
        if self.ended:
            return
        self.ended = True
        names, self.names = sorted(self.names), set()
        self._withdraw(names)
        if self.rid is not None and self.peer.is_open:
            self.peer.release(self.rid)

    def on_cancelled(self, code: int) -> None:
        self._end()

    def on_finished(self) -> None:
        self._end()

    def on_session_closed(self, peer: PeerSession) -> None:
        # Relay.on_session_closed withdraws every route of the session (and tells the
        # watchers and the upstream relay) once.
        self.timer.cancel()
        self.ended = True
        self.names = set()


def maybe_solicit(relay: RelayContext, peer: PeerSession, setup: Setup) -> Solicitation | None:
    """After a downstream session's SETUP: send it SUBSCRIBE_NAMESPACE when soliciting is
    on and its principals may publish under the solicited prefix."""
    cfg = relay.config
    if peer.upstream or not cfg.solicit_namespaces or relay.closing:
        return None
    prefix = tuple(cfg.solicit_prefix)
    if not relay.gate.may_publish_under(peer.principals, prefix):
        event("namespace_solicit_skipped", peer=peer.address, prefix=format_namespace(prefix),
              reason="no publish grant under the prefix",
              principals=[p.name for p in peer.principals])
        return None
    if not peer.is_open:
        return None
    s = Solicitation(relay, peer, prefix)
    s.open()
    return s
