"""The embedded PC store (``[pc] store = "memory"``, the default): state lives and dies with
the process. The same rules as the Redis store (``store/base.py``), each applied in one step
with no await inside, so that concurrent tasks of this process cannot interleave within one."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import replace

from ....kvsp.errors import RecordError
from ....kvsp.records import SessionCheckpoint, ShardMap
from ...common.clock import Clock, MonotonicClock
from ...common.errors import NotFound, NotLeader, PreconditionFailed, StaleEpoch
from .records import COMMIT, IssuedDirective, PcSnapshot, StoredInstance, StoredReshard, StoredSession

__all__ = ["MemoryPcStore"]


class MemoryPcStore:
    """:class:`~.base.PcStore` in this process's memory; the lock's lease runs on ``clock``."""

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        self._leader: str | None = None
        self._leader_until: float = 0.0
        self._state = PcSnapshot()

    # -- the leader lock ------------------------------------------------------------------------

    def _current(self) -> str | None:
        if self._leader is not None and self._leader_until <= self._clock.now_ms():
            self._leader = None
        return self._leader

    def _until(self, lease_ms: int | None) -> float:
        return math.inf if lease_ms is None else self._clock.now_ms() + lease_ms

    async def acquire(self, token: str, lease_ms: int | None) -> bool:
        if self._current() not in (None, token):
            return False
        self._leader, self._leader_until = token, self._until(lease_ms)
        return True

    async def renew(self, token: str, lease_ms: int) -> bool:
        if self._current() != token:
            return False
        self._leader_until = self._until(lease_ms)
        return True

    async def release(self, token: str) -> None:
        if self._current() == token:
            self._leader = None

    async def holder(self) -> str | None:
        return self._current()

    def _fence(self, token: str) -> None:
        if self._current() != token:
            raise NotLeader("this PC no longer holds the leader lock")

    # -- state ----------------------------------------------------------------------------------

    async def load(self) -> PcSnapshot:
        s = self._state
        return PcSnapshot(dict(s.instances), dict(s.epochs), dict(s.sessions), dict(s.checkpoints),
                          dict(s.shard_maps), self._live_directives(), dict(s.reshards))

    async def put_instance(self, token: str, entry: StoredInstance) -> None:
        self._fence(token)
        highest = self._state.epochs.get(entry.instance)
        if highest is not None and entry.epoch < highest:
            raise StaleEpoch(f"epoch {entry.epoch} of {entry.instance} is lower than {highest}, already seen")
        self._state.epochs[entry.instance] = entry.epoch
        self._state.instances[entry.instance] = entry

    async def create_session(self, token: str, session: StoredSession, checkpoint: SessionCheckpoint) -> bool:
        self._fence(token)
        if session.session in self._state.sessions:
            return False
        self._state.sessions[session.session] = session
        self._state.checkpoints[session.session] = checkpoint
        return True

    def _stored(self, session: uuid.UUID) -> StoredSession:
        stored = self._state.sessions.get(session)
        if stored is None:
            raise NotFound(f"the PC has no session {session}")
        return stored

    async def get_session(self, session: uuid.UUID) -> tuple[StoredSession, SessionCheckpoint] | None:
        stored = self._state.sessions.get(session)
        return None if stored is None else (stored, self._state.checkpoints[session])

    async def save_session(self, token: str, session: StoredSession, *, expected_epoch: int) -> None:
        self._fence(token)
        current = self._stored(session.session).epoch
        if current != expected_epoch or session.epoch < current:
            raise StaleEpoch(f"session {session.session} is at epoch {current}, not {expected_epoch}")
        self._state.sessions[session.session] = session

    async def put_checkpoint(self, token: str, checkpoint: SessionCheckpoint) -> int:
        self._fence(token)
        current = self._stored(checkpoint.session).epoch
        if checkpoint.epoch < current:
            raise StaleEpoch(f"checkpoint epoch {checkpoint.epoch} is lower than the session's epoch {current}")
        if checkpoint.epoch > current:
            raise RecordError("epoch", f"the PC assigned epoch {current} to this session, not {checkpoint.epoch}")
        kept = self._state.checkpoints[checkpoint.session]
        if checkpoint.output_offset >= kept.output_offset:
            self._state.checkpoints[checkpoint.session] = kept = checkpoint
        return kept.output_offset

    async def delete_session(self, token: str, session: uuid.UUID, epoch: int) -> None:
        self._fence(token)
        current = self._stored(session).epoch
        if current != epoch:
            raise StaleEpoch(f"epoch {epoch} is not the session's epoch {current}")
        del self._state.sessions[session]
        del self._state.checkpoints[session]

    async def get_shard_map(self, map_id: str) -> tuple[ShardMap | None, StoredReshard | None]:
        return self._state.shard_maps.get(map_id), self._state.reshards.get(map_id)

    async def put_shard_map(self, token: str, shard_map: ShardMap) -> None:
        self._fence(token)
        old = self._state.shard_maps.get(shard_map.map)
        if old is not None and shard_map.version <= old.version:
            raise StaleEpoch(f"map {shard_map.map!r} is at version {old.version}; got {shard_map.version}")
        self._state.shard_maps[shard_map.map] = shard_map

    async def put_directive(self, token: str, issued: IssuedDirective) -> None:
        self._fence(token)
        self._state.directives = self._live_directives()
        self._state.directives[issued.directive.directive] = issued

    async def begin_reshard(self, token: str, reshard: StoredReshard) -> None:
        self._fence(token)
        held = self._state.reshards.get(reshard.map)
        if held is not None and held.decision is None:
            raise PreconditionFailed(f"a reshard of map {reshard.map!r} to version {held.new.version} is in progress")
        stored = self._state.shard_maps.get(reshard.map)
        if stored is None or stored.version != reshard.old.version:
            raise StaleEpoch(f"map {reshard.map!r} is at version {stored.version if stored else None}, "
                             f"not {reshard.old.version}")
        self._state.reshards[reshard.map] = replace(reshard, decision=None)

    async def decide_reshard(self, token: str, reshard: StoredReshard, decision: str) -> str:
        self._fence(token)
        held = self._state.reshards.get(reshard.map)
        if held is None or held.new.version != reshard.new.version:
            raise NotFound(f"no reshard of map {reshard.map!r} to version {reshard.new.version} is stored")
        if held.decision is not None:
            return held.decision
        if decision == COMMIT:
            old = self._state.shard_maps.get(reshard.map)
            if old is not None and reshard.new.version <= old.version:
                raise StaleEpoch(f"map {reshard.map!r} is at version {old.version}; got {reshard.new.version}")
            self._state.shard_maps[reshard.map] = reshard.new
        self._state.reshards[reshard.map] = replace(held, decision=decision)
        return decision

    async def end_reshard(self, token: str, reshard: StoredReshard) -> None:
        self._fence(token)
        held = self._state.reshards.get(reshard.map)
        if held is not None and held.new.version == reshard.new.version:
            del self._state.reshards[reshard.map]

    def _live_directives(self) -> dict[uuid.UUID, IssuedDirective]:
        now = time.time() * 1000
        return {k: d for k, d in self._state.directives.items() if d.until_unix_ms > now}

    async def close(self) -> None:
        return None
