"""The control plane's bearer tokens as MOQT credentials (DESIGN.md §4, §5; binding §9).

:class:`ControlScopeAuthorizer` adapts an :class:`~.common.auth.Authorizer` to the bridge's
:class:`~kvsp_moq.bridge.holder.ScopeAuthorizer`: a MOQT AUTHORIZATION_TOKEN's Token Value is
looked up with the transport-neutral :meth:`Authorizer.principal_for_token`, and the
principal's ``scopes`` grant decides (the same grant that lets it publish and look up the
records of the scope over HTTP, §6.1, §6.2). The bridge may not import the control plane
(tests/test_layering.py), hence the adapter lives here::

    holder = MoqtHolder(store, authorizer=ControlScopeAuthorizer(Authorizer.from_toml(path)))
"""

from __future__ import annotations

from collections.abc import Iterable

from ...bridge.holder import ScopeAuthorizer
from .auth import Authorizer

__all__ = ["ControlScopeAuthorizer"]


class ControlScopeAuthorizer(ScopeAuthorizer):
    """``allowed(token, scope)``: the token names a principal whose ``scopes`` grant holds
    ``scope``. ``anonymous_scopes``: scopes open to requests with no (known) token (none by
    default: every scope then needs a token)."""

    def __init__(self, authorizer: Authorizer, *, anonymous_scopes: Iterable[bytes] = ()) -> None:
        self.authorizer = authorizer
        self.anonymous_scopes = frozenset(bytes(s) for s in anonymous_scopes)

    def allowed(self, token: bytes | None, scope_id: bytes) -> bool:
        if token is None:
            return bytes(scope_id) in self.anonymous_scopes
        principal = self.authorizer.principal_for_token(token)
        return principal is not None and principal.may_use_scope(bytes(scope_id))
