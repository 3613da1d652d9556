"""The PC's state in Redis (``[pc] store = "redis://HOST:PORT/DB"``; Valkey works too): several
PC processes share it, one active at a time (``pc/leader.py``), and it outlives them.

Keys, under ``{{key_prefix}pc}:`` (``{kvsp:pc}:`` by default: one hash tag, so on a Redis
Cluster every key of the PC is in one slot and each script, which checks the leader token
beside what it writes, runs there; docs/deploy.md "Redis Cluster"):

===================  ============  ====================================================
``leader``           string        the leader token, with the lease as its PX expiry
``epochs``           hash          instance URL -> highest epoch (§6.3)
``instances``        hash          instance URL -> :class:`StoredInstance` JSON
``session-ids``      set           the ids of the stored sessions
``s:{id}``           hash          ``epoch``, ``doc`` (:class:`StoredSession` JSON),
                                   ``cp`` (the kept checkpoint, §6.8), ``offset`` (its output_offset)
``map-versions``     hash          map id -> version (§6.9)
``maps``             hash          map id -> Shard Map JSON
``directives``       hash + zset   ``directives``: id -> :class:`IssuedDirective` JSON;
``directive-until``                ``directive-until``: id scored by when it may be forgotten
``reshard-to``       hash          map id -> the version its reshard in flight goes to (§6.9)
``reshards``         hash          map id -> :class:`StoredReshard` JSON (without decision)
``reshard-decided``  hash          map id -> ``commit`` / ``abort``, once decided
===================  ============  ====================================================

Each write is one Lua script (``store/scripts.py``) that checks the leader token and the rule
it applies in the same atomic step, so a write costs one round trip; it is acknowledged once
``store_wait_replicas`` replicas have it (``common/store_scripts.py``). Every call is bounded by
``store_timeout_ms`` (``common/store.py``) and raises ``StoreUnavailable`` past it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from ....kvsp.errors import RecordError
from ....kvsp.records import SessionCheckpoint, ShardMap
from ...common.errors import NotFound, NotLeader, PreconditionFailed, StaleEpoch
from ...common.store import StoreClient, StoreSpec, open_redis, store_call
from ...common.store_scripts import ScriptCall, run_scripts
from . import scripts
from .records import COMMIT, IssuedDirective, PcSnapshot, StoredInstance, StoredReshard, StoredSession, dumps

__all__ = ["RedisPcStore"]

LOAD_CHUNK = 512  # sessions read per pipeline while loading


def _spec(store: RedisPcStore) -> StoreSpec:
    return store.spec


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisPcStore:
    """:class:`~.base.PcStore` over Redis (module notes)."""

    def __init__(self, spec: StoreSpec, client: StoreClient | None = None) -> None:
        self.spec = spec
        self.redis: StoreClient = client if client is not None else open_redis(spec)
        p = f"{{{spec.key_prefix}pc}}:"
        self.k_leader, self.k_epochs, self.k_instances = p + "leader", p + "epochs", p + "instances"
        self.k_ids, self.k_session = p + "session-ids", p + "s:"
        self.k_versions, self.k_maps = p + "map-versions", p + "maps"
        self.k_directives, self.k_until = p + "directives", p + "directive-until"
        self.k_reshard_to, self.k_reshards, self.k_decided = p + "reshard-to", p + "reshards", p + "reshard-decided"

    async def _script(self, script: str, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        """One write script, acknowledged once replicated (``common.store_scripts``)."""
        return (await run_scripts(self.redis, self.spec, [ScriptCall(script, keys, args)]))[0]

    def _key(self, session: uuid.UUID) -> str:
        return f"{self.k_session}{session}"

    # -- the leader lock ------------------------------------------------------------------------

    @store_call(_spec)
    async def acquire(self, token: str, lease_ms: int | None) -> bool:
        if lease_ms is None:
            raise ValueError("a Redis leader lock is a lease: lease_ms is required")
        return bool(await self._script(scripts.ACQUIRE, [self.k_leader], [token, lease_ms]))

    @store_call(_spec)
    async def renew(self, token: str, lease_ms: int) -> bool:
        return bool(await self._script(scripts.RENEW, [self.k_leader], [token, lease_ms]))

    @store_call(_spec)
    async def release(self, token: str) -> None:
        await self._script(scripts.RELEASE, [self.k_leader], [token])

    @store_call(_spec)
    async def holder(self) -> str | None:
        value = await self.redis.get(self.k_leader)
        return None if value is None else _text(value)

    # -- state ----------------------------------------------------------------------------------

    @staticmethod
    def _outcome(answer: Sequence[object], what: str) -> tuple[str, str]:
        status, value = _text(answer[0]), _text(answer[1])
        if status == "not-leader":
            raise NotLeader("this PC no longer holds the leader lock")
        if status == "missing":
            raise NotFound(f"the PC has no {what}")
        return status, value

    @store_call(_spec)
    async def load(self) -> PcSnapshot:
        # One read script (atomic; on a cluster one command, which follows a failover).
        ids, *flat = await self.redis.eval(
            scripts.LOAD, 7, self.k_ids, self.k_epochs, self.k_instances, self.k_maps, self.k_directives,
            self.k_reshards, self.k_decided)
        epochs, instances, maps, directives, reshards, decided = (
            {_text(k): v for k, v in zip(f[::2], f[1::2])} for f in flat)
        out = PcSnapshot(
            epochs={k: int(v) for k, v in epochs.items()},
            instances={k: StoredInstance.from_doc(v) for k, v in instances.items()},
            shard_maps={k: ShardMap.from_json(json.loads(v)) for k, v in maps.items()},
            reshards={k: StoredReshard.from_doc(v, _text(decided[k]) if k in decided else None) for k, v in reshards.items()},
        )
        now = time.time() * 1000
        for v in directives.values():
            issued = IssuedDirective.from_doc(v)
            if issued.until_unix_ms > now:
                out.directives[issued.directive.directive] = issued
        sessions = sorted(uuid.UUID(_text(i)) for i in ids)
        for at in range(0, len(sessions), LOAD_CHUNK):
            chunk = sessions[at:at + LOAD_CHUNK]
            async with self.redis.pipeline(transaction=False) as pipe:
                for sid in chunk:
                    pipe.hgetall(self._key(sid))
                rows = await pipe.execute()
            for sid, row in zip(chunk, rows):
                if not row:
                    continue  # deleted between the two reads
                fields = {_text(k): v for k, v in row.items()}
                out.sessions[sid] = StoredSession.from_doc(fields["doc"], int(fields["epoch"]))
                out.checkpoints[sid] = SessionCheckpoint.from_json(json.loads(fields["cp"]))
        return out

    @store_call(_spec)
    async def put_instance(self, token: str, entry: StoredInstance) -> None:
        answer = await self._script(scripts.PUT_INSTANCE, [self.k_leader, self.k_epochs, self.k_instances],
                                    [token, entry.instance, entry.epoch, entry.to_doc()])
        status, value = self._outcome(answer, f"instance {entry.instance}")
        if status == "stale":
            raise StaleEpoch(f"epoch {entry.epoch} of {entry.instance} is lower than {value}, already seen")

    @store_call(_spec)
    async def create_session(self, token: str, session: StoredSession, checkpoint: SessionCheckpoint) -> bool:
        answer = await self._script(
            scripts.CREATE_SESSION, [self.k_leader, self._key(session.session), self.k_ids],
            [token, str(session.session), session.epoch, session.to_doc(), dumps(checkpoint.to_json()),
             checkpoint.output_offset])
        status, _ = self._outcome(answer, f"session {session.session}")
        return status == "ok"

    @store_call(_spec)
    async def get_session(self, session: uuid.UUID) -> tuple[StoredSession, SessionCheckpoint] | None:
        row = await self.redis.hgetall(self._key(session))  # one hash: its fields are read together
        if not row:
            return None
        fields = {_text(k): v for k, v in row.items()}
        return (StoredSession.from_doc(fields["doc"], int(fields["epoch"])),
                SessionCheckpoint.from_json(json.loads(fields["cp"])))

    @store_call(_spec)
    async def save_session(self, token: str, session: StoredSession, *, expected_epoch: int) -> None:
        answer = await self._script(scripts.SAVE_SESSION, [self.k_leader, self._key(session.session)],
                                    [token, expected_epoch, session.epoch, session.to_doc()])
        status, value = self._outcome(answer, f"session {session.session}")
        if status == "stale":
            raise StaleEpoch(f"session {session.session} is at epoch {value}, not {expected_epoch}")

    @store_call(_spec)
    async def put_checkpoint(self, token: str, checkpoint: SessionCheckpoint) -> int:
        answer = await self._script(scripts.PUT_CHECKPOINT, [self.k_leader, self._key(checkpoint.session)],
                                    [token, checkpoint.epoch, checkpoint.output_offset,
                                     dumps(checkpoint.to_json())])
        status, value = self._outcome(answer, f"session {checkpoint.session}")
        if status == "stale":
            raise StaleEpoch(f"checkpoint epoch {checkpoint.epoch} is lower than the session's epoch {value}")
        if status == "ahead":
            raise RecordError("epoch", f"the PC assigned epoch {value} to this session, not {checkpoint.epoch}")
        return int(value)

    @store_call(_spec)
    async def delete_session(self, token: str, session: uuid.UUID, epoch: int) -> None:
        answer = await self._script(scripts.DELETE_SESSION, [self.k_leader, self._key(session), self.k_ids],
                                    [token, str(session), epoch])
        status, value = self._outcome(answer, f"session {session}")
        if status == "stale":
            raise StaleEpoch(f"epoch {epoch} is not the session's epoch {value}")

    @store_call(_spec)
    async def get_shard_map(self, map_id: str) -> tuple[ShardMap | None, StoredReshard | None]:
        doc, reshard, decided = await self.redis.eval(scripts.LOAD_MAP, 3, self.k_maps, self.k_reshards, self.k_decided,
                                                      map_id)
        return (ShardMap.from_json(json.loads(doc)) if doc else None,
                StoredReshard.from_doc(reshard, _text(decided) if decided else None) if reshard else None)

    @store_call(_spec)
    async def put_shard_map(self, token: str, shard_map: ShardMap) -> None:
        answer = await self._script(scripts.PUT_SHARD_MAP, [self.k_leader, self.k_versions, self.k_maps],
                                    [token, shard_map.map, shard_map.version, dumps(shard_map.to_json())])
        status, value = self._outcome(answer, f"shard map {shard_map.map}")
        if status == "stale":
            raise StaleEpoch(f"map {shard_map.map!r} is at version {value}; got {shard_map.version}")

    @store_call(_spec)
    async def put_directive(self, token: str, issued: IssuedDirective) -> None:
        answer = await self._script(
            scripts.PUT_DIRECTIVE, [self.k_leader, self.k_directives, self.k_until],
            [token, str(issued.directive.directive), issued.to_doc(), issued.until_unix_ms, int(time.time() * 1000)])
        self._outcome(answer, "directive")

    @store_call(_spec)
    async def begin_reshard(self, token: str, reshard: StoredReshard) -> None:
        answer = await self._script(
            scripts.BEGIN_RESHARD, [self.k_leader, self.k_reshard_to, self.k_reshards, self.k_decided, self.k_versions],
            [token, reshard.map, reshard.old.version, reshard.new.version, reshard.to_doc()])
        status, value = self._outcome(answer, f"shard map {reshard.map}")
        if status == "exists":
            raise PreconditionFailed(f"a reshard of map {reshard.map!r} to version {value} is in progress")
        if status == "stale":
            raise StaleEpoch(f"map {reshard.map!r} is at version {value}, not {reshard.old.version}")

    @store_call(_spec)
    async def decide_reshard(self, token: str, reshard: StoredReshard, decision: str) -> str:
        answer = await self._script(
            scripts.DECIDE_RESHARD, [self.k_leader, self.k_reshard_to, self.k_decided, self.k_versions, self.k_maps],
            [token, reshard.map, reshard.new.version, decision, dumps(reshard.new.to_json()) if decision == COMMIT else ""])
        status, value = self._outcome(answer, f"reshard of map {reshard.map!r} to version {reshard.new.version}")
        if status == "stale":
            raise StaleEpoch(f"map {reshard.map!r} is at version {value}; got {reshard.new.version}")
        return value

    @store_call(_spec)
    async def end_reshard(self, token: str, reshard: StoredReshard) -> None:
        answer = await self._script(scripts.END_RESHARD, [self.k_leader, self.k_reshard_to, self.k_reshards, self.k_decided],
                                    [token, reshard.map, reshard.new.version])
        self._outcome(answer, f"reshard of map {reshard.map!r}")

    async def close(self) -> None:
        await self.redis.aclose()
