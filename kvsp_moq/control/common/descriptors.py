"""Compatibility Descriptors known to a service, by Compatibility ID (kvsp-draft §4.1).

The Index Service needs a compat's geometry for its estimates (§6.4): ``block_tokens`` for
the tokens a matched prefix holds, ``layers`` for the octets per layer. A lookup carries only
the compat_id, so descriptors are configured or registered, and their IDs are always computed
from the descriptor (§4.1: "MUST compute the Compatibility ID from the descriptor rather than
accept it from a peer without verification").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...kvsp.compat import CompatibilityDescriptor, compat_id, validate_descriptor
from ...kvsp.errors import DescriptorError
from .errors import Forbidden

#: Default cap on the number of descriptors a table holds.
DEFAULT_MAX_DESCRIPTORS = 1024


class DescriptorTable:
    """Validated descriptors by compat_id."""

    def __init__(self, *, max_descriptors: int = DEFAULT_MAX_DESCRIPTORS) -> None:
        self._max = max_descriptors
        self._by_id: dict[bytes, CompatibilityDescriptor] = {}

    def register(self, document: Mapping[str, Any], *, expect: bytes | None = None) -> tuple[bytes, bool]:
        """Validate and keep a descriptor; returns its compat_id and whether it was new.

        Raises ``DescriptorError`` (a ``KvspError``) for an invalid descriptor or when
        ``expect`` is given and is not the descriptor's ID; :class:`Forbidden` when the table
        is full.
        """
        descriptor = validate_descriptor(document)
        cid = compat_id(document)
        if expect is not None and cid != expect:
            raise DescriptorError(None, f"its compat_id is {cid.hex()}, not {expect.hex()}")
        if cid in self._by_id:
            return cid, False
        if len(self._by_id) >= self._max:
            raise Forbidden(f"the service keeps at most {self._max} descriptors")
        self._by_id[cid] = descriptor
        return cid, True

    def get(self, compat: bytes) -> CompatibilityDescriptor | None:
        return self._by_id.get(compat)

    def __len__(self) -> int:
        return len(self._by_id)
