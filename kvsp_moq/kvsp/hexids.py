"""Identifier encodings shared by every record: hex32, hex16 and ``sha-256:`` digests.

kvsp-draft §4.1 (digests "sha-256:" + lowercase hex), §4.2 (Block Keys as hex32),
§4.4 (hex32/hex16 members). Hex is always lowercase; uppercase is rejected so that one
identifier has one spelling.
"""

from __future__ import annotations

import re
import uuid

_HEX_RE = {n: re.compile(rf"[0-9a-f]{{{2 * n}}}") for n in (16, 32)}
DIGEST_PREFIX = "sha-256:"


def parse_hex(value: object, octets: int, what: str = "value") -> bytes:
    """Decode exactly ``octets`` octets of lowercase hex, or raise ``ValueError`` naming ``what``."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string of {2 * octets} lowercase hex digits")
    pattern = _HEX_RE.get(octets) or re.compile(rf"[0-9a-f]{{{2 * octets}}}")
    if pattern.fullmatch(value) is None:
        raise ValueError(f"{what} must be {2 * octets} lowercase hex digits, got {value[:80]!r}")
    return bytes.fromhex(value)


def parse_hex32(value: object, what: str = "hex32") -> bytes:
    """A 32-octet identifier (compat_id, block_key, layer digest)."""
    return parse_hex(value, 32, what)


def parse_hex16(value: object, what: str = "hex16") -> bytes:
    """A 16-octet identifier (scope_id)."""
    return parse_hex(value, 16, what)


def parse_digest(value: object, what: str = "digest") -> bytes:
    """``"sha-256:" + 64 lowercase hex`` (kvsp-draft §4.1) to its 32 raw octets."""
    if not isinstance(value, str) or not value.startswith(DIGEST_PREFIX):
        raise ValueError(f"{what} must be 'sha-256:' followed by 64 lowercase hex digits")
    return parse_hex32(value[len(DIGEST_PREFIX):], what)


def format_digest(raw: bytes) -> str:
    """32 raw octets to ``"sha-256:<hex>"``."""
    if len(raw) != 32:
        raise ValueError("a SHA-256 digest has 32 octets")
    return DIGEST_PREFIX + raw.hex()


def parse_uuid(value: object, what: str = "uuid") -> uuid.UUID:
    """A UUID (RFC 9562) in its canonical 8-4-4-4-12 hex form."""
    if not isinstance(value, str) or len(value) != 36:
        raise ValueError(f"{what} must be a UUID in 8-4-4-4-12 form")
    try:
        parsed = uuid.UUID(value)
    except ValueError:
        raise ValueError(f"{what} must be a UUID in 8-4-4-4-12 form, got {value!r}") from None
    if str(parsed) != value.lower():
        raise ValueError(f"{what} must be a UUID in 8-4-4-4-12 form, got {value!r}")
    return parsed
