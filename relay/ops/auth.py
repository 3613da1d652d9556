"""Authorization of relay requests (DESIGN.md §4 "Authorization"; docs/relay.md).

A TOML file maps bearer tokens to principals and the namespace prefixes under which each
may publish (PUBLISH_NAMESPACE) and subscribe (SUBSCRIBE, FETCH, TRACK_STATUS,
SUBSCRIBE_NAMESPACE)::

    [[principals]]
    name = "holder-h1"
    token = "d7f1c0b2a9e84c6f"            # or token_sha256 = "<64 hex digits>"
    publish = ["kvsp-1/0x<compat>/0x<scope>"]
    subscribe = ["kvsp-1/0x<compat>/0x<scope>"]

    [anonymous]                           # optional: rights of requests with no token
    subscribe = ["public"]

    [relay]                               # optional
    auth_token_cache_size = 4096          # MAX_AUTH_TOKEN_CACHE_SIZE we advertise
    upstream_token = "..."                # sent in our SETUP to the --upstream relay

Tokens are the Token Value of an AUTHORIZATION_TOKEN (any Token Type; type 0 = "negotiated
out-of-band", draft-20 §"AUTHORIZATION TOKEN Parameter") as UTF-8, the same bearer tokens as
the control plane (docs/http-api.md). They are kept as SHA-256 digests and compared with
:func:`hmac.compare_digest` against every principal, without early exit.

Decisions (all independent of what exists on the relay, so a refusal never reveals whether
a namespace or track exists):

* A request is allowed if ANY principal named by the session's SETUP tokens or by the
  request's own tokens (or ``[anonymous]``) allows it; unknown tokens in a request add
  nothing. Otherwise REQUEST_ERROR UNAUTHORIZED (0x1).
* publish on namespace N: some ``publish`` prefix is a field-wise prefix of N.
* subscribe / fetch / track status of a track in N: some ``subscribe`` prefix is a prefix of N.
* SUBSCRIBE_NAMESPACE on prefix P: accepted when some ``subscribe`` prefix overlaps P (one is
  a prefix of the other); the NAMESPACE / NAMESPACE_DONE it yields are filtered to the
  namespaces the principals may subscribe to.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from .names import Namespace, parse_namespace
from ..subscribe.routing import is_prefix

__all__ = ["Action", "AuthConfig", "AuthConfigError", "Authorizer", "Grants", "Principal",
           "load_auth_config", "token_digest"]

#: Shortest token accepted in a configuration (as the control plane: ≥ 96 bits when random).
MIN_TOKEN_LEN = 16
_B64TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
_PRINCIPAL_KEYS = frozenset({"name", "token", "token_sha256", "publish", "subscribe"})
_GRANT_KEYS = frozenset({"publish", "subscribe"})
_RELAY_KEYS = frozenset({"auth_token_cache_size", "upstream_token"})
_TOP_KEYS = frozenset({"principals", "anonymous", "relay"})


class AuthConfigError(ValueError):
    """A bad authorization configuration (``python -m relay`` exits 2 with it)."""


class Action(Enum):
    PUBLISH = "publish"
    SUBSCRIBE = "subscribe"


@dataclass(frozen=True)
class Grants:
    """Namespace prefixes a principal may publish / subscribe under."""

    publish: tuple[Namespace, ...] = ()
    subscribe: tuple[Namespace, ...] = ()

    def prefixes(self, action: Action) -> tuple[Namespace, ...]:
        return self.publish if action is Action.PUBLISH else self.subscribe


@dataclass(frozen=True)
class Principal:
    name: str
    grants: Grants = field(default_factory=Grants)


ANONYMOUS_NAME = "anonymous"


def token_digest(token: bytes | str) -> bytes:
    return hashlib.sha256(token.encode("utf-8") if isinstance(token, str) else token).digest()


class Authorizer:
    """Bearer tokens → principals, and the decisions of the module docstring."""

    def __init__(self, principals: Iterable[tuple[bytes, Principal]],
                 anonymous: Grants | None = None) -> None:
        self._entries = tuple(principals)
        self.anonymous = Principal(ANONYMOUS_NAME, anonymous) if anonymous else None

    def principal_for_token(self, value: bytes) -> Principal | None:
        presented = token_digest(value)
        found: Principal | None = None
        for digest, principal in self._entries:
            if hmac.compare_digest(presented, digest):
                found = principal  # no break: timing must not reveal which entry matched
        return found

    def principals_for(self, values: Iterable[bytes]) -> list[Principal]:
        out = []
        for v in values:
            p = self.principal_for_token(v)
            if p is not None and p not in out:
                out.append(p)
        return out

    def _who(self, principals: Sequence[Principal]) -> list[Principal]:
        return list(principals) + ([self.anonymous] if self.anonymous is not None else [])

    def allows(self, principals: Sequence[Principal], action: Action, ns: Namespace) -> bool:
        return any(is_prefix(p, ns) for who in self._who(principals)
                   for p in who.grants.prefixes(action))

    def allows_prefix_watch(self, principals: Sequence[Principal], prefix: Namespace) -> bool:
        """SUBSCRIBE_NAMESPACE: some subscribe prefix overlaps ``prefix``."""
        return any(is_prefix(p, prefix) or is_prefix(prefix, p)
                   for who in self._who(principals) for p in who.grants.subscribe)

    def allows_prefix_publish(self, principals: Sequence[Principal], prefix: Namespace) -> bool:
        """Soliciting namespaces under ``prefix`` (relay/subscribe/solicit.py): some publish prefix
        overlaps it."""
        return any(is_prefix(p, prefix) or is_prefix(prefix, p)
                   for who in self._who(principals) for p in who.grants.publish)


@dataclass(frozen=True)
class AuthConfig:
    """The parsed ``--config`` file."""

    authorizer: Authorizer
    auth_token_cache_size: int = 4096
    upstream_token: bytes | None = None


# -- loading ---------------------------------------------------------------------------------
def _err(key: str, problem: str) -> AuthConfigError:
    return AuthConfigError(f"{key}: {problem}" if key else problem)


def _check_keys(table: dict[str, object], allowed: frozenset[str], key: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise _err(f"{key}.{unknown[0]}" if key else unknown[0], "unknown key")


def _token(value: object, key: str) -> str:
    if not isinstance(value, str) or not _B64TOKEN.fullmatch(value):
        raise _err(key, "token must be an RFC 6750 b64token (letters, digits, -._~+/ then =)")
    if len(value) < MIN_TOKEN_LEN:
        raise _err(key, f"token must have at least {MIN_TOKEN_LEN} characters")
    return value


def _prefixes(values: object, key: str) -> tuple[Namespace, ...]:
    if not isinstance(values, list):
        raise _err(key, "must be an array of namespace prefixes (strings)")
    out = []
    for i, v in enumerate(values):
        try:
            out.append(parse_namespace(v))
        except ValueError as exc:
            raise _err(f"{key}[{i}]", str(exc)) from None
    return tuple(out)


def _grants(table: dict[str, object], key: str) -> Grants:
    return Grants(_prefixes(table.get("publish", []), f"{key}.publish"),
                  _prefixes(table.get("subscribe", []), f"{key}.subscribe"))


def _principal(entry: object, key: str) -> tuple[bytes, Principal]:
    if not isinstance(entry, dict):
        raise _err(key, "must be a table")
    _check_keys(entry, _PRINCIPAL_KEYS, key)
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise _err(f"{key}.name", "required, a non-empty string")
    if ("token" in entry) == ("token_sha256" in entry):
        raise _err(key, "exactly one of token and token_sha256 is required")
    if "token" in entry:
        digest = token_digest(_token(entry["token"], f"{key}.token"))
    else:
        raw = entry["token_sha256"]
        try:
            digest = bytes.fromhex(raw) if isinstance(raw, str) else b""
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise _err(f"{key}.token_sha256", "must be 64 hex digits")
    return digest, Principal(name, _grants(entry, key))


def parse_auth_config(doc: dict[str, object]) -> AuthConfig:
    _check_keys(doc, _TOP_KEYS, "")
    raw = doc.get("principals", [])
    if not isinstance(raw, list):
        raise _err("principals", "must be an array of tables ([[principals]])")
    entries = [_principal(e, f"principals[{i}]") for i, e in enumerate(raw)]
    names: set[str] = set()
    digests: set[bytes] = set()
    for digest, p in entries:
        if p.name in names or p.name == ANONYMOUS_NAME:
            raise _err(p.name, "duplicate or reserved principal name")
        if digest in digests:
            raise _err(p.name, "token is shared with another principal")
        names.add(p.name)
        digests.add(digest)
    anon = doc.get("anonymous")
    grants = None
    if anon is not None:
        if not isinstance(anon, dict):
            raise _err("anonymous", "must be a table")
        _check_keys(anon, _GRANT_KEYS, "anonymous")
        grants = _grants(anon, "anonymous")
    relay = doc.get("relay", {})
    if not isinstance(relay, dict):
        raise _err("relay", "must be a table")
    _check_keys(relay, _RELAY_KEYS, "relay")
    size = relay.get("auth_token_cache_size", 4096)
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size < (1 << 62):
        raise _err("relay.auth_token_cache_size", "must be an integer >= 0")
    up = relay.get("upstream_token")
    upstream = _token(up, "relay.upstream_token").encode() if up is not None else None
    return AuthConfig(Authorizer(entries, grants), size, upstream)


def load_auth_config(path: str | Path) -> AuthConfig:
    """Read and check the TOML file; :class:`AuthConfigError` says what is wrong where."""
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except OSError as exc:
        raise AuthConfigError(f"cannot read config {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise AuthConfigError(f"invalid config {path}: not valid TOML: {exc}") from None
    try:
        return parse_auth_config(doc)
    except AuthConfigError as exc:
        raise AuthConfigError(f"invalid config {path}: {exc}") from None
