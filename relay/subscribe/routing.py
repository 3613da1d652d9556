"""The routing table: which publisher session serves which namespace, and who watches.

* PUBLISH_NAMESPACE (draft-20 §"Publishing Namespaces") registers ``namespace → session``;
  it is withdrawn by cancelling the request or when the session ends. A NAMESPACE answering
  the relay's own SUBSCRIBE_NAMESPACE to a publisher (relay/subscribe/solicit.py) registers the same way.
* SUBSCRIBE / FETCH / TRACK_STATUS go to the publisher of the **longest** announced
  namespace that is a field-wise prefix of the track's namespace (§"Namespace Prefix
  Matching"). With several publishers of one namespace the most recent one wins (the draft
  lets relays subscribe to all of them; that is later work, see docs/relay.md).
* SUBSCRIBE_NAMESPACE (§"Subscribing to Namespaces") registers a watcher on a prefix: it is
  told NAMESPACE for each namespace under the prefix when one appears (first publisher) and
  NAMESPACE_DONE when the last publisher of it goes away.

Generic over the session type so it can be tested without sockets.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

__all__ = ["NamespaceWatcher", "RoutingTable", "is_prefix"]

Namespace = tuple[bytes, ...]
P = TypeVar("P")


def is_prefix(prefix: Namespace, ns: Namespace) -> bool:
    """Field-wise prefix (§"Namespace Prefix Matching"): ("a",) matches ("a","b"), not ("ab",)."""
    return len(prefix) <= len(ns) and ns[:len(prefix)] == prefix


class NamespaceWatcher(Protocol):
    prefix: Namespace

    def namespace_added(self, namespace: Namespace) -> None: ...

    def namespace_removed(self, namespace: Namespace) -> None: ...


@dataclass(eq=False)
class _Announcement(Generic[P]):
    publisher: P
    #: The PUBLISH_NAMESPACE's Request ID, or any other key (relay/subscribe/solicit.py uses one per
    #: solicited namespace); compared with ``==`` only.
    request_id: Hashable


@dataclass
class RoutingTable(Generic[P]):
    #: namespace → announcements, most recent last.
    _announced: dict[Namespace, list[_Announcement[P]]] = field(default_factory=dict)
    _watchers: list[NamespaceWatcher] = field(default_factory=list)

    # -- publishers --------------------------------------------------------------------------
    def announce(self, namespace: Namespace, publisher: P, request_id: Hashable) -> None:
        entries = self._announced.setdefault(tuple(namespace), [])
        new = not entries
        entries.append(_Announcement(publisher, request_id))
        if new:
            for w in list(self._watchers):
                if is_prefix(w.prefix, namespace):
                    w.namespace_added(tuple(namespace))

    def withdraw(self, publisher: P, request_id: Hashable | None = None) -> list[Namespace]:
        """Remove ``publisher``'s announcement ``request_id`` (None: all of its
        announcements, e.g. the session closed). Returns the namespaces that are gone."""
        gone: list[Namespace] = []
        for ns, entries in list(self._announced.items()):
            kept = [a for a in entries if not (a.publisher is publisher and (
                request_id is None or a.request_id == request_id))]
            if len(kept) == len(entries):
                continue
            if kept:
                self._announced[ns] = kept
            else:
                del self._announced[ns]
                gone.append(ns)
        for ns in gone:
            for w in list(self._watchers):
                if is_prefix(w.prefix, ns):
                    w.namespace_removed(ns)
        return gone

    def lookup(self, namespace: Namespace) -> P | None:
        """The publisher for a track in ``namespace``: longest announced prefix wins."""
        ns = tuple(namespace)
        for n in range(len(ns), -1, -1):
            entries = self._announced.get(ns[:n])
            if entries:
                return entries[-1].publisher
        return None

    def has(self, namespace: Namespace) -> bool:
        """``namespace`` itself is announced (by anyone)."""
        return tuple(namespace) in self._announced

    def publishers_of(self, namespace: Namespace) -> list[P]:
        """The sessions that announced exactly ``namespace``, oldest first."""
        return [a.publisher for a in self._announced.get(tuple(namespace), ())]

    def namespaces_of(self, publisher: P) -> list[Namespace]:
        """The namespaces ``publisher`` announced."""
        return sorted(ns for ns, entries in self._announced.items()
                      if any(a.publisher is publisher for a in entries))

    def namespaces(self, prefix: Namespace = ()) -> list[Namespace]:
        return sorted(ns for ns in self._announced if is_prefix(prefix, ns))

    def publishers(self) -> Iterable[P]:
        return {id(a.publisher): a.publisher for e in self._announced.values() for a in e}.values()

    # -- SUBSCRIBE_NAMESPACE watchers --------------------------------------------------------
    def watch(self, watcher: NamespaceWatcher) -> list[Namespace]:
        """Register ``watcher``; returns the namespaces already under its prefix."""
        self._watchers.append(watcher)
        return self.namespaces(watcher.prefix)

    def unwatch(self, watcher: NamespaceWatcher) -> None:
        self._watchers = [w for w in self._watchers if w is not watcher]

    @property
    def watcher_count(self) -> int:
        return len(self._watchers)
