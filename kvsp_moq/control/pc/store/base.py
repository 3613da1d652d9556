"""The PC's state store (DESIGN.md §8): one interface, two implementations
(:class:`~.memory.MemoryPcStore`, the embedded default, and :class:`~.shared.RedisPcStore`).

Every write names the **leader token** of the PC making it and is refused with
:class:`~..common.errors.NotLeader` unless that token holds the leader lock at that instant,
checked in the same atomic step as the write (a Lua script in Redis). A deposed PC therefore
cannot write, even one that does not know yet that it was deposed (a paused process).

Every "reject a lower epoch / keep the highest" rule is decided by the store, atomically:

- :meth:`PcStore.put_instance` — §6.3: a status record with an epoch lower than the highest
  stored for its instance is refused (:class:`StaleEpoch`); the highest epoch is raised;
- :meth:`PcStore.save_session` — §6.8: a compare-and-set on the session epoch
  (``expected_epoch`` must be the stored one, the new epoch is never lower), so that of two
  PCs raising a session's epoch after a failure only one succeeds;
- :meth:`PcStore.put_checkpoint` — §6.8: refused for an epoch other than the session's
  (lower: :class:`StaleEpoch`; higher: never assigned, :class:`RecordError`); kept only when
  it covers at least as much output as the kept one; answers the kept offset;
- :meth:`PcStore.delete_session` — only at the session's epoch;
- :meth:`PcStore.put_shard_map` — §6.9: only a version above the stored one;
- :meth:`PcStore.begin_reshard` / :meth:`PcStore.decide_reshard` / :meth:`PcStore.end_reshard`
  — §6.9: one reshard per map in flight, begun only from the authoritative version; its
  decision is taken once (a commit stores v+1 in the same step) and kept until the reshard ends.

The leader lock (:meth:`acquire`, :meth:`renew`, :meth:`release`) is a lease: it lapses
``lease_ms`` after the last acquire or renew unless renewed. ``lease_ms=None`` holds it for
good, for a PC that shares its store with no other process (the memory store only).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable
from typing import Protocol

from ....kvsp.records import SessionCheckpoint, ShardMap
from .records import IssuedDirective, PcSnapshot, StoredInstance, StoredReshard, StoredSession

__all__ = ["PcStore"]


class PcStore(Protocol):
    """See the module notes. Store calls that cannot reach the store raise
    :class:`~..common.errors.StoreUnavailable` within the store's timeout."""

    # -- the leader lock ------------------------------------------------------------------------

    def acquire(self, token: str, lease_ms: int | None) -> Awaitable[bool]:
        """Take the lock if nobody holds it (or ``token`` does: then it is renewed)."""
        ...

    def renew(self, token: str, lease_ms: int) -> Awaitable[bool]:
        """Extend the lock if ``token`` still holds it."""
        ...

    def release(self, token: str) -> Awaitable[None]:
        """Give the lock up if ``token`` holds it (a PC shutting down)."""
        ...

    def holder(self) -> Awaitable[str | None]:
        """The token holding the lock now, if any."""
        ...

    # -- state ----------------------------------------------------------------------------------

    def load(self) -> Awaitable[PcSnapshot]:
        """Everything stored (the new leader's start)."""
        ...

    def put_instance(self, token: str, entry: StoredInstance) -> Awaitable[None]:
        """Keep ``entry`` unless its epoch is lower than the highest stored (StaleEpoch)."""
        ...

    def create_session(self, token: str, session: StoredSession, checkpoint: SessionCheckpoint) -> Awaitable[bool]:
        """Store a new session with its initial checkpoint; False if the id is taken."""
        ...

    def get_session(self, session: uuid.UUID) -> Awaitable[tuple[StoredSession, SessionCheckpoint] | None]:
        """The stored session and its kept checkpoint, or None (a read: no token, no ``WAIT``).
        What a PC re-reads after a write whose acknowledgement it did not get (the write may
        have been applied: ``pc/sessions.py``)."""
        ...

    def save_session(self, token: str, session: StoredSession, *, expected_epoch: int) -> Awaitable[None]:
        """Compare-and-set: StaleEpoch unless the stored epoch is ``expected_epoch`` and the
        new one is not lower; NotFound for an unknown session."""
        ...

    def put_checkpoint(self, token: str, checkpoint: SessionCheckpoint) -> Awaitable[int]:
        """Keep the checkpoint with the highest ``output_offset`` of the session's epoch;
        the output offset kept. StaleEpoch / RecordError / NotFound (module notes)."""
        ...

    def delete_session(self, token: str, session: uuid.UUID, epoch: int) -> Awaitable[None]:
        """Forget the session; StaleEpoch unless ``epoch`` is its epoch, NotFound if unknown."""
        ...

    def get_shard_map(self, map_id: str) -> Awaitable[tuple[ShardMap | None, StoredReshard | None]]:
        """The stored map and its stored reshard, read together (a read: no token, no ``WAIT``);
        re-read after a write whose acknowledgement did not come (``pc/reshard.py``)."""
        ...

    def put_shard_map(self, token: str, shard_map: ShardMap) -> Awaitable[None]:
        """Keep ``shard_map`` unless a version at or above it is stored (StaleEpoch)."""
        ...

    def put_directive(self, token: str, issued: IssuedDirective) -> Awaitable[None]:
        """Record a directive the PC sent, or replace its record (forgotten after ``until_unix_ms``)."""
        ...

    def begin_reshard(self, token: str, reshard: StoredReshard) -> Awaitable[None]:
        """Keep ``reshard`` (undecided) as its map's reshard in flight. PreconditionFailed while
        an undecided one of the map is stored (a decided one is replaced: it was sent); StaleEpoch
        unless ``reshard.old.version`` is the stored version of the map."""
        ...

    def decide_reshard(self, token: str, reshard: StoredReshard, decision: str) -> Awaitable[str]:
        """Decide the stored reshard to ``reshard.new`` once: ``COMMIT`` also stores the new map
        (as :meth:`put_shard_map`), in the same step. Answers the decision that stands (an earlier
        one, if any). NotFound unless that reshard is stored."""
        ...

    def end_reshard(self, token: str, reshard: StoredReshard) -> Awaitable[None]:
        """Forget the stored reshard to ``reshard.new`` (every member was sent the decision);
        nothing if another (or none) is stored."""
        ...

    def close(self) -> Awaitable[None]:
        ...
