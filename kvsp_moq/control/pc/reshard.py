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

One reshard per map at a time: another version while one runs is refused (412); the same
v+1 again (a client retrying, e.g. after a PC takeover) waits for the one in flight and gets
its outcome. The PC's calls go through :class:`ReshardClient`
(``client.http.HttpInstanceClient.reshard``).

**A reshard survives its PC** (issue 30). Its steps are stored (``pc/store``,
:class:`~.pc.store.StoredReshard`) so that a PC taking over finishes it, each step idempotent:

1. *begin* — before any plan is sent: ``old``, ``new``, the plans' ``deadline_ms`` and when it
   passes (wall clock);
2. *decide* — once every member acknowledged (commit) or one did not (abort): one atomic
   store step, which for a commit also makes v+1 authoritative (§6.9 "authoritative until all
   instances have acknowledged": never before, and never lost after);
3. the decision is sent to every member; then *end* forgets the reshard.

A PC that becomes active (:meth:`ReshardCoordinator.load`) resumes every stored reshard in the
background (:meth:`ReshardCoordinator.resume`): an undecided one sends the same plans again
(recomputed from ``old``, ``new`` and ``deadline_ms``; a member given the same plan awaits the
work it started, so nothing is fetched twice, and one that finished answers at once) and waits
until the stored deadline, then decides; a decided one sends its decision again (a member that
has it already answers 200). Past the deadline, an undecided reshard is aborted. A deposed PC
cannot decide or end (fenced writes) and sends no decision after it learnt it was deposed.

The maps are the active PC's cache of its store: a map is stored (the store refuses a version
at or below the stored one, atomically) before it becomes authoritative here.

**A write not acknowledged** (``store_wait_replicas`` replicas did not confirm it: 503
``kvsp-unavailable``) may be stored all the same: an install, a *begin* (a retry would then
meet "a reshard in progress", 412, for good) or a *decide* (v+1 authoritative in the store,
the members never told). Such a map is **unsure**: before the next ``PUT`` of it, its stored
version and reshard are re-read (:meth:`PcStore.get_shard_map`), and a stored reshard is
resumed as a PC taking over resumes it, so the retried ``PUT`` gets its outcome.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Protocol

from ...kvsp.errors import RecordError
from ...kvsp.records import ReshardAbort, ReshardCommit, ReshardMessage, ReshardPlan, ShardMap
from ..common.auth import Principal, require_instance
from ..common.clock import MonotonicClock, Timer
from ..common.errors import InstanceUnreachable, NotFound, NotLeader, PreconditionFailed, StaleEpoch, StoreUnavailable
from ..common.session_records import CANCELLED, REFUSED, TIMED_OUT, MemberOutcome, ReshardAck, ReshardOutcome
from .leader import Leadership
from .reshard_plan import reshard_plans
from .store import ABORT, COMMIT, MemoryPcStore, PcSnapshot, StoredReshard

__all__ = ["ReshardClient", "ReshardCoordinator"]

log = logging.getLogger(__name__)


class ReshardClient(Protocol):
    """``POST {ii}reshard``: a plan answers its :class:`ReshardAck`; commit and abort answer
    ``None``. Any refusal or transport failure raises :class:`~.common.errors.InstanceUnreachable`."""

    async def reshard(self, instance: str, message: ReshardMessage) -> ReshardAck | None:
        ...


@dataclass
class _InFlight:
    """A reshard this PC drives: its task, which answers its outcome."""

    reshard: StoredReshard
    task: asyncio.Task[ReshardOutcome]
    resumed: bool  # taken over from another PC: nobody awaits its outcome


def _unix_ms() -> int:
    return int(time.time() * 1000)


class ReshardCoordinator:
    """Shard Maps by id, and the version steps between them (see the module notes)."""

    def __init__(self, *, client: ReshardClient | None, timer: Timer | None = None, deadline_ms: int = 5_000,
                 leader: Leadership | None = None) -> None:
        self.client = client
        self.leader = leader if leader is not None else Leadership(MemoryPcStore(), lease_ms=None)
        self.timer: Timer = timer if timer is not None else MonotonicClock()
        self.deadline_ms = deadline_ms
        self.maps: dict[str, ShardMap] = {}
        self._in_flight: dict[str, _InFlight] = {}
        #: Maps a write of which was not acknowledged (module notes): re-read before the next put.
        self._unsure: set[str] = set()

    def load(self, snapshot: PcSnapshot) -> None:
        """The stored maps become this PC's, and every stored reshard is resumed (module notes)."""
        self.maps = dict(snapshot.shard_maps)
        self._unsure = set()
        for reshard in snapshot.reshards.values():
            if self.client is None:
                log.warning("reshard of %r to version %d not resumed: this PC cannot reach instances",
                            reshard.map, reshard.new.version)
                continue
            self._start(reshard, resumed=True)

    def clear(self) -> None:
        """Deposed: forget the maps; the reshards this PC drives stop (the store keeps them for
        the PC that takes over)."""
        self.maps = {}
        self._unsure = set()
        self.stop()

    def stop(self) -> None:
        """Stop driving every reshard, without deciding (a PC shutting down or deposed)."""
        for flight in self._in_flight.values():
            flight.task.cancel()
        self._in_flight = {}

    async def close(self) -> None:
        tasks = [f.task for f in self._in_flight.values()]
        self.stop()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def abandon(self, bound_s: float) -> None:
        """A PC that nobody takes over from (the memory store) is stopping: stop every reshard
        and send its members the end, within ``bound_s``: the decision if one was taken, else
        ``abort`` (v stays; their staged ranges are discarded and they take a new plan)."""
        flights = list(self._in_flight.values())
        await self.close()
        if not flights or self.client is None:
            return
        stored = (await self.leader.store.load()).reshards
        sends = []
        for flight in flights:
            r = stored.get(flight.reshard.map, flight.reshard)
            message: ReshardMessage = (ReshardCommit(map=r.map, commit=r.new.version) if r.decision == COMMIT
                                       else ReshardAbort(map=r.map, abort=r.new.version))
            sends.append(self._broadcast(list(reshard_plans(r.old, r.new, r.deadline_ms)), message))
        try:
            await asyncio.wait_for(asyncio.gather(*sends), bound_s)
        except asyncio.TimeoutError:
            log.warning("members of %d reshard(s) were not all told its end before the PC stopped", len(flights))

    async def _keep(self, shard_map: ShardMap) -> None:
        try:
            await self.leader.write(lambda token: self.leader.store.put_shard_map(token, shard_map))
        except (StoreUnavailable, StaleEpoch):
            self._unsure.add(shard_map.map)
            raise
        self.maps[shard_map.map] = shard_map

    async def _reread(self, map_id: str) -> None:
        """The stored map and reshard in flight become this PC's again, after a write not
        acknowledged (module notes): a stored reshard is resumed as after a takeover."""
        stored_map, reshard = await self.leader.store.get_shard_map(map_id)
        self._unsure.discard(map_id)
        if stored_map is None:
            self.maps.pop(map_id, None)
        else:
            self.maps[map_id] = stored_map
        if reshard is not None and self.client is not None and map_id not in self._in_flight:
            self._start(reshard, resumed=True)

    def get(self, principal: Principal, map_id: str) -> ShardMap:
        shard_map = self.maps.get(map_id)
        if shard_map is None:
            raise NotFound(f"the PC has no shard map {map_id!r}")
        for shard in shard_map.shards:
            require_instance(principal, shard.instance)
        return shard_map

    async def put(self, principal: Principal, new: ShardMap, deadline_ms: int | None = None) -> ReshardOutcome:
        """Install ``new`` or reshard to it (see the module notes)."""
        if new.map in self._unsure and new.map not in self._in_flight:
            await self._reread(new.map)
        old = self.maps.get(new.map)
        for shard in new.shards + (old.shards if old else ()):
            require_instance(principal, shard.instance)
        flight = self._in_flight.get(new.map)
        if flight is not None and flight.reshard.new == new:
            return await self._outcome_of(flight)  # the same reshard asked again: its outcome
        if old is None:
            await self._keep(new)
            return ReshardOutcome(map=new.map, state="installed", version=new.version)
        if new.version <= old.version:
            if new == old:
                return ReshardOutcome(map=new.map, state="committed", version=new.version)
            raise StaleEpoch(f"map {new.map!r} is at version {old.version}; got {new.version}")
        if flight is not None:
            raise PreconditionFailed(f"a reshard of map {new.map!r} to version {flight.reshard.new.version} is in progress")
        deadline = deadline_ms or self.deadline_ms
        reshard_plans(old, new, deadline)  # refuses maps that are no version step (400)
        if self.client is None:
            raise NotFound("this PC has no client to reach instances")
        reshard = StoredReshard(old, new, deadline, _unix_ms() + deadline)
        flight = self._start(reshard, resumed=False)
        return await self._outcome_of(flight)

    def _start(self, reshard: StoredReshard, *, resumed: bool) -> _InFlight:
        task = asyncio.get_running_loop().create_task(self._drive(reshard, resumed=resumed))
        flight = _InFlight(reshard, task, resumed)
        self._in_flight[reshard.map] = flight
        task.add_done_callback(lambda t: self._finished(flight))
        return flight

    def _finished(self, flight: _InFlight) -> None:
        if self._in_flight.get(flight.reshard.map) is flight:
            del self._in_flight[flight.reshard.map]
        if not flight.task.cancelled() and isinstance(flight.task.exception(), (StoreUnavailable, StaleEpoch)):
            self._unsure.add(flight.reshard.map)  # its begin or decide may be stored all the same
        if not flight.task.cancelled() and flight.task.exception() is not None and flight.resumed:
            log.warning("reshard of %r to version %d stopped: %s", flight.reshard.map, flight.reshard.new.version,
                        flight.task.exception())

    @staticmethod
    async def _outcome_of(flight: _InFlight) -> ReshardOutcome:
        """The reshard's outcome; a reshard stopped undecided (this PC was deposed or is
        stopping) is ``NotLeader`` (503): the PC that takes over finishes it."""
        try:
            return await asyncio.shield(flight.task)
        except asyncio.CancelledError:
            if flight.task.cancelled():
                raise NotLeader("this PC stopped driving the reshard; the PC that takes over finishes it") from None
            raise

    async def _drive(self, reshard: StoredReshard, *, resumed: bool) -> ReshardOutcome:
        """Run ``reshard`` from its stored step to its end (module notes)."""
        store = self.leader.store
        plans = reshard_plans(reshard.old, reshard.new, reshard.deadline_ms)
        if not resumed:
            await self.leader.write(lambda token: store.begin_reshard(token, reshard))
        members: tuple[MemberOutcome, ...] = ()
        decision = reshard.decision
        if decision is None:
            wait_ms = reshard.deadline_ms if not resumed else reshard.until_unix_ms - _unix_ms()
            if wait_ms > 0:
                members = await self._send_plans(plans, wait_ms)
            else:  # taken over past the deadline: whatever the members did, v stays (§6.9)
                members = tuple(MemberOutcome(instance=i, result=TIMED_OUT, detail="no acknowledgement within deadline_ms")
                                for i in sorted(plans))
            wanted = COMMIT if all(m.result == "acknowledged" for m in members) else ABORT
            decision = await self.leader.write(lambda token: store.decide_reshard(token, reshard, wanted))
        elif resumed:
            log.info("resuming the reshard of %r to version %d: sending %s again", reshard.map, reshard.new.version, decision)
        if decision == COMMIT:
            self.maps[reshard.map] = reshard.new  # authoritative once stored (§6.9)
        self.leader.require()  # a PC that knows it was deposed sends nothing: its successor does
        message: ReshardMessage = (ReshardCommit(map=reshard.map, commit=reshard.new.version) if decision == COMMIT
                                   else ReshardAbort(map=reshard.map, abort=reshard.new.version))
        await self._broadcast(list(plans), message)
        try:
            await self.leader.write(lambda token: store.end_reshard(token, reshard))
        except (StoreUnavailable, NotLeader) as exc:  # decided and sent: the outcome stands
            log.warning("reshard of %r to version %d sent but not forgotten (a PC taking over sends its %s "
                        "again; a new reshard of the map replaces it): %s", reshard.map, reshard.new.version, decision, exc)
        if decision == COMMIT:
            return ReshardOutcome(map=reshard.map, state="committed", version=reshard.new.version, members=members)
        return ReshardOutcome(map=reshard.map, state="aborted", version=reshard.old.version, members=members)

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
