"""What a relay service may ask of the relay that owns it.

The services (:mod:`relay.fetch.fill`, :mod:`relay.subscribe.namespaces`,
:mod:`relay.subscribe.rendezvous`, :mod:`relay.subscribe.solicit`,
:mod:`relay.subscribe.publish_in`, :mod:`relay.subscribe.publish_out`) are given one of
these Protocols when they are made, never :class:`relay.core.Relay` itself, which implements
them all. Dependencies point down: core → services → ports → session.peer.

* :class:`Requests`: answering the peers' requests (REQUEST_ERROR, routing by namespace,
  a SUBSCRIBE routed as if it had just arrived);
* :class:`UpstreamLink`: the session to the ``--upstream`` relay and what opening requests
  on it needs (the configuration, the counters, a task to run);
* :class:`RelayContext`: both, plus the routing table, the gate, the observers and the
  notifications that a publisher appeared or local announcements changed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from kvsp_moq.moqt.messages import Subscribe

    from .ops.config import RelayConfig
    from .ops.gate import Gate
    from .ops.names import Namespace
    from .session.peer import PeerSession
    from .subscribe.routing import RoutingTable
    from .ops.stats import RelayStats

__all__ = ["RelayContext", "Requests", "UpstreamLink"]


class Requests(Protocol):
    """Answering the peers' requests."""

    def reject(self, peer: PeerSession, rid: int, code: int, reason: str) -> None:
        """REQUEST_ERROR ``code`` for the peer's request ``rid`` (logged), if it is open."""
        ...

    def route_then(self, down: PeerSession, rid: int, ns: Namespace,
                   then: Callable[[PeerSession], None]) -> None:
        """Find where ``ns`` is served (an announced publisher, else the upstream relay) and
        call ``then(route)``; REQUEST_ERROR DOES_NOT_EXIST when nowhere."""
        ...

    def on_subscribe(self, peer: PeerSession, rid: int, msg: Subscribe) -> None:
        """Route the peer's SUBSCRIBE (as if it had just arrived)."""
        ...


class UpstreamLink(Protocol):
    """The session to the ``--upstream`` relay (docs/relay.md "Chaining")."""

    @property
    def config(self) -> RelayConfig: ...

    @property
    def stats(self) -> RelayStats: ...

    @property
    def closing(self) -> bool:
        """Shutting down: nothing new is opened upstream."""
        ...

    def spawn(self, coro: Awaitable[None]) -> None:
        """Run ``coro`` as a task of the relay (cancelled when it closes; failures logged)."""
        ...

    async def upstream_peer(self) -> PeerSession | None:
        """Our session to the upstream relay, connected on first use (None without one)."""
        ...


class RelayContext(Requests, UpstreamLink, Protocol):
    """Everything a relay service may ask of the relay."""

    @property
    def routing(self) -> RoutingTable[PeerSession]: ...

    @property
    def gate(self) -> Gate: ...

    def emit(self, kind: str, obj: object) -> None:
        """Tell the relay's observers (tests, tools) ``kind`` happened to ``obj``."""
        ...

    def publisher_appeared(self, namespace: Namespace, name: bytes | None = None) -> None:
        """A PUBLISH_NAMESPACE (or solicited NAMESPACE) of ``namespace``, or a PUBLISH of
        (``namespace``, ``name``): SUBSCRIBEs held for a publisher proceed."""
        ...

    def local_namespaces_changed(self, namespaces: list[Namespace]) -> None:
        """Local announcements of ``namespaces`` changed: watchers and the upstream relay
        are told."""
        ...
