"""Error types of the KVSP core.

Every validation failure in ``kvsp_moq.kvsp`` raises a subclass of :class:`KvspError`
(itself a ``ValueError``) whose message names what is wrong. Callers that serve untrusted
input catch :class:`KvspError` and nothing else.
"""

from __future__ import annotations


class KvspError(ValueError):
    """Base of every error raised by the KVSP core for bad input."""


class DescriptorError(KvspError):
    """A Compatibility Descriptor violates kvsp-draft §4.1.

    ``member`` names the offending member (``None`` for the object as a whole).
    """

    def __init__(self, member: str | None, message: str) -> None:
        self.member = member
        super().__init__(f"descriptor member {member!r}: {message}" if member else f"descriptor: {message}")


class ScopeError(KvspError):
    """A Scope Key or Scope ID violates kvsp-draft §4.2."""


class BlockKeyError(KvspError):
    """Tokens or chain state that cannot produce Block Keys (kvsp-draft §4.2)."""


class ContainerError(KvspError):
    """A KV Block Container (KVB1, kvsp-draft §4.3) is malformed or does not match its geometry.

    ``field`` names the header field or section at fault (``magic``, ``version``, ``flags``,
    ``codec``, ``layer_count``, ``lengths``, ``data``, ``trailing``, ...).
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"KVB1 {field}: {message}")


class RecordError(KvspError):
    """A JSON record (kvsp-draft §4.4, §6) is invalid. ``member`` is a dotted path like
    ``residency[1].layers``."""

    def __init__(self, member: str, message: str) -> None:
        self.member = member
        super().__init__(f"{member}: {message}")


class NamingError(KvspError):
    """A MOQT block name (namespace fields, ``moqt_namespace``) is malformed (binding v1)."""
