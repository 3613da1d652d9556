"""The base of every KVSP JSON record: members declared once, read and written generically.

A record is a frozen, keyword-only dataclass whose fields are declared with :func:`member`,
which names the JSON member and its :class:`~.members.Kind`. :meth:`Record.from_json` reads
and checks every member, ignores unknown ones (kvsp-draft §4.4: "Unknown members MUST be
ignored"), then runs the record's cross-member rules (:meth:`Record._check`).
:meth:`Record.to_json` writes the known members only and omits absent optional ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Self, TypeVar

from ..errors import RecordError
from .members import ROOT, JsonValue, Kind, json_type, child

T = TypeVar("T")
_SPEC = "kvsp_member"
_MISSING: Any = dataclasses.MISSING


@dataclass(frozen=True)
class MemberSpec(Generic[T]):
    """How one dataclass field maps to a JSON member."""

    name: str | None  # JSON member name; None: the field's own name
    kind: Kind[T]
    optional: bool
    emit_null: bool  # write ``null`` rather than omit the member when the value is None
    lenient: bool  # a bad value reads as absent (RFC 9457 §3.1 for problem details)


def member(
    kind: Kind[T],
    *,
    name: str | None = None,
    optional: bool = False,
    default: object = None,
    emit_null: bool = False,
    lenient: bool = False,
) -> Any:
    """Declare a record field. A required member has no default; an optional one reads as
    ``default`` (``None`` unless given) when absent. ``name`` is the JSON member name when it
    differs from the field name (``from`` is a Python keyword)."""
    spec = MemberSpec(name, kind, optional, emit_null, lenient)
    if not optional:
        return dataclasses.field(metadata={_SPEC: spec})
    return dataclasses.field(default=default, metadata={_SPEC: spec})


class Record:
    """Base of the JSON records. Subclasses are ``@dataclass(frozen=True, kw_only=True)``."""

    #: Human name used in error messages of the record as a whole.
    RECORD_NAME: ClassVar[str] = "record"

    @classmethod
    def from_json(cls, obj: object) -> Self:
        """Validate a decoded JSON value and build the record; :class:`RecordError` otherwise."""
        return cls.read_at(obj, ROOT)

    @classmethod
    def read_at(cls, obj: object, path: str) -> Self:
        """Like :meth:`from_json` for a record nested at ``path`` of an enclosing record."""
        if not isinstance(obj, dict):
            raise RecordError(path, f"{cls.RECORD_NAME} must be a JSON object, got {json_type(obj)}")
        values: dict[str, object] = {}
        for field in dataclasses.fields(cls):  # type: ignore[arg-type]
            spec: MemberSpec[object] = field.metadata[_SPEC]
            name = spec.name or field.name
            at = child(path, name)
            if name not in obj:
                if not spec.optional:
                    raise RecordError(at, "required member is missing")
                continue  # the dataclass default applies
            try:
                values[field.name] = spec.kind.read(obj[name], at)
            except RecordError:
                if not spec.lenient:
                    raise
        record = cls(**values)
        record._check(path)
        return record

    def _check(self, path: str) -> None:
        """Cross-member rules; ``path`` is where the record sits. Override where needed."""

    def to_json(self) -> dict[str, JsonValue]:
        """The record as a JSON object: known members only, absent optional members omitted."""
        out: dict[str, JsonValue] = {}
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            spec: MemberSpec[object] = field.metadata[_SPEC]
            value = getattr(self, field.name)
            if value is None:
                if spec.emit_null:
                    out[spec.name or field.name] = None
                continue
            out[spec.name or field.name] = spec.kind.write(value)
        return out


R = TypeVar("R", bound=Record)


class Nested(Kind[R]):
    """A member whose value is another record (``residency[i]``, ``sampler``, ...)."""

    def __init__(self, record_type: type[R]) -> None:
        self.record_type = record_type

    def read(self, value: object, path: str) -> R:
        return self.record_type.read_at(value, path)

    def write(self, value: R) -> JsonValue:
        return value.to_json()
