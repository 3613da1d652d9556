"""Replica Records (kvsp-draft §4.4) as JSON, fast: what the Index Service does to every record
of every refresh (§6.1) and of every lookup on a networked store (§6.2).

The generic record machinery (``record.py``: one :class:`~.members.Kind` per member, a path
string per member, a URL parse per holder) costs ~60 us per Replica Record to read and ~30 us
to write, and an IS at fleet size reads and writes every record once per refresh period
(100 000 records at a 60 s TTL: 5 000 a second). Three functions do the same work directly:

- :func:`read_replica`: a decoded JSON object as ``ReplicaRecord.from_json`` reads it, in one
  pass, or ``None`` when it cannot vouch for the object. It accepts only what ``from_json``
  accepts (every member's type and range, lowercase hex, the holder URL, residency ranges
  disjoint, every resident layer below the layer digests' count, ``digest`` = SHA-256 of the
  layer digests (§4.3), binding v1's ``moqt_namespace`` rule) and gives the same record; for
  anything else (an error, or a form it does not handle, such as ``3.0`` for an integer) the
  caller runs ``from_json``, which accepts it or raises the error naming the member. So the
  answer to a bad record is exactly the one it was.
- :func:`dump_replica`: ``dump_json(record)``, the same octets, written directly.
- :func:`load_replica`: a record the IS itself stored (``dump_replica``'s output) read back
  without re-checking the rules, typed by ``msgspec``; anything that does not decode as such a
  record goes through ``parse_json`` (which checks everything, and raises).
"""

from __future__ import annotations

import functools
import json
import struct
import sys
from hashlib import sha256
from typing import TypeVar

import msgspec

from ..errors import KvspError, RecordError
from ._json import parse_json
from .members import HOLDER_URL, MAX_SAFE_INT, ROOT, UINT32_MAX, Url, check_disjoint
from .replica import TIER, ReplicaRecord, Residency

__all__ = ["dump_replica", "load_replica", "read_replica"]

_R = TypeVar("_R", Residency, ReplicaRecord)
_DIGEST_PREFIX = "sha-256:"
_ABSENT = object()
#: Distinct residency lists (and holders) remembered; a fleet has few, a peer may send many.
_CACHE_ENTRIES = 4096


@functools.lru_cache(maxsize=_CACHE_ENTRIES)
def _holder_ok(value: str) -> bool:
    """Whether ``value`` is a holder URL (§4.4), checked by the reader ``from_json`` uses; a
    fleet has few holders, so each is parsed once (~25 us)."""
    try:
        HOLDER_URL.read(value, "holder")
    except RecordError:
        return False
    return True


def _int(value: object, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def _rate(value: object) -> float | int | None:
    """``read_mbit_per_s`` as ``Num(0, exclusive_min=True)`` reads it, or None if refused."""
    if type(value) is int:
        if 0 < value <= MAX_SAFE_INT:
            return value
        if value <= 0:
            return None
        try:
            value = float(value)  # as Num.read: beyond I-JSON's exact range, a float
        except OverflowError:
            return None
    if type(value) is float and 0 < value <= sys.float_info.max:  # finite, > 0
        return value
    return None


def _residency(entries: object) -> tuple[Residency, ...] | None:
    """The ``residency`` array as ``ListOf(Nested(Residency), min_len=1)`` reads it, without
    the cross-entry rule (disjoint ranges), or None."""
    if type(entries) is not list or not entries:
        return None
    out = []
    for entry in entries:
        if type(entry) is not dict:
            return None
        tier, layers = entry.get("tier"), entry.get("layers")
        if type(tier) is not str or not 0 < len(tier) <= 64 or TIER.pattern is None or TIER.pattern.fullmatch(tier) is None:
            return None
        if type(layers) is not list or len(layers) != 2:
            return None
        first, last = layers
        if not (_int(first, 0, UINT32_MAX) and _int(last, first, UINT32_MAX)):
            return None
        fields: dict[str, object] = {"tier": tier, "layers": (first, last), "read_mbit_per_s": None}
        rate = entry.get("read_mbit_per_s", _ABSENT)
        if rate is not _ABSENT:
            fields["read_mbit_per_s"] = checked = _rate(rate)
            if checked is None:
                return None
        out.append(_filled(Residency, fields))
    return tuple(out)


def _filled(record_type: type[_R], fields: dict[str, object]) -> _R:
    """A record with every field given, already checked: what its ``__init__`` builds (these
    records have no ``__post_init__``) without one ``object.__setattr__`` per field."""
    record = object.__new__(record_type)
    record.__dict__.update(fields)
    return record


def read_replica(obj: object) -> ReplicaRecord | None:
    """``ReplicaRecord.from_json(obj)`` when ``obj`` is a record it accepts and this reader
    handles; ``None`` otherwise (then ``from_json`` decides, and names the fault). Unknown
    members are ignored (§4.4)."""
    if type(obj) is not dict:
        return None
    get = obj.get
    block_key, compat_id, scope_id, holder = get("block_key"), get("compat_id"), get("scope_id"), get("holder")
    digest, layer_digests, moqt_namespace = get("digest"), get("layer_digests", _ABSENT), get("moqt_namespace", _ABSENT)
    codec, size, ttl_ms = get("codec"), get("size"), get("ttl_ms")
    if not (_int(codec, 0, 0xFFFF) and _int(size, 0, MAX_SAFE_INT) and _int(ttl_ms, 1, MAX_SAFE_INT)):
        return None
    # every hex member checked and decoded at once: one regex match, one fromhex
    if not (type(block_key) is str and len(block_key) == 64 and type(compat_id) is str and len(compat_id) == 64
            and type(scope_id) is str and len(scope_id) == 32 and type(digest) is str and len(digest) == 72
            and digest.startswith(_DIGEST_PREFIX)):
        return None
    hex_parts = [block_key, compat_id, scope_id, digest[8:]]
    layers = 0
    if layer_digests is not _ABSENT:
        if type(layer_digests) is not list or not layer_digests:
            return None
        hex_parts += layer_digests
        layers = len(layer_digests)
    try:
        joined = "".join(hex_parts)  # TypeError: a layer digest is not a string
        raw = bytes.fromhex(joined)  # ValueError: not hex
    except (TypeError, ValueError):
        return None
    # fromhex also takes uppercase and whitespace: the round trip leaves only lowercase hex,
    # and with every layer digest 64 digits long, each member is exactly its hex
    if raw.hex() != joined or (layers and set(map(len, layer_digests)) != {64}):
        return None
    if type(holder) is not str or len(holder) > Url.MAX_LEN or not _holder_ok(holder):
        return None
    residency = _residency(get("residency"))
    if residency is None:
        return None
    digests: tuple[bytes, ...] | None = None
    if layers:
        digests = _split(raw, 112, layers)
        if max([r.layers[1] for r in residency]) >= layers:  # §4.4: resident layers have digests
            return None
        if sha256(raw[112:]).digest() != raw[80:112]:  # §4.3: digest = SHA-256 of the layer digests
            return None
    fields: dict[str, object] = {
        "block_key": raw[:32], "compat_id": raw[32:64], "scope_id": raw[64:80], "holder": holder,
        "codec": codec, "size": size, "digest": raw[80:112], "layer_digests": digests,
        "residency": residency, "ttl_ms": ttl_ms, "moqt_namespace": None,
    }
    if moqt_namespace is not _ABSENT:
        if type(moqt_namespace) is not str or not moqt_namespace or not moqt_namespace.isascii():
            return None
        fields["moqt_namespace"] = moqt_namespace
    record = _filled(ReplicaRecord, fields)
    try:
        if len(residency) > 1:
            check_disjoint([r.layers for r in residency], lambda i: "residency", inclusive=True)
        record.check_moqt(ROOT)  # binding v1: moqt:// holder <=> moqt_namespace naming this block
    except KvspError:
        return None
    return record


_UNPACKERS: dict[int, struct.Struct] = {}


def _split(raw: bytes, offset: int, count: int) -> tuple[bytes, ...]:
    """``count`` 32-octet digests of ``raw`` from ``offset`` (one C call)."""
    unpacker = _UNPACKERS.get(count)
    if unpacker is None:
        unpacker = struct.Struct("32s" * count)
        if len(_UNPACKERS) < 64:  # bounded: a peer chooses the counts
            _UNPACKERS[count] = unpacker
    return unpacker.unpack_from(raw, offset)


# -- writing ------------------------------------------------------------------------------------

#: The scalar writer of ``dump_json`` (same options), so numbers and strings come out alike.
_SCALAR = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode
_RESIDENCY_JSON: dict[tuple[Residency, ...], str] = {}


def _residency_json(residency: tuple[Residency, ...]) -> str:
    text = _RESIDENCY_JSON.get(residency)
    if text is None:
        text = "[" + ",".join(
            f'{{"tier":{_SCALAR(r.tier)},"layers":[{r.layers[0]},{r.layers[1]}]'
            + ("}" if r.read_mbit_per_s is None else f',"read_mbit_per_s":{_SCALAR(r.read_mbit_per_s)}}}')
            for r in residency
        ) + "]"
        if len(_RESIDENCY_JSON) >= _CACHE_ENTRIES:
            _RESIDENCY_JSON.clear()
        _RESIDENCY_JSON[residency] = text
    return text


def dump_replica(record: ReplicaRecord) -> bytes:
    """``dump_json(record)``: the same octets, ~5x sooner (the members in the order
    ``to_json`` writes them, absent optional members omitted)."""
    layer_digests = ""
    if record.layer_digests is not None:
        digests = record.layer_digests
        if set(map(len, digests)) == {32}:  # one hex of them all, "|" between digests (hex has none)
            packed = b"".join(digests).hex("|", 32).replace("|", '","')
        else:  # not a record from_json would give; written as dump_json writes it anyway
            packed = '","'.join([d.hex() for d in digests])
        layer_digests = f'"layer_digests":["{packed}"],'
    namespace = "" if record.moqt_namespace is None else f',"moqt_namespace":{_SCALAR(record.moqt_namespace)}'
    return (
        f'{{"block_key":"{record.block_key.hex()}","compat_id":"{record.compat_id.hex()}",'
        f'"scope_id":"{record.scope_id.hex()}","holder":{_SCALAR(record.holder)},"codec":{record.codec},'
        f'"size":{record.size},"digest":"{_DIGEST_PREFIX}{record.digest.hex()}",{layer_digests}'
        f'"residency":{_residency_json(record.residency)},"ttl_ms":{record.ttl_ms}{namespace}}}'
    ).encode()


# -- reading back what the IS stored -------------------------------------------------------------


class _StoredResidency(msgspec.Struct, frozen=True):
    tier: str
    layers: tuple[int, int]
    read_mbit_per_s: float | int | None = None


class _Stored(msgspec.Struct):
    block_key: str
    compat_id: str
    scope_id: str
    holder: str
    codec: int
    size: int
    digest: str
    residency: tuple[_StoredResidency, ...]
    ttl_ms: int
    layer_digests: list[str] | None = None
    moqt_namespace: str | None = None


_STORED = msgspec.json.Decoder(_Stored)
_STORED_RESIDENCY: dict[tuple[_StoredResidency, ...], tuple[Residency, ...]] = {}


def _stored_residency(entries: tuple[_StoredResidency, ...]) -> tuple[Residency, ...]:
    known = _STORED_RESIDENCY.get(entries)
    if known is None:
        known = tuple(_filled(Residency, {"tier": e.tier, "layers": e.layers, "read_mbit_per_s": e.read_mbit_per_s})
                      for e in entries)
        if len(_STORED_RESIDENCY) >= _CACHE_ENTRIES:
            _STORED_RESIDENCY.clear()
        _STORED_RESIDENCY[entries] = known
    return known


def load_replica(data: bytes | memoryview) -> ReplicaRecord:
    """A record the Index Service stored (:func:`dump_replica`'s form of a record it had
    checked), as ``parse_json(data, ReplicaRecord)`` would give it; the rules are not checked
    again (the store is the IS's own, §6.1 checked the record before it was stored). Data that
    is not in that form goes through ``parse_json``: checked, a :class:`RecordError` if bad."""
    try:
        s = _STORED.decode(data)
        hex_parts: list[str] = [s.block_key, s.compat_id, s.scope_id, s.digest[8:]]
        if s.layer_digests is not None:
            hex_parts += s.layer_digests
        raw = bytes.fromhex("".join(hex_parts))
    except (msgspec.DecodeError, ValueError):
        return parse_json(data, ReplicaRecord)
    count = len(s.layer_digests) if s.layer_digests is not None else 0
    if len(raw) != 112 + 32 * count or not s.digest.startswith(_DIGEST_PREFIX) or not s.residency:
        return parse_json(data, ReplicaRecord)
    record = _filled(ReplicaRecord, {
        "block_key": raw[:32], "compat_id": raw[32:64], "scope_id": raw[64:80], "holder": s.holder,
        "codec": s.codec, "size": s.size, "digest": raw[80:112],
        "layer_digests": _split(raw, 112, count) if s.layer_digests is not None else None,
        "residency": _stored_residency(s.residency), "ttl_ms": s.ttl_ms, "moqt_namespace": s.moqt_namespace,
    })
    return record

