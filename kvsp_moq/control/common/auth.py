"""Bearer-token authentication and the authorization rules of the control plane (DESIGN.md §5).

A deployment lists its principals in a configuration (TOML, see docs/http-api.md
"Authentication"). Each principal has one bearer token and three grants:

- ``scopes``: the Scope IDs (hex16, kvsp-draft §4.2) whose records it may publish, withdraw
  and look up (§6.1: "authorized for the record's scope"; §6.2: "MUST NOT return replicas of
  a scope for which the client is not authorized");
- ``holders``: the holder URLs it may publish replicas for, i.e. it is that holder or a
  delegate (§6.1: "the holder named in the record or is authorized to publish on its
  behalf"); for a ``moqt://`` replica the publisher of the namespace is the holder (§4.4);
- ``instances``: the instance URLs whose status it may report (§6.3).

``"*"`` in a grant allows everything of that kind (for a PC that acts for every instance).

The lookup of a principal from a token is transport-neutral (:meth:`Authorizer.principal_for_token`):
the same tokens are accepted in MOQT AUTHORIZATION_TOKEN. HTTP uses
:meth:`Authorizer.authenticate` on the ``Authorization`` field (RFC 6750 §2.1).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from ...kvsp.hexids import parse_hex, parse_hex16
from .errors import ConfigError, Forbidden, Unauthorized

T = TypeVar("T")

#: RFC 6750 §2.1 ``b64token``.
_B64TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
#: Shortest token a configuration may hold: 16 characters of a random b64token carry at least
#: 96 bits; generate tokens with ``python -c "import secrets; print(secrets.token_urlsafe(32))"``.
MIN_TOKEN_LEN = 16
#: The grant value that allows everything of its kind.
ANY = "*"

_PRINCIPAL_KEYS = frozenset({"name", "token", "token_sha256", "scopes", "holders", "instances"})


@dataclass(frozen=True)
class Grant(Generic[T]):
    """A set of identities a principal may act for, or everything (``"*"``)."""

    items: frozenset[T] = frozenset()
    everything: bool = False

    def allows(self, item: T) -> bool:
        return self.everything or item in self.items


@dataclass(frozen=True)
class Principal:
    """An authenticated party and what it may do."""

    name: str
    scopes: Grant[bytes] = Grant()
    holders: Grant[str] = Grant()
    instances: Grant[str] = Grant()

    def may_use_scope(self, scope_id: bytes) -> bool:
        return self.scopes.allows(scope_id)

    def may_publish_for(self, holder: str) -> bool:
        """Whether the principal is ``holder`` or a delegate of it (§6.1). URLs compare as
        written, as everywhere in KVSP records."""
        return self.holders.allows(holder)

    def may_report_for(self, instance: str) -> bool:
        return self.instances.allows(instance)


def require_scope(principal: Principal, scope_id: bytes) -> None:
    """:class:`Forbidden` unless the principal is authorized for the scope (§6.1, §6.2)."""
    if not principal.may_use_scope(scope_id):
        raise Forbidden(f"principal {principal.name!r} is not authorized for scope {scope_id.hex()}")


def require_holder(principal: Principal, holder: str) -> None:
    """:class:`Forbidden` unless the principal is the holder or publishes on its behalf (§6.1)."""
    if not principal.may_publish_for(holder):
        raise Forbidden(f"principal {principal.name!r} may not publish for holder {holder!r}")


def require_instance(principal: Principal, instance: str) -> None:
    """:class:`Forbidden` unless the principal may report the instance's status (§6.3)."""
    if not principal.may_report_for(instance):
        raise Forbidden(f"principal {principal.name!r} may not report status for instance {instance!r}")


def token_digest(token: str | bytes) -> bytes:
    """SHA-256 of a token, the form in which tokens are kept and compared."""
    return hashlib.sha256(token.encode("utf-8") if isinstance(token, str) else token).digest()


class Authorizer:
    """Maps bearer tokens to principals.

    Tokens are kept as SHA-256 digests and a presented token is compared with every known
    digest by :func:`hmac.compare_digest`, without stopping at a match, so the time taken does
    not depend on which token (if any) matched or how much of it.
    """

    def __init__(self, principals: Iterable[tuple[bytes, Principal]] = ()) -> None:
        entries: list[tuple[bytes, Principal]] = []
        names: set[str] = set()
        digests: set[bytes] = set()
        for digest, principal in principals:
            if len(digest) != 32:
                raise ConfigError(principal.name, "a token digest has 32 octets")
            if principal.name in names:
                raise ConfigError(principal.name, "duplicate principal name")
            if digest in digests:
                raise ConfigError(principal.name, "token is shared with another principal")
            names.add(principal.name)
            digests.add(digest)
            entries.append((digest, principal))
        self._entries: tuple[tuple[bytes, Principal], ...] = tuple(entries)

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_tokens(cls, tokens: Mapping[str, Principal]) -> Authorizer:
        """From plaintext tokens (tests and embedding)."""
        for token, principal in tokens.items():
            _check_token(token, principal.name)
        return cls((token_digest(t), p) for t, p in tokens.items())

    @classmethod
    def from_config(cls, principals: object, *, key: str = "principals") -> Authorizer:
        """From the decoded ``[[principals]]`` array of tables (docs/http-api.md)."""
        if not isinstance(principals, list):
            raise ConfigError(key, "must be an array of tables ([[principals]])")
        return cls(_read_principal(entry, f"{key}[{i}]") for i, entry in enumerate(principals))

    @classmethod
    def from_toml(cls, path: str | Path) -> Authorizer:
        """From the ``[[principals]]`` of a TOML file."""
        with open(path, "rb") as fh:
            try:
                doc = tomllib.load(fh)
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError("", f"{path}: {exc}") from None
        return cls.from_config(doc.get("principals", []))

    # -- authentication ----------------------------------------------------------------------

    @property
    def principals(self) -> tuple[Principal, ...]:
        return tuple(p for _, p in self._entries)

    def principal_for_token(self, token: str | bytes) -> Principal | None:
        """The principal whose token this is, or ``None`` (any transport)."""
        presented = token_digest(token)
        found: Principal | None = None
        for digest, principal in self._entries:
            if hmac.compare_digest(presented, digest):
                found = principal  # no break: the loop's duration must not reveal the match
        return found

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal of an HTTP ``Authorization`` field value (RFC 6750 §2.1).

        Raises :class:`Unauthorized`: without an error code when no bearer credentials were
        sent, with ``invalid_token`` when the token is malformed or unknown (RFC 6750 §3.1).
        """
        if authorization is None or not authorization.strip():
            raise Unauthorized("bearer token required")
        scheme, _, rest = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            raise Unauthorized("the Bearer authentication scheme is required")
        token = rest.strip(" ")
        if not _B64TOKEN.fullmatch(token):
            raise Unauthorized("malformed bearer token", error="invalid_token")
        principal = self.principal_for_token(token)
        if principal is None:
            raise Unauthorized("unknown bearer token", error="invalid_token")
        return principal


# ---------------------------------------------------------------------------------------------
# Configuration


def _check_token(token: object, key: str) -> str:
    if not isinstance(token, str) or not _B64TOKEN.fullmatch(token):
        raise ConfigError(key, "token must be an RFC 6750 b64token (letters, digits, -._~+/ then =)")
    if len(token) < MIN_TOKEN_LEN:
        raise ConfigError(key, f"token must have at least {MIN_TOKEN_LEN} characters")
    return token


def _read_principal(entry: object, key: str) -> tuple[bytes, Principal]:
    if not isinstance(entry, dict):
        raise ConfigError(key, "must be a table")
    unknown = set(entry) - _PRINCIPAL_KEYS
    if unknown:
        raise ConfigError(f"{key}.{sorted(unknown)[0]}", "unknown key")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{key}.name", "required, a non-empty string")
    if ("token" in entry) == ("token_sha256" in entry):
        raise ConfigError(key, "exactly one of token and token_sha256 is required")
    if "token" in entry:
        digest = token_digest(_check_token(entry["token"], f"{key}.token"))
    else:
        try:
            digest = parse_hex(entry["token_sha256"], 32, "token_sha256")
        except ValueError as exc:
            raise ConfigError(f"{key}.token_sha256", str(exc)) from None
    principal = Principal(
        name=name,
        scopes=_grant(entry.get("scopes", []), f"{key}.scopes", _scope),
        holders=_grant(entry.get("holders", []), f"{key}.holders", _url),
        instances=_grant(entry.get("instances", []), f"{key}.instances", _url),
    )
    return digest, principal


def _scope(value: object, key: str) -> bytes:
    try:
        return parse_hex16(value, "scope_id")
    except ValueError as exc:
        raise ConfigError(key, str(exc)) from None


def _url(value: object, key: str) -> str:
    if not isinstance(value, str) or "://" not in value:
        raise ConfigError(key, "must be an absolute URL, as written in records")
    return value


def _grant(values: object, key: str, read: Callable[[object, str], T]) -> Grant[T]:
    if not isinstance(values, list):
        raise ConfigError(key, "must be an array")
    if ANY in values:
        if len(values) != 1:
            raise ConfigError(key, f'"{ANY}" must be the only element')
        return Grant(everything=True)
    return Grant(frozenset(read(v, f"{key}[{i}]") for i, v in enumerate(values)))

