"""MOQT naming of a KV block (binding v1, DESIGN.md §4; kvsp-draft §4.4).

A replica served over MOQT lives under a Track Namespace of exactly five fields::

    ("kvsp-1", compat_id (32 octets), scope_id (16), block_key (32), replica_id (16))

and its track name is the codec's registry name (``raw``, ...). The Replica Record carries
``moqt_namespace``: base64url without padding of the five fields, each preceded by its
length as one octet (kvsp-draft §4.4).

MOQT limits (moqt-reference §2, "Track Namespace"): at most 32 fields, no empty field, and
the full track name (sum of the field lengths plus the track name) at most 4096 octets.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from dataclasses import dataclass

from .errors import NamingError
from .registries import CODECS_BY_NAME

NAMESPACE_TAG = b"kvsp-1"
FIELD_COUNT = 5
#: Octet length of each namespace field after the tag (compat_id, scope_id, block_key, replica_id).
FIELD_LENGTHS = (len(NAMESPACE_TAG), 32, 16, 32, 16)
# MOQT limits on a Full Track Name (moqt-reference §2).
MOQT_MAX_NAMESPACE_FIELDS = 32
MOQT_MAX_FULL_NAME = 4096

_B64URL = re.compile(r"[A-Za-z0-9_-]*")


@dataclass(frozen=True)
class BlockName:
    """The five namespace fields of a replica, as raw octets."""

    compat_id: bytes
    scope_id: bytes
    block_key: bytes
    replica_id: bytes

    def __post_init__(self) -> None:
        for name, value, size in (
            ("compat_id", self.compat_id, 32),
            ("scope_id", self.scope_id, 16),
            ("block_key", self.block_key, 32),
            ("replica_id", self.replica_id, 16),
        ):
            if not isinstance(value, bytes) or len(value) != size:
                raise NamingError(f"{name} must be {size} octets")

    @classmethod
    def new_replica(cls, compat_id: bytes, scope_id: bytes, block_key: bytes) -> "BlockName":
        """A name with a fresh random replica id: every replica a producer creates gets a new
        one, so relay caches never see two byte strings under one name (DESIGN.md §4)."""
        return cls(compat_id, scope_id, block_key, os.urandom(16))

    def namespace_fields(self) -> tuple[bytes, ...]:
        """The Track Namespace, field by field."""
        return (NAMESPACE_TAG, self.compat_id, self.scope_id, self.block_key, self.replica_id)

    def moqt_namespace(self) -> str:
        """The Replica Record member ``moqt_namespace`` (kvsp-draft §4.4)."""
        return encode_moqt_namespace(self.namespace_fields())

    @classmethod
    def from_fields(cls, fields: tuple[bytes, ...] | list[bytes]) -> "BlockName":
        """Parse Track Namespace fields received over MOQT; ``NamingError`` if they are not a
        binding-v1 block name."""
        if len(fields) != FIELD_COUNT:
            raise NamingError(f"a block namespace has {FIELD_COUNT} fields, got {len(fields)}")
        if bytes(fields[0]) != NAMESPACE_TAG:
            raise NamingError(f"first namespace field must be {NAMESPACE_TAG.decode()!r}")
        for i, (field, size) in enumerate(zip(fields, FIELD_LENGTHS)):
            if len(field) != size:
                raise NamingError(f"namespace field {i} must be {size} octets, got {len(field)}")
        return cls(bytes(fields[1]), bytes(fields[2]), bytes(fields[3]), bytes(fields[4]))

    @classmethod
    def from_moqt_namespace(cls, text: str) -> "BlockName":
        return cls.from_fields(decode_moqt_namespace(text))


def scope_prefix(compat_id: bytes, scope_id: bytes) -> tuple[bytes, bytes, bytes]:
    """The namespace prefix whose SUBSCRIBE_NAMESPACE lists the blocks of a scope (DESIGN.md §4)."""
    if len(compat_id) != 32 or len(scope_id) != 16:
        raise NamingError("compat_id must be 32 octets and scope_id 16")
    return (NAMESPACE_TAG, compat_id, scope_id)


def track_name(codec_name: str) -> bytes:
    """The track name of a codec (binding v1: its registry name)."""
    if codec_name not in CODECS_BY_NAME:
        raise NamingError(f"{codec_name!r} is not a registered codec")
    return codec_name.encode("ascii")


def check_full_track_name(fields: tuple[bytes, ...] | list[bytes], name: bytes) -> None:
    """Enforce the MOQT limits on a Full Track Name (moqt-reference §2)."""
    if len(fields) > MOQT_MAX_NAMESPACE_FIELDS:
        raise NamingError(f"a track namespace has at most {MOQT_MAX_NAMESPACE_FIELDS} fields")
    if any(len(f) == 0 for f in fields):
        raise NamingError("a track namespace field must not be empty")
    if sum(len(f) for f in fields) + len(name) > MOQT_MAX_FULL_NAME:
        raise NamingError(f"a full track name is at most {MOQT_MAX_FULL_NAME} octets")


def encode_moqt_namespace(fields: tuple[bytes, ...] | list[bytes]) -> str:
    """base64url (no padding) of the fields, each preceded by its length in one octet."""
    check_full_track_name(fields, b"")
    out = bytearray()
    for field in fields:
        if len(field) > 255:
            raise NamingError("a field longer than 255 octets cannot carry a one-octet length")
        out.append(len(field))
        out += field
    return base64.urlsafe_b64encode(bytes(out)).rstrip(b"=").decode("ascii")


def decode_moqt_namespace(text: str) -> tuple[bytes, ...]:
    """The inverse of :func:`encode_moqt_namespace`; any malformed input raises ``NamingError``."""
    if not isinstance(text, str) or _B64URL.fullmatch(text) is None or len(text) % 4 == 1:
        raise NamingError("moqt_namespace must be base64url without padding")
    if len(text) > (MOQT_MAX_FULL_NAME + MOQT_MAX_NAMESPACE_FIELDS) * 4 // 3 + 4:
        raise NamingError("moqt_namespace is longer than any valid MOQT namespace")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise NamingError("moqt_namespace must be base64url without padding") from None
    if base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii") != text:
        raise NamingError("moqt_namespace is not canonical base64url (non-zero padding bits)")
    fields: list[bytes] = []
    pos = 0
    while pos < len(raw):
        size = raw[pos]
        pos += 1
        if pos + size > len(raw):
            raise NamingError("moqt_namespace: a field length runs past the end")
        fields.append(raw[pos:pos + size])
        pos += size
    check_full_track_name(fields, b"")
    return tuple(fields)
