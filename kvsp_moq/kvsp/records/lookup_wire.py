"""The compact lookup answer (ours; docs/http-api.md "Compact lookup answer"): the same
records as the §6.2 answer, in MessagePack, for clients that ask for it by ``Accept``.

A lookup of a 64-block prompt returns 64 Replica Records, each with one layer digest per
layer (§4.4): as ``application/kvsp+json`` that is ~170 kB of hex text that both ends build
and check member by member. This form carries the same members positionally, with the octet
strings (keys, digests) as MessagePack ``bin`` and the layer digests of a record as one
``bin`` of 32 octets each; ``compat_id`` and ``scope_id``, equal for every record of an
answer (§6.2 returns only records of the request's scope and compat), are sent once, and
``block_key`` once per matched block. Decoding is ``msgspec``'s typed decoder (lengths,
types and ranges checked in C, nothing allocated beyond what the body holds) followed by the
record rules the types cannot state (all of §4.4's but the replica digest, which the client
verifies at retrieval, §6.7); the result is the :class:`LookupResponse` that the JSON form
decodes to, and every failure is a :class:`RecordError` naming the member as the JSON form
would (``blocks[0].replicas[1].codec``).

Schema (every array positional; docs/http-api.md lists it with the JSON member each
position carries)::

    answer   = {"matched": uint, "compat_id": bin32, "scope_id": bin16,
                "blocks": [block, ...], ? "targets": [target, ...]}
    block    = [block_key: bin32, [replica, ...]]                  ; at least one replica
    replica  = [ttl_ms: uint >= 1, record]                         ; remaining lifetime
    record   = [holder: str, codec: uint16, size: uint, digest: bin32,
                layer_digests: bin (32 x layers) | nil, [residency, ...], moqt_namespace: str | nil]
    residency = [tier: str, first: uint, last: uint, read_mbit_per_s: float | nil]
    target   = [instance: str, fetch_us: float, recompute_us: float]

``record`` (``record_wire.py``) holds everything of a Replica Record but the three members
sent once and the remaining lifetime, which changes with every answer: a record kept by the
Index Service keeps its encoding (``ReplicaRecord.compact_encoding``), spliced into each answer.
"""

from __future__ import annotations

import functools
import json
import re
import struct
import types
import typing
from collections.abc import Sequence
from typing import Annotated, Protocol, TypeGuard, TypeVar

import msgspec
from msgspec import Meta

from ..errors import RecordError
from .lookup import LookupRequest, LookupResponse, MatchedBlock, TargetEstimate
from .members import HOLDER_URL, HTTP_URL, MAX_SAFE_INT, ROOT, Url, check_disjoint, child, item
from .record import Record
from .record_wire import DIGEST_OCTETS, Bin32, Finite, SafeInt, WireRecord, WireResidency
from .replica import ReplicaRecord, Residency

__all__ = [
    "COMPACT_LOOKUP_MEDIA_TYPE",
    "DEFAULT_MAX_ANSWER_OCTETS",
    "StoredRecord",
    "decode_compact_answer",
    "decode_compact_request",
    "encode_compact_answer",
    "encode_compact_request",
    "json_lookup_request",
]

#: Media type of the compact answer (ours, vendor tree: RFC 6838 §3.2).
COMPACT_LOOKUP_MEDIA_TYPE = "application/vnd.kvsp-moq.lookup+msgpack"
#: Default cap on a lookup answer a client reads: 4096 matched blocks of one 32-layer replica
#: each take ~4.5 MB compact and ~11 MB as JSON.
DEFAULT_MAX_ANSWER_OCTETS = 16 << 20

_Bin16 = Annotated[bytes, Meta(min_length=16, max_length=16)]


class _Replica(msgspec.Struct, array_like=True, frozen=True):
    ttl_ms: Annotated[int, Meta(ge=1, le=MAX_SAFE_INT)]
    record: WireRecord


class _Block(msgspec.Struct, array_like=True, frozen=True):
    block_key: Bin32
    replicas: Annotated[tuple[_Replica, ...], Meta(min_length=1)]


class _Target(msgspec.Struct, array_like=True, frozen=True):
    instance: str
    fetch_us: Finite
    recompute_us: Finite


class _Answer(msgspec.Struct, frozen=True):
    matched: SafeInt
    compat_id: Bin32
    scope_id: _Bin16
    blocks: tuple[_Block, ...]
    targets: tuple[_Target, ...] | None = None


class _Request(msgspec.Struct, frozen=True):
    scope_id: _Bin16
    compat_id: Bin32
    block_keys: Annotated[tuple[Bin32, ...], Meta(min_length=1)]
    targets: tuple[str, ...] | None = None


class _ReplicaOut(msgspec.Struct, array_like=True):
    ttl_ms: int
    record: msgspec.Raw


class _BlockOut(msgspec.Struct, array_like=True):
    block_key: bytes
    replicas: list[_ReplicaOut]


class _AnswerOut(msgspec.Struct, omit_defaults=True):
    matched: int
    compat_id: bytes
    scope_id: bytes
    blocks: list[_BlockOut]
    targets: list[_Target] | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Answer)
_REQUEST_DECODER = msgspec.msgpack.Decoder(_Request)


# -- the request (the client encodes, the Index Service decodes) --------------------------------


def encode_compact_request(request: LookupRequest) -> bytes:
    """``request`` in the compact form: ``{"scope_id": bin16, "compat_id": bin32,
    "block_keys": [bin32, ...], "targets"?: [str, ...]}``."""
    return _ENCODER.encode(_Request(scope_id=request.scope_id, compat_id=request.compat_id,
                                    block_keys=request.block_keys, targets=request.targets))


def decode_compact_request(data: bytes | bytearray | memoryview, *, max_block_keys: int) -> LookupRequest:
    """The lookup request in ``data``, checked as ``LookupRequest.from_json`` checks the JSON
    one (at most ``max_block_keys`` keys, targets HTTP URLs). Raises only :class:`RecordError`."""
    wire = _decode(_REQUEST_DECODER, data, "compact lookup request")
    if len(wire.block_keys) > max_block_keys:
        raise RecordError("block_keys", f"at most {max_block_keys} keys per lookup, got {len(wire.block_keys)}")
    targets = None
    if wire.targets is not None:
        targets = tuple(HTTP_URL.read(t, item("targets", i)) for i, t in enumerate(wire.targets))
    return LookupRequest(scope_id=wire.scope_id, compat_id=wire.compat_id, block_keys=wire.block_keys, targets=targets)


def json_lookup_request(request: LookupRequest) -> bytes:
    """``dump_json(request)``, written directly (for an IS without the compact request): a
    prompt's keys are the bulk of it, and the generic record writer spends ~5x longer on them."""
    keys = '","'.join([key.hex() for key in request.block_keys])
    targets = ""
    if request.targets is not None:
        targets = ',"targets":' + json.dumps(list(request.targets), ensure_ascii=False, separators=(",", ":"))
    return (f'{{"scope_id":"{request.scope_id.hex()}","compat_id":"{request.compat_id.hex()}",'
            f'"block_keys":["{keys}"]{targets}}}').encode()


_T = TypeVar("_T")


def _decode(decoder: msgspec.msgpack.Decoder[_T], data: bytes | bytearray | memoryview, what: str) -> _T:
    """``decoder.decode(data)``; a RecordError naming the member at fault otherwise."""
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        message, _, where = str(exc).rpartition(" - at `")
        if not message:
            message, where = str(exc), "$`"
        path = _member_path(where.removesuffix("`"), decoder.type)
        missing = _MISSING.fullmatch(message)
        if missing is not None:  # "Object missing required field `compat_id`": name the member
            path, message = child(path, missing[1]), "required member is missing"
        raise RecordError(path, message if path != ROOT else f"{what}: {message}") from None
    except msgspec.DecodeError as exc:
        raise RecordError(ROOT, f"{what} is not MessagePack: {exc}") from None


# -- encoding (the Index Service) ---------------------------------------------------------------


class StoredRecord(Protocol):
    """A record as the Index Service's store returns it (``index.store.StoredReplica``)."""

    @property
    def record(self) -> ReplicaRecord: ...

    @property
    def remaining_ms(self) -> int: ...


def encode_compact_answer(
    compat_id: bytes,
    scope_id: bytes,
    block_keys: Sequence[bytes],
    found: Sequence[Sequence[StoredRecord]],
    targets: Sequence[TargetEstimate] | None,
) -> bytes:
    """The compact answer for the matched keys ``block_keys[:len(found)]`` whose replicas are
    ``found`` (each a non-empty list of one block's replicas, as ``IndexStore.get_prefix``
    returns them); each record's encoding is the one it keeps (``ReplicaRecord.compact_encoding``)."""
    blocks = [
        _BlockOut(key, [_ReplicaOut(s.remaining_ms, s.record.compact_encoding) for s in stored])
        for key, stored in zip(block_keys, found)
    ]
    answer = _AnswerOut(
        matched=len(blocks), compat_id=compat_id, scope_id=scope_id, blocks=blocks,
        targets=[_Target(t.instance, t.fetch_us, t.recompute_us) for t in targets] if targets is not None else None,
    )
    return _ENCODER.encode(answer)


# -- decoding (the client) ----------------------------------------------------------------------


_UNPACKERS: dict[int, struct.Struct] = {}
_MAX_CACHED_UNPACKERS = 64


def _split_digests(data: bytes) -> tuple[bytes, ...]:
    """``data`` cut into its 32-octet layer digests (one C call); octets past the last whole
    digest are left out (the caller refuses them)."""
    count = len(data) // DIGEST_OCTETS
    unpacker = _UNPACKERS.get(count)
    if unpacker is None:
        unpacker = struct.Struct(f"{DIGEST_OCTETS}s" * count)
        if len(_UNPACKERS) < _MAX_CACHED_UNPACKERS:  # bounded: a peer chooses the counts
            _UNPACKERS[count] = unpacker
    return unpacker.unpack_from(data)


@functools.lru_cache(maxsize=4096)
def _holder_fault(value: str) -> str | None:
    """Why ``value`` is not a holder URL (§4.4), or None. A fleet has few holders and every
    answer names them again; the URL check (~25 us) runs once per distinct holder."""
    try:
        HOLDER_URL.read(value, "holder")
    except RecordError as exc:
        return str(exc).removeprefix("holder: ")
    return None


_R = TypeVar("_R", bound=Record)


def _filled(record_type: type[_R], fields: dict[str, object]) -> _R:
    """A ``record_type`` with every field given in ``fields``, already checked: what its
    ``__init__`` would build (these records have no ``__post_init__``), without its one
    ``object.__setattr__`` per field of a frozen dataclass, ~5x slower for a Replica Record
    (as ``copy`` and ``pickle`` build instances)."""
    record = object.__new__(record_type)
    record.__dict__.update(fields)
    return record


def _replica_path(block: int, replica: int) -> str:
    return item(child(item("blocks", block), "replicas"), replica)


class _Reader:
    """The record rules of one answer. Holders and residency lists repeat across an answer's
    records, so each distinct one is checked once; paths are formatted only for an error."""

    def __init__(self, request: LookupRequest) -> None:
        self.compat_id = request.compat_id
        self.scope_id = request.scope_id
        self.holders: set[str] = set()
        self.residencies: dict[tuple[WireResidency, ...], tuple[tuple[Residency, ...], int]] = {}

    def check_holder(self, value: str, block: int, replica: int) -> None:
        # a URL longer than any holder's is refused uncached: the cache holds at most 4096
        # strings of Url.MAX_LEN characters
        fault = _holder_fault(value) if len(value) <= Url.MAX_LEN else f"must have at most {Url.MAX_LEN} characters"
        if fault is not None:
            raise RecordError(child(_replica_path(block, replica), "holder"), fault)
        self.holders.add(value)

    def check_residency(self, value: tuple[WireResidency, ...], block: int, replica: int) -> tuple[tuple[Residency, ...], int]:
        """The residency entries (§4.4: known tiers, disjoint ranges) and the highest layer."""
        path = child(_replica_path(block, replica), "residency")
        entries = tuple(
            Residency.read_at({"tier": r.tier, "layers": [r.first, r.last]}
                              | ({} if r.read_mbit_per_s is None else {"read_mbit_per_s": r.read_mbit_per_s}),
                              item(path, i))
            for i, r in enumerate(value)
        )
        check_disjoint([e.layers for e in entries], lambda i: child(item(path, i), "layers"), inclusive=True)
        known = self.residencies[value] = (entries, max(e.layers[1] for e in entries))
        return known

    def replicas(self, block_key: bytes, replicas: tuple[_Replica, ...], block: int) -> tuple[ReplicaRecord, ...]:
        """The Replica Records of one matched block, checked as ``ReplicaRecord._check`` checks
        them but for the replica digest (below). The hot loop of a client's lookup: names are
        bound locally and each record is filled in place as :func:`_filled` does."""
        out = []
        holders, residencies, new = self.holders, self.residencies, object.__new__
        compat_id, scope_id = self.compat_id, self.scope_id
        for index, replica in enumerate(replicas):
            wire = replica.record
            holder = wire.holder
            if holder not in holders:
                self.check_holder(holder, block, index)
            known = residencies.get(wire.residency)
            residency, last_layer = known if known is not None else self.check_residency(wire.residency, block, index)
            layer_digests = None
            packed = wire.layer_digests
            if packed is not None:
                # §4.4: every layer's digest, layer l at index l. digest = SHA-256 of them all
                # (§4.3) is not recomputed here: the IS checked it at PUT, a lying IS could make
                # it consistent anyway, and a client verifies it at retrieval (§6.7 MUST)
                layer_digests = _split_digests(packed)
                if len(packed) % DIGEST_OCTETS or last_layer >= len(layer_digests):
                    self.digests_fault(packed, last_layer, block, index)
            record = new(ReplicaRecord)  # as _filled: every field set, no per-field __setattr__
            record.__dict__.update(
                block_key=block_key, compat_id=compat_id, scope_id=scope_id, holder=holder, codec=wire.codec,
                size=wire.size, digest=wire.digest, layer_digests=layer_digests, residency=residency,
                ttl_ms=replica.ttl_ms, moqt_namespace=wire.moqt_namespace,
            )
            if wire.moqt_namespace is not None or holder.startswith("moqt:"):
                record.check_moqt(_replica_path(block, index))  # binding v1: the namespace names this block
            out.append(record)
        return tuple(out)

    @staticmethod
    def digests_fault(packed: bytes, last_layer: int, block: int, index: int) -> None:
        """Raise the RecordError of layer digests that fail §4.4."""
        path = _replica_path(block, index)
        if len(packed) % DIGEST_OCTETS:
            raise RecordError(child(path, "layer_digests"), f"must be a multiple of {DIGEST_OCTETS} octets")
        count = len(packed) // DIGEST_OCTETS
        raise RecordError(child(path, "residency"), f"layer {last_layer} is beyond the {count} layers of layer_digests")


_MISSING = re.compile(r"Object missing required field `(\w+)`")
_STEP = re.compile(r"\.([A-Za-z_]\w*)|\[(\d+)\]")


def _member_path(where: str, root: object) -> str:
    """msgspec's path of a fault (``$.blocks[0][1][0][1][3]``) in a ``root`` with the positions
    of the positional arrays named as the JSON form names them (``blocks[0].replicas[0].digest``)."""
    path, kind = ROOT, _schema_type(root)
    for name, index in _STEP.findall(where):
        if name:
            field = next((f for f in msgspec.structs.fields(kind) if f.name == name), None) if _is_struct(kind) else None
            path, kind = child(path, name), _schema_type(field.type) if field is not None else None
        elif _is_struct(kind) and kind.__struct_config__.array_like:
            fields = msgspec.structs.fields(kind)
            if int(index) >= len(fields):
                return item(path, int(index))
            field = fields[int(index)]
            if field.name != "record":  # the replica's record array: its members are the replica's
                path = child(path, field.name)
            kind = _schema_type(field.type)
        else:
            path = item(path, int(index))
            args = typing.get_args(kind)
            kind = _schema_type(args[0]) if args else None
    return path


def _is_struct(kind: object) -> TypeGuard[type[msgspec.Struct]]:
    return isinstance(kind, type) and issubclass(kind, msgspec.Struct)


def _schema_type(kind: object) -> object:
    """``kind`` without ``Annotated`` and ``| None``."""
    while True:
        origin = typing.get_origin(kind)
        if origin is Annotated:
            kind = typing.get_args(kind)[0]
        elif origin in (typing.Union, types.UnionType):
            kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
        else:
            return kind


def decode_compact_answer(data: bytes | bytearray | memoryview, request: LookupRequest) -> LookupResponse:
    """The answer to ``request`` in ``data`` (the compact form), checked as the JSON form is
    (every member's type and range, the record rules of §4.4 but the replica digest) and as
    an answer to this request (§6.2: the leading keys, the request's compat_id and scope_id).
    Raises only :class:`RecordError`."""
    wire = _decode(_DECODER, data, "compact lookup answer")
    if wire.compat_id != request.compat_id or wire.scope_id != request.scope_id:
        raise RecordError("compat_id", "the answer is for another compat_id or scope_id than the request (§6.2)")
    if wire.matched != len(wire.blocks):
        raise RecordError("blocks", f"must have matched = {wire.matched} entries, got {len(wire.blocks)}")
    if wire.matched > len(request.block_keys):
        raise RecordError("matched", f"{wire.matched} exceeds the {len(request.block_keys)} keys asked")
    reader = _Reader(request)
    blocks = []
    keys = request.block_keys
    for i, block in enumerate(wire.blocks):
        key = keys[i]
        if block.block_key != key:
            raise RecordError(child(item("blocks", i), "block_key"), "is not the request's key at this position (§6.2)")
        blocks.append(_filled(MatchedBlock, {"block_key": key, "replicas": reader.replicas(key, block.replicas, i)}))
    targets = None
    if wire.targets is not None:
        targets = tuple(
            TargetEstimate(instance=HTTP_URL.read(t.instance, child(item("targets", i), "instance")),
                           fetch_us=t.fetch_us, recompute_us=t.recompute_us)
            for i, t in enumerate(wire.targets)
        )
    return LookupResponse(matched=len(blocks), blocks=tuple(blocks), targets=targets)
