"""Problem details (RFC 9457) as KVSP services send and read them (DESIGN.md §5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from .. import problems
from .members import Int, Str
from .record import Record, member

_TEXT = Str(min_len=0, max_len=8192)


@dataclass(frozen=True, kw_only=True)
class Problem(Record):
    """An RFC 9457 problem details object (``application/problem+json``).

    All members are optional. As RFC 9457 §3.1 requires, a member whose value has the wrong
    type is ignored rather than rejected, and an absent ``type`` means ``about:blank``.
    Extension members are not kept (they are unknown members, §4.4).
    """

    RECORD_NAME = "problem details"

    type: str = member(_TEXT, optional=True, default="about:blank", lenient=True)
    title: str | None = member(_TEXT, optional=True, lenient=True)
    status: int | None = member(Int(100, 599), optional=True, lenient=True)
    detail: str | None = member(_TEXT, optional=True, lenient=True)
    instance: str | None = member(_TEXT, optional=True, lenient=True)

    @classmethod
    def of(cls, name: str, detail: str | None = None, *, status: int | None = None, instance: str | None = None) -> Self:
        """A KVSP problem by name (:mod:`kvsp_moq.kvsp.problems`), with its default status and
        title unless ``status`` is given."""
        return cls(
            type=problems.problem_type(name),
            title=problems.TITLES[name],
            status=status if status is not None else problems.DEFAULT_STATUS[name],
            detail=detail,
            instance=instance,
        )

    @property
    def name(self) -> str | None:
        """The KVSP problem name (``kvsp-stale-epoch``, ...) or ``None`` for another type."""
        return problems.problem_name(self.type)
