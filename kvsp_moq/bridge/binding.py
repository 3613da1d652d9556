"""KVSP over MOQT, binding v1: the constants and property codecs (docs/binding.md; DESIGN.md §4).

* Namespace: ``("kvsp-1", compat_id, scope_id, block_key, replica_id)`` (``kvsp.naming``).
* Track name: the codec's registry name (``raw``).
* Group 0 holds the block; Object ID = layer index; payload (raw) = K section || V section,
  so SHA-256(payload) is the layer digest (kvsp-draft §4.3).
* Object Property :data:`LAYER_DIGEST` on every object; Track Properties (SUBSCRIBE_OK,
  FETCH_OK, TRACK_STATUS) :data:`TOKEN_COUNT`, :data:`FIRST_LAYER`, :data:`LAYER_COUNT`,
  and, once the replica is complete, :data:`LAYER_DIGESTS`; plus MAX_CACHE_DURATION = the
  remaining replica TTL.

Private property types lie in 0x3800–0x3FFF. A Key-Value-Pair with an even type carries one
integer, an odd type a length-prefixed byte string (MOQT §"Key-Value-Pair Structure"), so the
byte-valued properties have odd types.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..kvsp.container import DIGEST_SIZE
from ..wire.kvp import MAX_KVP_VALUE_LENGTH

__all__ = [
    "BLOCK_GROUP",
    "FIRST_LAYER",
    "LAYER_COUNT",
    "LAYER_DIGEST",
    "LAYER_DIGESTS",
    "MAX_CACHE_DURATION",
    "TOKEN_COUNT",
    "BindingError",
    "TrackInfo",
    "layer_digest_of",
    "track_properties",
]

#: Group 0 holds the block (binding v1).
BLOCK_GROUP = 0

#: Object Property (odd: bytes): the 32-octet layer digest of this object's layer.
LAYER_DIGEST = 0x3801
#: Track Property (even: integer): the block's Token Count (kvsp-draft §4.3).
TOKEN_COUNT = 0x3802
#: Track Property (odd: bytes): the layer digests of layers FIRST_LAYER.., 32 octets each,
#: ascending; present only for a complete replica.
LAYER_DIGESTS = 0x3803
#: Track Property (even): the first layer the replica holds (Object ID of its first object).
FIRST_LAYER = 0x3804
#: Track Property (even): the number of layers of the replica (complete or not).
LAYER_COUNT = 0x3806
#: MOQT Track Property MAX_CACHE_DURATION (ms), draft-20 §"MAX_CACHE_DURATION".
MAX_CACHE_DURATION = 0x04

#: At most this many layer digests fit one Key-Value-Pair value.
MAX_LAYER_DIGESTS = MAX_KVP_VALUE_LENGTH // DIGEST_SIZE


class BindingError(ValueError):
    """Track or object properties that do not follow binding v1."""


@dataclass(frozen=True)
class TrackInfo:
    """What the Track Properties of a block track say (binding v1)."""

    token_count: int
    first_layer: int
    layer_count: int
    #: Layer digests indexed by absolute layer (None for a replica still being computed).
    layer_digests: dict[int, bytes] | None
    max_cache_duration_ms: int | None

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.layer_count)

    @classmethod
    def parse(cls, props: Iterable[tuple[int, int | bytes]]) -> TrackInfo:
        """From received Track Properties; :class:`BindingError` if a required one is
        missing or malformed."""
        values: dict[int, int | bytes] = {}
        for t, v in props:
            values.setdefault(t, v)
        tokens, first, count = (values.get(t) for t in (TOKEN_COUNT, FIRST_LAYER, LAYER_COUNT))
        if not all(isinstance(x, int) for x in (tokens, first, count)):
            raise BindingError("track properties lack TOKEN_COUNT, FIRST_LAYER or LAYER_COUNT")
        assert isinstance(tokens, int) and isinstance(first, int) and isinstance(count, int)
        digests: dict[int, bytes] | None = None
        raw = values.get(LAYER_DIGESTS)
        if raw is not None:
            if not isinstance(raw, bytes) or len(raw) != count * DIGEST_SIZE:
                raise BindingError(f"LAYER_DIGESTS must hold {count} digests of {DIGEST_SIZE} octets")
            digests = {first + i: raw[i * DIGEST_SIZE:(i + 1) * DIGEST_SIZE] for i in range(count)}
        mcd = values.get(MAX_CACHE_DURATION)
        return cls(tokens, first, count, digests, mcd if isinstance(mcd, int) else None)


def track_properties(*, token_count: int, first_layer: int, layer_count: int,
                     layer_digests: Sequence[bytes] | None,
                     max_cache_duration_ms: int | None) -> tuple[tuple[int, int | bytes], ...]:
    """The Track Properties of a block track, types ascending (delta coding needs
    non-decreasing types). ``layer_digests`` only for a complete replica; omitted when
    they would not fit one property value (more than :data:`MAX_LAYER_DIGESTS` layers)."""
    props: list[tuple[int, int | bytes]] = []
    if max_cache_duration_ms is not None:
        props.append((MAX_CACHE_DURATION, max(0, int(max_cache_duration_ms))))
    props.append((TOKEN_COUNT, token_count))
    if layer_digests is not None and len(layer_digests) <= MAX_LAYER_DIGESTS:
        props.append((LAYER_DIGESTS, b"".join(layer_digests)))
    props.append((FIRST_LAYER, first_layer))
    props.append((LAYER_COUNT, layer_count))
    props.sort(key=lambda p: p[0])
    return tuple(props)


def layer_digest_of(properties: Iterable[tuple[int, int | bytes]]) -> bytes | None:
    """The LAYER_DIGEST Object Property, or None when absent or malformed."""
    for t, v in properties:
        if t == LAYER_DIGEST:
            return v if isinstance(v, bytes) and len(v) == DIGEST_SIZE else None
    return None
