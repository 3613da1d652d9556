"""The Replica Record (kvsp-draft §4.4), published by holders to the Index Service (§6.1)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from ..container import replica_digest
from ..errors import KvspError, RecordError
from .members import (
    DIGEST,
    HEX16,
    HEX32,
    HOLDER_URL,
    LAYER_RANGE,
    Int,
    ListOf,
    Num,
    Str,
    check_disjoint,
    child,
    item,
    merge_ranges,
)
from .record import Nested, Record, member
from .record_wire import encode_record

if TYPE_CHECKING:
    from ..naming import BlockName

#: A storage tier name: a lowercase token (``device``, ``host``, ``disk``, ...).
TIER = Str(max_len=64, pattern=r"[a-z0-9][a-z0-9._-]*", what="a lowercase token")


@dataclass(frozen=True, kw_only=True)
class Residency(Record):
    """One entry of ``residency``: the inclusive layer range ``layers`` resides in ``tier``,
    which the holder reads at ``read_mbit_per_s`` when given (§4.4, §6.4)."""

    RECORD_NAME = "residency entry"

    tier: str = member(TIER)
    layers: tuple[int, int] = member(LAYER_RANGE)
    read_mbit_per_s: float | None = member(Num(0, exclusive_min=True), optional=True)

    @property
    def layer_range(self) -> range:
        """The layers as a Python range (``layers`` is inclusive)."""
        return range(self.layers[0], self.layers[1] + 1)


@dataclass(frozen=True, kw_only=True)
class ReplicaRecord(Record):
    """A copy of one block at one holder (§4.4).

    Rules beyond the member types:

    - residency ranges must not overlap (§4.4);
    - when ``layer_digests`` is present it lists every layer of the block, layer ``l`` at
      index ``l`` (§4.3: the replica digest covers "all layers"), so ``digest`` must equal
      SHA-256 of their concatenation and every resident layer must be below its length;
    - ``moqt_namespace`` is required when ``holder`` is a ``moqt://`` URL and not allowed
      otherwise; its compat_id, scope_id and block_key fields must equal the record's
      (binding v1, docs/binding.md).
    """

    RECORD_NAME = "replica record"

    block_key: bytes = member(HEX32)
    compat_id: bytes = member(HEX32)
    scope_id: bytes = member(HEX16)
    holder: str = member(HOLDER_URL)
    codec: int = member(Int(0, 0xFFFF))
    size: int = member(Int(0))
    digest: bytes = member(DIGEST)
    layer_digests: tuple[bytes, ...] | None = member(ListOf(HEX32, min_len=1), optional=True)
    residency: tuple[Residency, ...] = member(ListOf(Nested(Residency), min_len=1))
    ttl_ms: int = member(Int(1))
    moqt_namespace: str | None = member(Str(), optional=True)

    # -- cross-member rules -------------------------------------------------------------------

    def _check(self, path: str) -> None:
        residency_at = child(path, "residency")
        check_disjoint(
            [r.layers for r in self.residency],
            lambda i: child(item(residency_at, i), "layers"),
            inclusive=True,
        )
        if self.layer_digests is not None:
            self._check_layer_digests(path)
        self.check_moqt(path)

    def _check_layer_digests(self, path: str) -> None:
        assert self.layer_digests is not None
        count = len(self.layer_digests)
        for i, entry in enumerate(self.residency):
            if entry.layers[1] >= count:
                raise RecordError(
                    child(item(child(path, "residency"), i), "layers"),
                    f"layer {entry.layers[1]} is beyond the {count} layers of layer_digests",
                )
        if replica_digest(self.layer_digests) != self.digest:
            raise RecordError(child(path, "digest"), "is not the SHA-256 of the layer digests (§4.3)")

    def check_moqt(self, path: str) -> None:
        """Binding v1's rule on ``moqt_namespace`` (class notes), for the record at ``path``;
        public for a decoder that builds records without :meth:`from_json` (``lookup_wire.py``)."""
        at = child(path, "moqt_namespace")
        if not self.is_moqt:
            if self.moqt_namespace is not None:
                raise RecordError(at, "is only allowed when holder is a moqt:// URL")
            return
        if self.moqt_namespace is None:
            raise RecordError(at, "is required when holder is a moqt:// URL")
        try:
            name = self.block_name()
        except KvspError as exc:
            raise RecordError(at, str(exc)) from None
        assert name is not None
        for field in ("compat_id", "scope_id", "block_key"):
            if getattr(name, field) != getattr(self, field):
                raise RecordError(at, f"names a different {field} than the record")

    # -- helpers ------------------------------------------------------------------------------

    @functools.cached_property
    def compact_encoding(self) -> msgspec.Raw:
        """This record as the compact lookup answer carries it (``record_wire.py``), encoded
        once per record object: a record the Index Service keeps is spliced into every answer
        that returns it (docs/http-api.md "Compact lookup answer"). Not a member."""
        return encode_record(
            holder=self.holder, codec=self.codec, size=self.size, digest=self.digest,
            layer_digests=self.layer_digests,
            residency=[(r.tier, r.layers[0], r.layers[1], r.read_mbit_per_s) for r in self.residency],
            moqt_namespace=self.moqt_namespace,
        )

    @property
    def is_moqt(self) -> bool:
        """Whether the replica is served over MOQT (§4.4)."""
        return self.holder.startswith("moqt:")

    def block_name(self) -> BlockName | None:
        """The MOQT name of the replica (binding v1) decoded from ``moqt_namespace``, or ``None``
        for a replica served over HTTP. Raises ``NamingError`` if the namespace is malformed,
        which :meth:`from_json` has already ruled out."""
        if self.moqt_namespace is None:
            return None
        from ..naming import BlockName  # lazy: only MOQT replicas need it

        return BlockName.from_moqt_namespace(self.moqt_namespace)

    @property
    def serves_layer_ranges(self) -> bool:
        """Whether a client can verify a layer range of this replica: it lists layer digests."""
        return self.layer_digests is not None

    def layers_in(self, tier: str) -> tuple[range, ...]:
        """The layers that reside in ``tier``, as sorted, merged ranges."""
        return merge_ranges([r.layer_range for r in self.residency if r.tier == tier])

    def resident_layers(self) -> tuple[range, ...]:
        """All layers the holder has, in any tier, as sorted, merged ranges."""
        return merge_ranges([r.layer_range for r in self.residency])

    def residency_of(self, layer: int) -> Residency | None:
        """The residency entry holding ``layer``, or ``None``."""
        return next((r for r in self.residency if layer in r.layer_range), None)

    def holds_layers(self, first: int, last: int) -> bool:
        """Whether every layer of the inclusive range ``first..last`` is resident (§6.7:
        otherwise a GET with ``layers=first-last`` is answered ``kvsp-layers-unavailable``)."""
        return first <= last and any(first in r and last in r for r in self.resident_layers())
