"""What the PC stores (DESIGN.md §8): the durable facts behind its registry, sessions and maps.

The live objects of the active PC (``pc.registry``, ``pc.sessions``, ``pc.reshard``) are a cache
of these; a PC that becomes active loads them (:class:`PcSnapshot`). Each record has a JSON
form (``to_doc``/``from_doc``) for the Redis store; the memory store keeps the objects as they are.

- :class:`StoredInstance` — an instance's latest status record (§6.3), the state the PC
  assigned it, and whether it is known failed (expired or reported, until it reports again).
  The highest epoch per instance is kept beside it (§6.3 "reject a lower epoch").
- :class:`StoredSession` — a session (§6.8): what opened it, its session epoch, the instance
  serving it, what the PC learnt of it. The checkpoint with the highest ``output_offset`` is
  kept beside it, so that a checkpoint write touches only the checkpoint.
- Shard Maps (§6.9) are stored as the records they are, with their version beside them.
- :class:`StoredReshard` — a reshard in flight (§6.9), from the moment its plans go out until
  every member has been sent the decision, so that a PC taking over finishes it.
- :class:`IssuedDirective` — a §6.5 directive sent, while it can still matter.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from ....kvsp.records import InstanceStatusRecord, PrefetchDirective, SessionCheckpoint, ShardMap
from ...common.session_records import SessionOpen

__all__ = ["COMMIT", "ABORT", "IssuedDirective", "PcSnapshot", "StoredInstance", "StoredReshard", "StoredSession", "dumps"]

#: The two decisions of a reshard (§6.9): commit v+1, or abort it (v stays authoritative).
COMMIT = "commit"
ABORT = "abort"


def dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)


@dataclass(frozen=True)
class StoredInstance:
    """An instance as the PC last knew it (§6.3)."""

    record: InstanceStatusRecord
    assigned: str | None = None  # the last state the PC set for this epoch
    failed: bool = False  # expired or reported failed; cleared by its next report

    @property
    def instance(self) -> str:
        return self.record.instance

    @property
    def epoch(self) -> int:
        return self.record.epoch

    def to_doc(self) -> str:
        return dumps({"record": self.record.to_json(), "assigned": self.assigned, "failed": self.failed})

    @classmethod
    def from_doc(cls, doc: str | bytes) -> StoredInstance:
        obj = json.loads(doc)
        return cls(InstanceStatusRecord.from_json(obj["record"]), obj.get("assigned"), bool(obj.get("failed")))


@dataclass(frozen=True)
class StoredSession:
    """A session without its checkpoint (§6.8); see ``pc.sessions.SessionEntry``."""

    open: SessionOpen
    epoch: int
    instance: str | None = None
    instance_epoch: int | None = None
    fresh: bool = False
    resumed: bool = False
    refused: frozenset[str] = frozenset()
    failed: str | None = None
    directives: tuple[uuid.UUID, ...] = ()

    @property
    def session(self) -> uuid.UUID:
        return self.open.session

    def to_doc(self) -> str:
        """JSON of everything but the epoch (stored beside it: the scripts compare it)."""
        return dumps({
            "open": self.open.to_json(), "instance": self.instance, "instance_epoch": self.instance_epoch,
            "fresh": self.fresh, "resumed": self.resumed, "refused": sorted(self.refused), "failed": self.failed,
            "directives": [str(d) for d in self.directives],
        })

    @classmethod
    def from_doc(cls, doc: str | bytes, epoch: int) -> StoredSession:
        obj = json.loads(doc)
        return cls(
            open=SessionOpen.from_json(obj["open"]), epoch=epoch, instance=obj.get("instance"),
            instance_epoch=obj.get("instance_epoch"), fresh=bool(obj.get("fresh")), resumed=bool(obj.get("resumed")),
            refused=frozenset(obj.get("refused", ())), failed=obj.get("failed"),
            directives=tuple(uuid.UUID(d) for d in obj.get("directives", ())),
        )


@dataclass(frozen=True)
class IssuedDirective:
    """A §6.5 prefetch directive the PC sent, to which instance, and until when it matters
    (its deadline plus its lease, in wall-clock ms: processes share no monotonic clock)."""

    instance: str
    directive: PrefetchDirective
    until_unix_ms: int
    #: Its status resource (the instance's ``Location``), once the instance accepted it.
    location: str | None = None

    def to_doc(self) -> str:
        return dumps({"instance": self.instance, "directive": self.directive.to_json(), "until": self.until_unix_ms,
                      "location": self.location})

    @classmethod
    def from_doc(cls, doc: str | bytes) -> IssuedDirective:
        obj = json.loads(doc)
        location = obj.get("location")
        directive = PrefetchDirective.from_json(obj["directive"])
        return cls(obj["instance"], directive, int(obj["until"]), location if isinstance(location, str) else None)


@dataclass
class PcSnapshot:
    """Everything a PC loads when it becomes the active one."""

    instances: dict[str, StoredInstance] = field(default_factory=dict)
    epochs: dict[str, int] = field(default_factory=dict)  # highest per instance, also of forgotten ones
    sessions: dict[uuid.UUID, StoredSession] = field(default_factory=dict)
    checkpoints: dict[uuid.UUID, SessionCheckpoint] = field(default_factory=dict)
    shard_maps: dict[str, ShardMap] = field(default_factory=dict)
    directives: dict[uuid.UUID, IssuedDirective] = field(default_factory=dict)
    reshards: dict[str, StoredReshard] = field(default_factory=dict)  # by map id: at most one in flight each


@dataclass(frozen=True)
class StoredReshard:
    """A reshard of ``old`` (version v, authoritative) to ``new`` (v+1) in flight (§6.9).

    Stored before the first plan is sent and deleted once every member has been sent the
    decision. The plans are not stored: :func:`~..reshard_plan.reshard_plans` recomputes the
    same ones from ``old``, ``new`` and ``deadline_ms``, and a member given the same plan again
    awaits the work it started (never fetches twice). ``decision`` is set, in the same atomic
    step that makes v+1 authoritative for a commit, before any member hears it; a PC that
    takes over sends a decided reshard's decision again (commit and abort are idempotent at
    the members) and asks the members of an undecided one again until ``until_unix_ms``.
    """

    old: ShardMap
    new: ShardMap
    deadline_ms: int  # the plans' deadline_ms
    until_unix_ms: int  # when that deadline passes (wall clock: PCs share no monotonic clock)
    decision: str | None = None  # COMMIT or ABORT once decided

    @property
    def map(self) -> str:
        return self.new.map

    def to_doc(self) -> str:
        """JSON of everything but the decision (stored beside it: the scripts set it)."""
        return dumps({"old": self.old.to_json(), "new": self.new.to_json(), "deadline_ms": self.deadline_ms,
                      "until": self.until_unix_ms})

    @classmethod
    def from_doc(cls, doc: str | bytes, decision: str | None) -> StoredReshard:
        obj = json.loads(doc)
        return cls(ShardMap.from_json(obj["old"]), ShardMap.from_json(obj["new"]), int(obj["deadline_ms"]),
                   int(obj["until"]), decision if decision in (COMMIT, ABORT) else None)
