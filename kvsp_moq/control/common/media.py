"""Media types of the control plane's bodies (kvsp-draft §11.1) and the Repr-Digest field
(RFC 9530) every block response carries (DESIGN.md §5)."""

from __future__ import annotations

import base64

__all__ = ["BLOCK_MEDIA_TYPE", "KVSP_JSON", "repr_digest"]

#: Media type of KVSP JSON bodies (§11.1).
KVSP_JSON = "application/kvsp+json"
#: Media type of KV Block Containers (§6.7, §11.1).
BLOCK_MEDIA_TYPE = "application/kvsp-block"


def repr_digest(sha256: bytes) -> str:
    """The ``Repr-Digest`` field value (RFC 9530 §3, a Structured Field dictionary)."""
    return f"sha-256=:{base64.b64encode(sha256).decode('ascii')}:"
