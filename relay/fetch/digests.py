"""Cache admission by layer digest: an object of a track that declares its layer digests is
cached only if its payload hashes to the digest declared for it (docs/relay.md "Cache and
FETCH", docs/binding.md §3.2, §7).

KVSP binding v1 tracks (a replica's layers, Object ID = layer, group 0) carry, once the
replica is complete, the Track Property LAYER_DIGESTS: SHA-256 of each object's payload, for
Objects FIRST_LAYER .. FIRST_LAYER + LAYER_COUNT - 1 of group 0. Consumers verify every
layer themselves (binding §4), so a corrupted object is never *used*; checking here keeps a
corrupted object (a faulty or tampering holder, a bit flip in an upstream's memory) out of
the cache, where it would otherwise be served to every later subscriber until
MAX_CACHE_DURATION (draft-22 §"Malformed Tracks" asks the same of objects that make a track
malformed: they "MUST NOT be cached").

The relay still never parses payloads nor imports ``kvsp_moq.kvsp``: it reads three Track
Properties (their type codes are pinned to ``kvsp_moq.bridge.binding``'s by
tests/test_relay_digests.py) and hashes payload chunks as they arrive
(:class:`PayloadCheck`, one ``hashlib.sha256`` per object, fed the received memoryviews: no
copy). A track without LAYER_DIGESTS (not a KVSP track, a replica still being computed),
or with a malformed one (not LAYER_COUNT × 32 octets), has nothing to verify against: its
objects are cached as before. So are objects the digests do not cover (another group,
another Object ID, a status other than Normal).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvsp_moq.moqt.objects import ObjectStatus

from .cache import TrackName
from ..ops.logs import event
from ..ops.names import format_namespace
from ..ops.stats import RelayStats

__all__ = ["FIRST_LAYER", "LAYER_COUNT", "LAYER_DIGESTS", "LayerDigests", "PayloadCheck",
           "admit"]

#: Binding v1 §3.2 Track Properties (private types; odd = bytes, even = integer).
LAYER_DIGESTS = 0x3803
FIRST_LAYER = 0x3804
LAYER_COUNT = 0x3806
#: Binding v1 §2: group 0 holds the block.
BLOCK_GROUP = 0
DIGEST_SIZE = hashlib.sha256().digest_size


@dataclass(frozen=True, slots=True)
class LayerDigests:
    """What a track's LAYER_DIGESTS says: the digest of Objects ``first`` .. ``first +
    count - 1`` of group 0, 32 octets each in ``raw`` (the property's own bytes: sliced on
    demand, never copied into a table)."""

    first: int
    count: int
    raw: bytes

    @classmethod
    def of(cls, props: Iterable[tuple[int, int | bytes]]) -> LayerDigests | None:
        """From Track Properties (the first of each type counts, as in binding §3.2's
        reader); None when LAYER_DIGESTS is absent or does not fit FIRST_LAYER /
        LAYER_COUNT."""
        values: dict[int, int | bytes] = {}
        for t, v in props:
            if t in (LAYER_DIGESTS, FIRST_LAYER, LAYER_COUNT):
                values.setdefault(t, v)
        raw, first, count = values.get(LAYER_DIGESTS), values.get(FIRST_LAYER), \
            values.get(LAYER_COUNT)
        if not (isinstance(raw, bytes) and isinstance(first, int) and isinstance(count, int)):
            return None
        if count <= 0 or len(raw) != count * DIGEST_SIZE:
            return None
        return cls(first, count, raw)

    def expected(self, group_id: int, object_id: int) -> bytes | None:
        """The digest declared for Object ``(group_id, object_id)``, or None if none is."""
        i = object_id - self.first
        if group_id != BLOCK_GROUP or not 0 <= i < self.count:
            return None
        return self.raw[i * DIGEST_SIZE:(i + 1) * DIGEST_SIZE]

    def covers(self, group_id: int, object_id: int, status: ObjectStatus) -> bool:
        """Is this object checked (a Normal object with a declared digest)?"""
        return status is ObjectStatus.NORMAL and self.expected(group_id, object_id) is not None

    def check(self, group_id: int, object_id: int, status: ObjectStatus,
              chunks: Sequence[memoryview | bytes] = ()) -> PayloadCheck | None:
        """A :class:`PayloadCheck` for this object (fed ``chunks``, the payload received so
        far), or None when no digest covers it."""
        want = self.expected(group_id, object_id) if status is ObjectStatus.NORMAL else None
        if want is None:
            return None
        c = PayloadCheck(want)
        for chunk in chunks:
            c.update(chunk)
        return c


class PayloadCheck:
    """SHA-256 of one object's payload, fed chunk by chunk as it arrives."""

    __slots__ = ("expected", "hasher")

    def __init__(self, expected: bytes) -> None:
        self.expected = expected
        self.hasher = hashlib.sha256()

    def update(self, chunk: memoryview | bytes) -> None:
        self.hasher.update(chunk)

    def matches(self) -> bool:
        return self.hasher.digest() == self.expected


def admit(check: PayloadCheck | None, stats: RelayStats, track: TrackName,
          location: tuple[int, int]) -> bool:
    """At an object's end: may it be cached? Yes without a check; else when its payload
    matched its layer digest. A mismatch is counted (``digest_mismatches``) and logged once
    (event ``digest_mismatch``, WARNING)."""
    if check is None:
        return True
    stats.digest_checks += 1
    if check.matches():
        return True
    stats.digest_mismatches += 1
    ns, name = track
    event("digest_mismatch", logging.WARNING, namespace=format_namespace(ns),
          track=name.decode("utf-8", "backslashreplace"), group=location[0],
          object=location[1])
    return False
