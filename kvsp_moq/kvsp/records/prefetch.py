"""Prefetch directives (kvsp-draft §6.5) and their status resource (shape ours)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Final

from .members import HEX16, HEX32, HOLDER_URL, UUID, Enum, Int, ListOf, Str
from .record import Nested, Record, member

#: The only layer order §6.5 defines: layer l is usable as soon as it arrives (§4.3).
ASCENDING: Final = "ascending"

PENDING: Final = "pending"
PARTIAL: Final = "partial"
COMPLETE: Final = "complete"
FAILED: Final = "failed"
#: The states of a directive (§6.5).
PREFETCH_STATES: Final = (PENDING, PARTIAL, COMPLETE, FAILED)


@dataclass(frozen=True, kw_only=True)
class PrefetchBlock(Record):
    """A block to load and the holders it may come from, in order of preference (§6.5)."""

    RECORD_NAME = "prefetch block"

    block_key: bytes = member(HEX32)
    sources: tuple[str, ...] = member(ListOf(HOLDER_URL, min_len=1))


@dataclass(frozen=True, kw_only=True)
class PrefetchDirective(Record):
    """Body of ``POST {ii-base}prefetch`` (§6.5). ``layer_order`` defaults to ``ascending``,
    the only value defined; ``request_ref`` is opaque to the instance."""

    RECORD_NAME = "prefetch directive"

    directive: uuid.UUID = member(UUID)
    request_ref: str | None = member(Str(min_len=0, max_len=1024), optional=True)
    scope_id: bytes = member(HEX16)
    compat_id: bytes = member(HEX32)
    blocks: tuple[PrefetchBlock, ...] = member(ListOf(Nested(PrefetchBlock), min_len=1))
    layer_order: str = member(Enum(ASCENDING), optional=True, default=ASCENDING)
    deadline_ms: int = member(Int(1))
    lease_ms: int = member(Int(1))


@dataclass(frozen=True, kw_only=True)
class PrefetchStatus(Record):
    """Body of ``GET`` on a directive's status resource (shape ours, §6.5): its state, the keys
    loaded so far, and for ``failed`` (or ``partial``) an optional human-readable ``error``.
    A ``complete`` directive has loaded something or had nothing to load; this record does not
    know the directive's blocks, so it does not check that."""

    RECORD_NAME = "prefetch status"

    directive: uuid.UUID = member(UUID)
    state: str = member(Enum(*PREFETCH_STATES))
    loaded: tuple[bytes, ...] = member(ListOf(HEX32))
    error: str | None = member(Str(min_len=0, max_len=4096), optional=True)
