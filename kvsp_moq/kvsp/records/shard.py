"""Shard Maps and the resharding messages (kvsp-draft §6.9)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import RecordError
from ._json import DEFAULT_MAX_SIZE, decode_json
from .members import HOLDER_URL, HTTP_URL, ROOT, TOKEN_RANGE, Int, ListOf, Str, check_disjoint, child, item
from .record import Nested, Record, member

#: The map identifier: an opaque non-empty string chosen by the PC.
MAP_ID = Str(max_len=256)
VERSION = Int(0)


@dataclass(frozen=True, kw_only=True)
class Shard(Record):
    """The half-open token range ``tokens`` of the context is held by ``instance``."""

    RECORD_NAME = "shard"

    tokens: tuple[int, int] = member(TOKEN_RANGE)
    instance: str = member(HTTP_URL)


@dataclass(frozen=True, kw_only=True)
class ShardMap(Record):
    """The split of one context by token range across a parallel group (§6.9).

    Ranges are listed in token order and are contiguous: each starts where the previous one
    ends, so they cannot overlap. The first need not start at 0 (§6.9 does not say so).
    """

    RECORD_NAME = "shard map"

    map: str = member(MAP_ID)
    version: int = member(VERSION)
    shards: tuple[Shard, ...] = member(ListOf(Nested(Shard), min_len=1))

    def _check(self, path: str) -> None:
        shards_at = child(path, "shards")
        for i in range(1, len(self.shards)):
            end, start = self.shards[i - 1].tokens[1], self.shards[i].tokens[0]
            if start != end:
                problem = "overlaps" if start < end else "leaves a gap after"
                raise RecordError(
                    child(item(shards_at, i), "tokens"),
                    f"{problem} shards[{i - 1}]: must start at {end}, got {start}",
                )

    def instance_of(self, token: int) -> str | None:
        """The instance holding ``token``, or ``None`` if it is outside the map."""
        return next((s.instance for s in self.shards if s.tokens[0] <= token < s.tokens[1]), None)


@dataclass(frozen=True, kw_only=True)
class RangeFetch(Record):
    """An entry of ``fetch``: load ``tokens`` from the instance ``source`` (JSON ``from``)."""

    RECORD_NAME = "fetch entry"

    tokens: tuple[int, int] = member(TOKEN_RANGE)
    source: str = member(HOLDER_URL, name="from")


_RANGES = ListOf(TOKEN_RANGE)


@dataclass(frozen=True, kw_only=True)
class ReshardPlan(Record):
    """``POST reshard`` moving one instance from version ``from`` to ``to`` = ``from`` + 1 (§6.9).

    ``retain``, ``fetch`` and ``release`` default to empty when absent. The instance's ranges
    in the new version are retain + fetch, and ``release`` lists ranges it holds now but not
    then, so no two ranges of the three lists may overlap.
    """

    RECORD_NAME = "reshard plan"

    map: str = member(MAP_ID)
    from_version: int = member(VERSION, name="from")
    to_version: int = member(VERSION, name="to")
    deadline_ms: int = member(Int(1))
    retain: tuple[tuple[int, int], ...] = member(_RANGES, optional=True, default=())
    fetch: tuple[RangeFetch, ...] = member(ListOf(Nested(RangeFetch)), optional=True, default=())
    release: tuple[tuple[int, int], ...] = member(_RANGES, optional=True, default=())

    def _check(self, path: str) -> None:
        if self.to_version != self.from_version + 1:
            raise RecordError(child(path, "to"), f"must be from + 1 = {self.from_version + 1}, got {self.to_version}")
        paths = (
            [item(child(path, "retain"), i) for i in range(len(self.retain))]
            + [child(item(child(path, "fetch"), i), "tokens") for i in range(len(self.fetch))]
            + [item(child(path, "release"), i) for i in range(len(self.release))]
        )
        ranges = list(self.retain) + [f.tokens for f in self.fetch] + list(self.release)
        check_disjoint(ranges, paths.__getitem__, inclusive=False)


@dataclass(frozen=True, kw_only=True)
class ReshardCommit(Record):
    """``{"map": ..., "commit": v+1}``: the new version is authoritative (§6.9)."""

    RECORD_NAME = "reshard commit"

    map: str = member(MAP_ID)
    commit: int = member(VERSION)


@dataclass(frozen=True, kw_only=True)
class ReshardAbort(Record):
    """``{"map": ..., "abort": v+1}``: discard what was fetched for version v+1 (§6.9)."""

    RECORD_NAME = "reshard abort"

    map: str = member(MAP_ID)
    abort: int = member(VERSION)


ReshardMessage = ReshardPlan | ReshardCommit | ReshardAbort


def reshard_message_from_json(obj: object) -> ReshardMessage:
    """Tell the three bodies of ``POST reshard`` apart: ``commit`` or ``abort`` present makes a
    commit or an abort (both present is an error); otherwise it is a plan."""
    if not isinstance(obj, dict):
        raise RecordError(ROOT, "reshard message must be a JSON object")
    if "commit" in obj and "abort" in obj:
        raise RecordError(ROOT, "reshard message has both commit and abort")
    if "commit" in obj:
        return ReshardCommit.from_json(obj)
    if "abort" in obj:
        return ReshardAbort.from_json(obj)
    return ReshardPlan.from_json(obj)


def parse_reshard_message(data: bytes | bytearray | memoryview | str, *, max_size: int = DEFAULT_MAX_SIZE) -> ReshardMessage:
    """Decode and validate a ``POST reshard`` body. Raises only :class:`RecordError`."""
    return reshard_message_from_json(decode_json(data, max_size=max_size))
