"""Typed readers for the members of KVSP JSON records (kvsp-draft §4.4, §6).

Each reader is a :class:`Kind`: ``read(value, path)`` checks one JSON value and returns its
typed Python form, or raises :class:`RecordError` naming ``path``; ``write(value)`` turns the
typed form back into a JSON value. Paths are dotted member paths (``residency[1].layers``);
the record as a whole is ``$``.

Numbers follow I-JSON (RFC 7493 §2.2): integers are limited to ±(2**53 - 1) unless a reader
says otherwise, so that every peer's JSON parser reads them exactly.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Generic, TypeAlias, TypeVar
from urllib.parse import urlsplit

from ..errors import RecordError
from ..hexids import format_digest, parse_digest, parse_hex16, parse_hex32, parse_uuid

T = TypeVar("T")

#: Path of a record as a whole.
ROOT = "$"
#: Largest integer that every JSON parser reads exactly (RFC 7493 §2.2).
MAX_SAFE_INT = 2**53 - 1
UINT32_MAX = 2**32 - 1
#: Nesting limit for free-form JSON members (the same limit as the JSON decoder's).
MAX_JSON_DEPTH = 64

#: A decoded JSON value: dict[str, JsonValue] | list[JsonValue] | str | int | float | bool | None.
#: ``Any``, like ``json.loads``'s result, so that callers can index what ``to_json`` returns.
JsonValue: TypeAlias = Any


def child(path: str, name: str) -> str:
    """Path of member ``name`` of the object at ``path``."""
    return name if path == ROOT else f"{path}.{name}"


def item(path: str, index: int) -> str:
    """Path of element ``index`` of the array at ``path``."""
    return f"{path}[{index}]"


class Kind(Generic[T]):
    """The JSON type of a member: how to read it (with checks) and how to write it back."""

    def read(self, value: object, path: str) -> T:
        raise NotImplementedError

    def write(self, value: T) -> JsonValue:
        return value


# ---------------------------------------------------------------------------------------------
# Scalars


def _check_text(value: str, path: str) -> str:
    """Reject strings that are not valid Unicode (lone surrogates from ``\\ud800`` escapes):
    I-JSON (RFC 7493 §2.1) forbids them and they cannot be written back as UTF-8."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RecordError(path, "string is not valid Unicode (lone surrogate)") from None
    return value


class Str(Kind[str]):
    """A string of ``min_len``..``max_len`` characters, optionally matching ``pattern`` or one of
    ``choices``."""

    def __init__(
        self,
        *,
        min_len: int = 1,
        max_len: int | None = None,
        pattern: str | None = None,
        choices: Sequence[str] | None = None,
        what: str = "a string",
    ) -> None:
        self.min_len = min_len
        self.max_len = max_len
        self.pattern = re.compile(pattern) if pattern is not None else None
        self.choices = tuple(choices) if choices is not None else None
        self.what = what

    def read(self, value: object, path: str) -> str:
        if not isinstance(value, str):
            raise RecordError(path, f"must be {self.what}, got {json_type(value)}")
        if self.choices is not None:
            if value not in self.choices:
                raise RecordError(path, f"must be one of {', '.join(map(repr, self.choices))}, got {value[:80]!r}")
            return value
        if len(value) < self.min_len:
            raise RecordError(path, "must not be empty" if self.min_len == 1 else f"must have at least {self.min_len} characters")
        if self.max_len is not None and len(value) > self.max_len:
            raise RecordError(path, f"must have at most {self.max_len} characters")
        if self.pattern is not None and self.pattern.fullmatch(value) is None:
            raise RecordError(path, f"must be {self.what}, got {value[:80]!r}")
        return _check_text(value, path)


def Enum(*choices: str) -> Str:
    """A string from a closed set (states, layer orders)."""
    return Str(choices=choices)


class Int(Kind[int]):
    """An integer in ``[minimum, maximum]``. Booleans are rejected; a float is accepted only
    when it has no fraction (``3.0``), since JSON does not distinguish the two."""

    def __init__(self, minimum: int = -MAX_SAFE_INT, maximum: int = MAX_SAFE_INT) -> None:
        self.minimum = minimum
        self.maximum = maximum

    def read(self, value: object, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecordError(path, f"must be an integer, got {json_type(value)}")
        if isinstance(value, float):
            if not value.is_integer():
                raise RecordError(path, f"must be an integer, got {value!r}")
            value = int(value)
        if value < self.minimum or value > self.maximum:
            raise RecordError(path, f"must be in [{self.minimum}, {self.maximum}], got {value}")
        return value


class Num(Kind[float]):
    """A finite number; ``minimum``/``maximum`` bounds are inclusive unless ``exclusive_min``.

    Integers beyond I-JSON's exact range are read as floats (and rejected if they overflow)."""

    def __init__(self, minimum: float | None = None, maximum: float | None = None, *, exclusive_min: bool = False) -> None:
        self.minimum = minimum
        self.maximum = maximum
        self.exclusive_min = exclusive_min

    def read(self, value: object, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecordError(path, f"must be a number, got {json_type(value)}")
        if isinstance(value, int) and abs(value) > MAX_SAFE_INT:
            try:
                value = float(value)
            except OverflowError:
                raise RecordError(path, "number is out of range") from None
        if not math.isfinite(value):
            raise RecordError(path, f"must be a finite number, got {value!r}")
        if self.minimum is not None:
            if value < self.minimum or (self.exclusive_min and value == self.minimum):
                relation = ">" if self.exclusive_min else ">="
                raise RecordError(path, f"must be {relation} {self.minimum}, got {value!r}")
        if self.maximum is not None and value > self.maximum:
            raise RecordError(path, f"must be <= {self.maximum}, got {value!r}")
        return value


class Bool(Kind[bool]):
    def read(self, value: object, path: str) -> bool:
        if not isinstance(value, bool):
            raise RecordError(path, f"must be true or false, got {json_type(value)}")
        return value


class _Wrapped(Kind[T]):
    """A string decoded by one of the ``hexids`` parsers, whose ``ValueError`` becomes a
    :class:`RecordError`."""

    def __init__(self, parse: Callable[[object, str], T], format_: Callable[[T], str],
                 hex_octets: int | None = None) -> None:
        self.parse = parse
        self.format = format_
        #: For plain lowercase-hex identifiers: their size, enabling :meth:`read_hex_array`.
        self.hex_octets = hex_octets

    def read(self, value: object, path: str) -> T:
        try:
            return self.parse(value, path)
        except ValueError as exc:
            raise RecordError(path, str(exc).removeprefix(f"{path} ")) from None

    def write(self, value: T) -> JsonValue:
        return self.format(value)

    def read_hex_array(self, values: list[object]) -> tuple[bytes, ...] | None:
        """All of ``values`` at once when every one is valid lowercase hex of ``hex_octets``
        (one regex match and one ``bytes.fromhex`` over the joined text: lookup responses
        carry thousands of layer digests); ``None`` to fall back to per-element reading,
        which names the offending element."""
        n = self.hex_octets
        if n is None or not all(type(v) is str and len(v) == 2 * n for v in values):
            return None
        joined = "".join(values)  # type: ignore[arg-type]
        if _LOWER_HEX.fullmatch(joined) is None:
            return None
        raw = bytes.fromhex(joined)
        return tuple(raw[i:i + n] for i in range(0, len(raw), n))


_LOWER_HEX = re.compile(r"[0-9a-f]*")

#: 32 octets as 64 lowercase hex digits (compat_id, block_key, layer digests; §4.4).
HEX32: Kind[bytes] = _Wrapped(parse_hex32, bytes.hex, 32)
#: 16 octets as 32 lowercase hex digits (scope_id; §4.2).
HEX16: Kind[bytes] = _Wrapped(parse_hex16, bytes.hex, 16)
#: ``"sha-256:" + hex`` (§4.1); the Python form is the 32 raw octets.
DIGEST: Kind[bytes] = _Wrapped(parse_digest, format_digest)
#: A UUID (RFC 9562) in canonical 8-4-4-4-12 form.
UUID: Kind[uuid.UUID] = _Wrapped(parse_uuid, str)


class Url(Kind[str]):
    """An absolute URL with one of ``schemes`` (lowercase) and a non-empty host.

    URLs are ASCII (non-ASCII characters must be percent-encoded) and contain no whitespace or
    control characters. The URL is kept exactly as written, since it is an identity (a holder
    or an instance) that other records compare by string."""

    MAX_LEN = 2048

    def __init__(self, *schemes: str) -> None:
        self.schemes = schemes

    def read(self, value: object, path: str) -> str:
        text = Str(max_len=self.MAX_LEN, what="a URL").read(value, path)
        if not text.isascii() or any(c <= " " or c == "\x7f" for c in text):
            raise RecordError(path, "a URL must be ASCII without spaces or control characters")
        scheme = text.partition(":")[0]
        if scheme not in self.schemes:
            raise RecordError(path, f"URL scheme must be one of {', '.join(self.schemes)}, got {text[:80]!r}")
        try:
            parts = urlsplit(text)
            _ = parts.port  # raises ValueError for a non-numeric or out-of-range port
        except ValueError as exc:
            raise RecordError(path, f"not a valid URL: {exc}") from None
        if not text.startswith(f"{scheme}://") or not parts.hostname:
            raise RecordError(path, f"must be an absolute URL with a host, got {text[:80]!r}")
        return text


#: Endpoints reached over HTTP: instances, the PC, the IS (DESIGN.md §5).
HTTP_URL = Url("http", "https")
#: Holders and sources, which may also be MOQT endpoints or relays (§4.4).
HOLDER_URL = Url("http", "https", "moqt")


# ---------------------------------------------------------------------------------------------
# Composites


class Nullable(Kind["T | None"]):
    """``null`` or a value of ``inner``."""

    def __init__(self, inner: Kind[T]) -> None:
        self.inner = inner

    def read(self, value: object, path: str) -> T | None:
        return None if value is None else self.inner.read(value, path)

    def write(self, value: T | None) -> JsonValue:
        return None if value is None else self.inner.write(value)


class ListOf(Kind["tuple[T, ...]"]):
    """An array of ``min_len``..``max_len`` elements of ``inner``, read as a tuple."""

    def __init__(self, inner: Kind[T], *, min_len: int = 0, max_len: int | None = None) -> None:
        self.inner = inner
        self.min_len = min_len
        self.max_len = max_len

    def read(self, value: object, path: str) -> tuple[T, ...]:
        if not isinstance(value, list):
            raise RecordError(path, f"must be an array, got {json_type(value)}")
        if len(value) < self.min_len:
            raise RecordError(path, "must not be empty" if self.min_len == 1 else f"must have at least {self.min_len} elements")
        if self.max_len is not None and len(value) > self.max_len:
            raise RecordError(path, f"must have at most {self.max_len} elements, got {len(value)}")
        if isinstance(self.inner, _Wrapped):
            fast = self.inner.read_hex_array(value)
            if fast is not None:
                return fast  # type: ignore[return-value]
        return tuple(self.inner.read(v, item(path, i)) for i, v in enumerate(value))

    def write(self, value: tuple[T, ...]) -> JsonValue:
        return [self.inner.write(v) for v in value]


class Range(Kind["tuple[int, int]"]):
    """A two-element array ``[a, b]`` of integers in ``[0, maximum]``.

    ``inclusive`` ranges (layers, §4.4) need ``a <= b``; half-open ranges (tokens, §6.9) need
    ``a < b``, so that no range is empty."""

    def __init__(self, *, inclusive: bool, maximum: int = MAX_SAFE_INT) -> None:
        self.inclusive = inclusive
        self.bound = Int(0, maximum)

    def read(self, value: object, path: str) -> tuple[int, int]:
        if not isinstance(value, list) or len(value) != 2:
            raise RecordError(path, "must be an array of two integers [a, b]")
        a = self.bound.read(value[0], path)
        b = self.bound.read(value[1], path)
        if b < a or (b == a and not self.inclusive):
            relation = "a <= b" if self.inclusive else "a < b"
            raise RecordError(path, f"range [{a}, {b}] must have {relation}")
        return (a, b)

    def write(self, value: tuple[int, int]) -> JsonValue:
        return [value[0], value[1]]


#: Inclusive layer range ``[first, last]`` (§4.4); layers are 32-bit in KVB1 (§4.3).
LAYER_RANGE = Range(inclusive=True, maximum=UINT32_MAX)
#: Half-open token range ``[start, end)`` (§6.9).
TOKEN_RANGE = Range(inclusive=False)
#: A token identifier: uint32 (§4.2).
TOKEN = Int(0, UINT32_MAX)


class JsonObject(Kind["Mapping[str, JsonValue]"]):
    """A free-form JSON object (``sampler.params``, §4.4), frozen: objects become read-only
    mappings and arrays tuples, so records stay immutable. ``write`` thaws it again."""

    def read(self, value: object, path: str) -> Mapping[str, JsonValue]:
        if not isinstance(value, dict):
            raise RecordError(path, f"must be an object, got {json_type(value)}")
        frozen = _freeze(value, path, 1)
        assert isinstance(frozen, Mapping)
        return frozen

    def write(self, value: Mapping[str, JsonValue]) -> JsonValue:
        return _thaw(value)


def _freeze(value: object, path: str, depth: int) -> JsonValue:
    if depth > MAX_JSON_DEPTH:
        raise RecordError(path, f"nested deeper than {MAX_JSON_DEPTH}")
    if isinstance(value, dict):
        out: dict[str, JsonValue] = {}
        for key, v in value.items():
            if not isinstance(key, str):
                raise RecordError(path, "object member names must be strings")
            out[_check_text(key, path)] = _freeze(v, child(path, key), depth + 1)
        return MappingProxyType(out)
    if isinstance(value, list):
        return tuple(_freeze(v, item(path, i), depth + 1) for i, v in enumerate(value))
    if isinstance(value, str):
        return _check_text(value, path)
    if isinstance(value, float) and not math.isfinite(value):
        raise RecordError(path, "must be a finite number")
    if value is None or isinstance(value, (bool, int, float)):
        return value
    raise RecordError(path, f"not a JSON value: {type(value).__name__}")


def _thaw(value: object) -> JsonValue:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_thaw(v) for v in value]
    return value


def json_type(value: object) -> str:
    """The JSON name of a value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


# ---------------------------------------------------------------------------------------------
# Range sets


def check_disjoint(
    ranges: Sequence[tuple[int, int]],
    path_of: Callable[[int], str],
    *,
    inclusive: bool,
) -> None:
    """Raise a :class:`RecordError` if two of ``ranges`` overlap.

    ``path_of(i)`` names range ``i``; the error names the later (higher-index) range of an
    overlapping pair and mentions the other. O(n log n), since arrays come from untrusted peers.
    """
    order = sorted(range(len(ranges)), key=lambda i: ranges[i])
    reach: int | None = None  # index of the range that reaches furthest so far
    for i in order:
        if reach is not None and _overlaps(ranges[reach], ranges[i], inclusive):
            later, earlier = max(i, reach), min(i, reach)
            raise RecordError(path_of(later), f"overlaps {path_of(earlier)}")
        if reach is None or ranges[i][1] > ranges[reach][1]:
            reach = i


def _overlaps(a: tuple[int, int], b: tuple[int, int], inclusive: bool) -> bool:
    """Whether ``b`` (which starts no earlier than ``a``) overlaps ``a``."""
    return b[0] <= a[1] if inclusive else b[0] < a[1]


def merge_ranges(ranges: Sequence[range]) -> tuple[range, ...]:
    """Sorted union of ``ranges``, with adjacent and overlapping ones merged."""
    merged: list[range] = []
    for r in sorted((r for r in ranges if r), key=lambda r: r.start):
        if merged and r.start <= merged[-1].stop:
            merged[-1] = range(merged[-1].start, max(merged[-1].stop, r.stop))
        else:
            merged.append(r)
    return tuple(merged)
