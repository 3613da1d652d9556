"""Scopes (kvsp-draft §4.2): Scope Keys and Scope IDs."""

from __future__ import annotations

import hashlib

from .errors import ScopeError

#: §4.2: "Each scope has a Scope Key of at least 32 random octets".
MIN_SCOPE_KEY_OCTETS = 32
_SCOPE_LABEL = b"KVSP-SCOPE-1\x00"


def check_scope_key(scope_key: bytes) -> bytes:
    """Return ``scope_key`` as bytes, or raise ``ScopeError`` if it is shorter than 32 octets."""
    if not isinstance(scope_key, (bytes, bytearray, memoryview)):
        raise ScopeError("a scope key is a byte string")
    key = bytes(scope_key)
    if len(key) < MIN_SCOPE_KEY_OCTETS:
        raise ScopeError(f"a scope key has at least {MIN_SCOPE_KEY_OCTETS} octets, got {len(key)}")
    return key


def scope_id(scope_key: bytes) -> bytes:
    """scope_id = first 16 octets of SHA-256("KVSP-SCOPE-1" || 0x00 || scope_key)  (§4.2)."""
    return hashlib.sha256(_SCOPE_LABEL + check_scope_key(scope_key)).digest()[:16]
