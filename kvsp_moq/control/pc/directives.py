"""The §6.5 prefetch directives the active PC sent and that can still matter: the PC's cache of
what its store keeps (``pc/store``, ``directives``), loaded when a PC becomes the active one.

A directive is sent so that a request runs where its KV is being loaded: "request_ref ... lets
the PC associate the directive with the inference request it will route" (§6.5). So the PC
honours a directive it (or the PC before it) sent, while its deadline plus its lease have not
passed and its instance is still active (§6.3):

- a placement (``POST {pc}placements``) of a request whose ``request_ref`` has such a directive
  is answered with that directive's instance, id and status resource — the placement a client
  retries after a PC failed mid-answer gets the first answer, and the instance loads nothing
  twice;
- a directive for the same request to the same instance (a session's order sent again) is
  not sent again.

Directives are found by (scope, compat, request_ref): a request_ref is opaque and chosen by the
requester, so two scopes may use the same one. Memory is bounded by what the store keeps
(directives are forgotten at ``until_unix_ms``) and by :data:`MAX_DIRECTIVES`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable

from .store import IssuedDirective

__all__ = ["DirectiveBook", "MAX_DIRECTIVES"]

#: Directives remembered at most (the oldest are forgotten first): a bound on memory whatever
#: the rate of placements; at the default deadline and lease (6 s) it is ~10,000 a second.
MAX_DIRECTIVES = 65_536

_Ref = tuple[bytes, bytes, str]


def _now_ms() -> int:
    return int(time.time() * 1000)  # the directives' ``until_unix_ms`` is wall clock (shared by PCs)


class DirectiveBook:
    """Issued directives by request (module notes)."""

    def __init__(self, max_directives: int = MAX_DIRECTIVES) -> None:
        self.max_directives = max_directives
        self._by_ref: dict[_Ref, IssuedDirective] = {}  # insertion order: oldest first

    def __len__(self) -> int:
        return len(self._by_ref)

    def load(self, issued: Iterable[IssuedDirective]) -> None:
        """The stored directives become this PC's (oldest first, so the latest of a request wins)."""
        self._by_ref = {}
        for one in sorted(issued, key=lambda d: d.until_unix_ms):
            self.add(one)

    def clear(self) -> None:
        self._by_ref = {}

    def add(self, issued: IssuedDirective) -> None:
        """Remember ``issued`` (one with no request_ref cannot be asked for: not kept)."""
        ref = self._ref(issued)
        if ref is None:
            return
        self._by_ref.pop(ref, None)
        self._by_ref[ref] = issued
        self._forget(_now_ms())

    def for_request(self, scope_id: bytes, compat_id: bytes, request_ref: str | None,
                    instance: str | None = None) -> IssuedDirective | None:
        """The latest live directive sent for the request (to ``instance``, when given)."""
        if request_ref is None:
            return None
        issued = self._by_ref.get((scope_id, compat_id, request_ref))
        if issued is None or issued.until_unix_ms <= _now_ms():
            return None
        if instance is not None and issued.instance != instance:
            return None
        return issued

    def ids(self) -> list[uuid.UUID]:
        return [d.directive.directive for d in self._by_ref.values()]

    @staticmethod
    def _ref(issued: IssuedDirective) -> _Ref | None:
        d = issued.directive
        return None if d.request_ref is None else (d.scope_id, d.compat_id, d.request_ref)

    def _forget(self, now_ms: int) -> None:
        """Drop the expired ones at the front (roughly in expiry order) and any over the bound."""
        while self._by_ref:
            ref, oldest = next(iter(self._by_ref.items()))
            if oldest.until_unix_ms > now_ms and len(self._by_ref) <= self.max_directives:
                return
            del self._by_ref[ref]
