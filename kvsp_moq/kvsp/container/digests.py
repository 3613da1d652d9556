"""Layer and replica digests (kvsp-draft §4.3): SHA-256(K || V) per layer, and SHA-256 of the
layer digests in ascending layer order per replica."""

from __future__ import annotations

from collections.abc import Iterable
from hashlib import sha256

from ..errors import ContainerError
from .header import DIGEST_SIZE, BytesLike

__all__ = ["layer_digest", "replica_digest"]


def layer_digest(k: BytesLike, v: BytesLike) -> bytes:
    """SHA-256(K || V) of one layer (§4.3), hashing both sections without concatenating."""
    h = sha256()
    h.update(k)
    h.update(v)
    return h.digest()


def replica_digest(layer_digests: Iterable[bytes]) -> bytes:
    """SHA-256 of the layer digests concatenated in ascending layer order (§4.3).

    It equals the Replica Record's ``digest`` only when given the digests of all layers.
    """
    h = sha256()
    for index, digest in enumerate(layer_digests):
        if len(digest) != DIGEST_SIZE:
            raise ContainerError(
                "layer_digests", f"digest {index} has {len(digest)} octets, not {DIGEST_SIZE}"
            )
        h.update(digest)
    return h.digest()
