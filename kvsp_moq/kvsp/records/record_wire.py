"""One Replica Record (kvsp-draft §4.4) in the compact lookup answer (ours; docs/http-api.md
"Compact lookup answer", ``lookup_wire.py``): its members as a MessagePack array, without the
ones an answer carries once (compat_id, scope_id), once per block (block_key) or beside it
(ttl_ms, the remaining lifetime). It changes only when the record does, so a record kept by
the Index Service is encoded once (``ReplicaRecord.compact_encoding``) and spliced into every
answer. Its own module so that ``replica.py`` can use it without an import circle.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Annotated

import msgspec
from msgspec import Meta

from .members import MAX_SAFE_INT, UINT32_MAX

__all__ = ["DIGEST_OCTETS", "WireRecord", "WireResidency", "encode_record"]

#: Octets of one digest (SHA-256) in ``digest`` and in each layer of ``layer_digests``.
DIGEST_OCTETS = 32
#: A number as the JSON form allows it: finite (MessagePack could carry NaN and infinity).
Finite = Annotated[float, Meta(ge=0, le=sys.float_info.max)]
#: An integer in I-JSON's exact range, as the JSON form's (RFC 7493 §2.2).
SafeInt = Annotated[int, Meta(ge=0, le=MAX_SAFE_INT)]
Bin32 = Annotated[bytes, Meta(min_length=DIGEST_OCTETS, max_length=DIGEST_OCTETS)]


class WireResidency(msgspec.Struct, array_like=True, frozen=True):
    """``[tier, first, last, read_mbit_per_s | nil]``: one ``residency`` entry (§4.4)."""

    tier: str
    first: Annotated[int, Meta(ge=0, le=UINT32_MAX)]
    last: Annotated[int, Meta(ge=0, le=UINT32_MAX)]
    read_mbit_per_s: Finite | None = None


class WireRecord(msgspec.Struct, array_like=True, frozen=True):
    """``[holder, codec, size, digest, layer_digests | nil, [residency, ...], moqt_namespace | nil]``;
    ``layer_digests`` is the layers' 32-octet digests concatenated in layer order."""

    holder: str
    codec: Annotated[int, Meta(ge=0, le=0xFFFF)]
    size: SafeInt
    digest: Bin32
    layer_digests: Annotated[bytes, Meta(min_length=DIGEST_OCTETS)] | None
    residency: Annotated[tuple[WireResidency, ...], Meta(min_length=1)]
    moqt_namespace: str | None = None


_ENCODER = msgspec.msgpack.Encoder()


def encode_record(
    *,
    holder: str,
    codec: int,
    size: int,
    digest: bytes,
    layer_digests: Iterable[bytes] | None,
    residency: Iterable[tuple[str, int, int, float | None]],
    moqt_namespace: str | None,
) -> msgspec.Raw:
    """The encoded :class:`WireRecord` of a record's members (``residency`` as
    ``(tier, first, last, read_mbit_per_s)``), ready to splice into an answer."""
    return msgspec.Raw(_ENCODER.encode(WireRecord(
        holder=holder, codec=codec, size=size, digest=digest,
        layer_digests=b"".join(layer_digests) if layer_digests is not None else None,
        residency=tuple(WireResidency(*entry) for entry in residency),
        moqt_namespace=moqt_namespace,
    )))
