"""The PC's Shard Maps and the resharding protocol (kvsp-draft §6.9).

``PUT {pc}shard-maps/{map}`` with a Shard Map:

- a map the PC does not know is **installed** as is (its instances computed their ranges);
- version v+1 of a known map (authoritative version v) runs a reshard: the PC computes every
  member's plan (:func:`~.pc.reshard_plan.reshard_plans`: retain, fetch with ``from``, release),
  sends ``POST reshard`` to each instance in either version at once, and waits until all
  acknowledge (200), any refuses, or ``deadline_ms`` passes on its timer. All acknowledged:
  ``POST reshard {"map", "commit": v+1}`` to all members and v+1 becomes authoritative.
  Otherwise: ``{"map", "abort": v+1}`` to all members, and v stays authoritative ("Version v
  remains authoritative until all instances have acknowledged"). The answer
  (:class:`~.common.session_records.ReshardOutcome`) says which, and what each member did;
- any other version is refused: lower or equal with ``kvsp-stale-epoch`` (409), higher with 400.

One reshard per map at a time (412 while one runs). The PC's calls go through
:class:`ReshardClient` (``client.http.HttpInstanceClient.reshard``).

The maps are the active PC's cache of its store (``pc/store``): a map is stored (the store
refuses a version at or below the stored one, atomically) before it becomes authoritative here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from ...kvsp.errors import RecordError
from ...kvsp.records import ReshardAbort, ReshardCommit, ReshardMessage, ReshardPlan, ShardMap
from ..common.auth import Principal, require_instance
from ..common.clock import MonotonicClock, Timer
from ..common.errors import InstanceUnreachable, NotFound, PreconditionFailed, StaleEpoch
from ..common.session_records import CANCELLED, REFUSED, TIMED_OUT, MemberOutcome, ReshardAck, ReshardOutcome
from .leader import Leadership
from .reshard_plan import reshard_plans
from .store import MemoryPcStore, PcSnapshot

__all__ = ["ReshardClient", "ReshardCoordinator"]

log = logging.getLogger(__name__)


class ReshardClient(Protocol):
    """``POST {ii}reshard``: a plan answers its :class:`ReshardAck`; commit and abort answer
    ``None``. Any refusal or transport failure raises :class:`~.common.errors.InstanceUnreachable`."""

    async def reshard(self, instance: str, message: ReshardMessage) -> ReshardAck | None:
        ...


class ReshardCoordinator:
    """Shard Maps by id, and the version steps between them (see the module notes)."""

    def __init__(self, *, client: ReshardClient | None, timer: Timer | None = None, deadline_ms: int = 5_000,
                 leader: Leadership | None = None) -> None:
        self.client = client
        self.leader = leader if leader is not None else Leadership(MemoryPcStore(), lease_ms=None)
        self.timer: Timer = timer if timer is not None else MonotonicClock()
        self.deadline_ms = deadline_ms
        self.maps: dict[str, ShardMap] = {}
        self._busy: set[str] = set()

    def load(self, snapshot: PcSnapshot) -> None:
        self.maps = dict(snapshot.shard_maps)

    def clear(self) -> None:
        self.maps = {}

    async def _keep(self, shard_map: ShardMap) -> None:
        await self.leader.write(lambda token: self.leader.store.put_shard_map(token, shard_map))
        self.maps[shard_map.map] = shard_map

    def get(self, principal: Principal, map_id: str) -> ShardMap:
        shard_map = self.maps.get(map_id)
        if shard_map is None:
            raise NotFound(f"the PC has no shard map {map_id!r}")
        for shard in shard_map.shards:
            require_instance(principal, shard.instance)
        return shard_map

    async def put(self, principal: Principal, new: ShardMap, deadline_ms: int | None = None) -> ReshardOutcome:
        """Install ``new`` or reshard to it (see the module notes)."""
        old = self.maps.get(new.map)
        for shard in new.shards + (old.shards if old else ()):
            require_instance(principal, shard.instance)
        if old is None:
            await self._keep(new)
            return ReshardOutcome(map=new.map, state="installed", version=new.version)
        if new.version <= old.version:
            if new == old:
                return ReshardOutcome(map=new.map, state="committed", version=new.version)
            raise StaleEpoch(f"map {new.map!r} is at version {old.version}; got {new.version}")
        if new.map in self._busy:
            raise PreconditionFailed(f"a reshard of map {new.map!r} is in progress")
        plans = reshard_plans(old, new, deadline_ms or self.deadline_ms)
        if self.client is None:
            raise NotFound("this PC has no client to reach instances")
        self._busy.add(new.map)
        try:
            members = await self._send_plans(plans, deadline_ms or self.deadline_ms)
            if all(m.result == "acknowledged" for m in members):
                await self._keep(new)  # authoritative once stored (§6.9)
                await self._broadcast(list(plans), ReshardCommit(map=new.map, commit=new.version))
                return ReshardOutcome(map=new.map, state="committed", version=new.version, members=members)
            await self._broadcast(list(plans), ReshardAbort(map=new.map, abort=new.version))
            return ReshardOutcome(map=new.map, state="aborted", version=old.version, members=members)
        finally:
            self._busy.discard(new.map)

    async def _send_plans(self, plans: dict[str, ReshardPlan], deadline_ms: int) -> tuple[MemberOutcome, ...]:
        """Send every plan; stop at the first refusal or at the deadline (§6.9)."""
        assert self.client is not None
        client = self.client
        tasks = {asyncio.create_task(client.reshard(instance, plan)): instance for instance, plan in plans.items()}
        deadline = asyncio.create_task(self.timer.sleep_ms(deadline_ms))
        outcomes: dict[str, MemberOutcome] = {}
        waiting = set(tasks)
        expired = False
        try:
            while waiting:
                done, _ = await asyncio.wait(waiting | {deadline}, return_when=asyncio.FIRST_COMPLETED)
                for task in done - {deadline}:
                    waiting.discard(task)
                    outcomes[tasks[task]] = self._outcome(tasks[task], task)
                expired = deadline in done
                if expired or any(o.result != "acknowledged" for o in outcomes.values()):
                    break
        finally:
            deadline.cancel()
            for task in waiting:
                task.cancel()
            await asyncio.gather(deadline, *waiting, return_exceptions=True)
        for task in waiting:
            if expired:
                outcomes[tasks[task]] = MemberOutcome(instance=tasks[task], result=TIMED_OUT,
                                                      detail="no acknowledgement within deadline_ms")
            else:
                outcomes[tasks[task]] = MemberOutcome(instance=tasks[task], result=CANCELLED,
                                                      detail="another member refused its plan")
        return tuple(outcomes[i] for i in sorted(outcomes))

    @staticmethod
    def _outcome(instance: str, task: asyncio.Task[ReshardAck | None]) -> MemberOutcome:
        exc = task.exception()
        if exc is None:
            ack = task.result()
            return MemberOutcome(instance=instance, result="acknowledged", fetched_octets=ack.fetched_octets if ack else 0)
        if not isinstance(exc, (InstanceUnreachable, RecordError)):
            log.error("reshard plan to %s failed", instance, exc_info=exc)
        return MemberOutcome(instance=instance, result=REFUSED, detail=str(exc)[:4096])

    async def _broadcast(self, instances: list[str], message: ReshardMessage) -> None:
        assert self.client is not None
        client = self.client
        results = await asyncio.gather(*(client.reshard(i, message) for i in instances), return_exceptions=True)
        for instance, result in zip(instances, results):
            if isinstance(result, BaseException):
                log.warning("reshard %s to %s failed: %s", type(message).__name__, instance, result)
