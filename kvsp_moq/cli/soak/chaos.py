"""The chaos schedule of ``kvsp soak``: seeded faults, one at a time, on real processes.

Every ``every_s`` seconds (± a quarter, seeded; shorter in the first round when the run would
otherwise end before every kind came) the next fault of a seeded shuffle of :data:`FAULTS` (a
new shuffle once all were used, so each kind comes round) is done to a role; a killed role is
restarted in the background, and a role that is down is not chosen again until it is back:

* ``kill-instance``: SIGKILL an instance (never the last live one), restart it on its port
  after ``down_s`` (tried :data:`RESTART_ATTEMPTS` times, the failures reported); the PC moves its sessions (§6.8), readers of its blocks fall over;
* ``kill-relay``: SIGKILL relay A or relay B, restart it on its port: instances and the chained
  relay reconnect;
* ``kill-holder``: SIGKILL the holder, restart it (its disk tier survives, its host tier not);
* ``stall-holder``: SIGSTOP the holder for ``stall_s``, then SIGCONT: a peer that holds its
  sockets and answers nothing, which every wait on it must bound;
* ``kill-primary`` (``--store cluster`` only: :data:`CLUSTER_FAULTS`): SIGKILL a random primary
  of the roles' Redis Cluster, wait (bounded) until its replica took over (counted in
  ``primary_failovers``), and start the node again in the background after ``down_s``: it
  rejoins as a replica.

The lossy link (``.lossy``) drops packets to and from relay B the whole time. The
pauses between faults and a fault's down time are the schedule itself, not a wait for a
condition; restarts wait for the role to announce its URL (bounded by ``roles.START_TIMEOUT_S``).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from ...bench.redis_cluster import RedisClusterProcess
from .roles import Role, SoakCluster

__all__ = ["CLUSTER_FAULTS", "FAULTS", "Chaos"]

FAULTS = ("kill-instance", "kill-relay", "kill-holder", "stall-holder")
#: The faults of a soak whose roles keep their state on a Redis Cluster.
CLUSTER_FAULTS = (*FAULTS, "kill-primary")
#: Starts tried after a kill (each ``down_s`` × 2^attempt after the last): a role whose start
#: fails (its relay is down at that moment, say) is tried again, and reported if it never came back.
RESTART_ATTEMPTS = 4


@dataclass
class Chaos:
    cluster: SoakCluster
    seed: int
    every_s: float = 8.0
    down_s: float = 1.0
    stall_s: float = 4.0
    progress: Any = print
    events: list[dict[str, Any]] = field(default_factory=list)
    #: Roles being killed or restarted now (the workload sends no plain request to them).
    down: set[str] = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)
    #: The roles' Redis Cluster (``--store cluster``): its primaries are killed too.
    redis_cluster: RedisClusterProcess | None = None
    #: Primaries killed whose replica took over.
    primary_failovers: int = 0
    _restarts: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def faults(self) -> tuple[str, ...]:
        return CLUSTER_FAULTS if self.redis_cluster is not None else FAULTS

    def live_instances(self) -> list[str]:
        return [self.cluster.url(r) for r in self.cluster.instances if r.alive and r.name not in self.down]

    async def run(self, until: float) -> None:
        """Faults until ``until``; the pause before each is shortened when needed so that every
        kind of the first round fits in the run. Restarts go on in the background (a slow one does
        not hold the schedule up); they are awaited before this returns."""
        rng = random.Random(self.seed)
        order: list[str] = []
        first_round = True
        try:
            while True:
                if not order:
                    if self.events:
                        first_round = False
                    order = list(self.faults)
                    rng.shuffle(order)
                pause = self.every_s * rng.uniform(0.75, 1.25)
                left = until - time.monotonic()
                if first_round:
                    pause = min(pause, left / (len(order) + 1))
                if pause >= left:
                    return
                await asyncio.sleep(pause)
                await self.fault(order.pop(), rng)
        finally:
            if self._restarts:
                await asyncio.gather(*self._restarts)

    async def fault(self, kind: str, rng: random.Random) -> None:
        c = self.cluster
        t0 = time.monotonic()
        if kind == "kill-instance":
            candidates = [r for r in c.instances if r.alive and r.name not in self.down]
            if len(candidates) < 2:
                self._log(kind, c.instances[0], t0, "skipped: fewer than 2 instances up")
                return
            self._kill_restart(rng.choice(candidates), kind, t0)
        elif kind == "kill-relay":
            self._kill_restart(rng.choice([r for r in (c.relay_a, c.relay_b) if r.name not in self.down]
                                          or [c.relay_a]), kind, t0)
        elif kind == "kill-holder":
            self._kill_restart(c.holder, kind, t0)
        elif kind == "stall-holder":
            if c.holder.name in self.down:
                self._log(kind, c.holder, t0, "skipped: the holder is restarting")
                return
            c.holder.pause()
            self._log(kind, c.holder, t0, f"SIGSTOP for {self.stall_s:g} s")
            try:
                await asyncio.sleep(self.stall_s)
            finally:
                c.holder.resume()
        elif kind == "kill-primary":
            await self._kill_primary(rng, t0)
        else:  # pragma: no cover - FAULTS lists every kind
            raise ValueError(kind)

    async def _kill_primary(self, rng: random.Random, t0: float) -> None:
        """SIGKILL a primary and wait (bounded: ``redis_cluster.WAIT_S``) for the failover; the
        node is started again in the background."""
        cluster = self.redis_cluster
        assert cluster is not None
        if any(not n.running for n in cluster.nodes):  # one fault at a time
            self._log("kill-primary", self.cluster.index, t0, "skipped: a node is still restarting")
            return
        port = rng.choice(cluster.primary_ports())
        victim = next(n for n in cluster.nodes if n.port == port)
        slot_key = next(f"{{{i}}}" for i in range(1 << 20) if cluster.primary_for(f"{{{i}}}").port == port)
        event = self._log("kill-primary", self.cluster.index, t0, f"SIGKILL redis {port}")
        await asyncio.to_thread(cluster.kill_primary, slot_key)
        self.primary_failovers += 1
        event["failover_s"] = round(time.monotonic() - t0, 3)

        async def restart() -> None:
            await asyncio.sleep(self.down_s)
            try:
                await asyncio.to_thread(cluster.restart, victim)
                event["back_after_s"] = round(time.monotonic() - t0, 3)
            except RuntimeError as exc:
                event["not_back"] = True
                self.progress(f"chaos: redis {port} did not come back: {exc}")

        self._restarts.append(asyncio.create_task(restart()))

    def _kill_restart(self, role: Role, kind: str, t0: float) -> None:
        if role.name in self.down:
            self._log(kind, role, t0, "skipped: already restarting")
            return
        self.down.add(role.name)
        role.kill()
        event = self._log(kind, role, t0, f"SIGKILL, restart after {self.down_s:g} s")

        async def restart() -> None:
            try:
                await role.wait_dead()
                for attempt in range(RESTART_ATTEMPTS):
                    await asyncio.sleep(self.down_s * 2 ** attempt)
                    try:
                        await role.start()
                    except RuntimeError as exc:  # e.g. its relay is down too: counted, tried again
                        event.setdefault("restart_failures", []).append(str(exc)[:300])
                        self.progress(f"chaos: restart of {role.name} failed (attempt {attempt + 1}): {str(exc)[:200]}")
                        continue
                    event["back_after_s"] = round(time.monotonic() - t0, 3)
                    return
                event["not_back"] = True
            finally:
                self.down.discard(role.name)

        self._restarts.append(asyncio.create_task(restart()))

    def _log(self, kind: str, role: Role, t0: float, what: str) -> dict[str, Any]:
        event: dict[str, Any] = {"t_s": round(t0 - self.started, 3), "fault": kind, "role": role.name, "what": what}
        self.events.append(event)
        self.progress(f"chaos t={t0 - self.started:6.1f} s: {kind} {role.name} ({what})")
        return event
