"""The chaos schedule of ``kvsp soak``: seeded faults, one at a time, on real processes.

Every ``every_s`` seconds (± a quarter, seeded) the next fault of a seeded shuffle of
:data:`FAULTS` (a new shuffle once all were used, so each kind comes round) is done to a role:

* ``kill-instance``: SIGKILL an instance (never the last live one), restart it on its port
  after ``down_s``; the PC moves its sessions (§6.8), readers of its blocks fall over;
* ``kill-relay``: SIGKILL relay A or relay B, restart it on its port: instances and the chained
  relay reconnect;
* ``kill-holder``: SIGKILL the holder, restart it (its disk tier survives, its host tier not);
* ``stall-holder``: SIGSTOP the holder for ``stall_s``, then SIGCONT: a peer that holds its
  sockets and answers nothing, which every wait on it must bound.

The lossy link (``.lossy``) drops packets between relay B and relay A the whole time. The
pauses between faults and a fault's down time are the schedule itself, not a wait for a
condition; restarts wait for the role to announce its URL (bounded by ``roles.START_TIMEOUT_S``).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from .roles import Role, SoakCluster

__all__ = ["FAULTS", "Chaos"]

FAULTS = ("kill-instance", "kill-relay", "kill-holder", "stall-holder")


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

    def live_instances(self) -> list[str]:
        return [self.cluster.url(r) for r in self.cluster.instances if r.alive and r.name not in self.down]

    async def run(self, until: float) -> None:
        rng = random.Random(self.seed)
        order: list[str] = []
        while True:
            pause = self.every_s * rng.uniform(0.75, 1.25)
            if time.monotonic() + pause >= until:
                return
            await asyncio.sleep(pause)
            if not order:
                order = list(FAULTS)
                rng.shuffle(order)
            await self.fault(order.pop(), rng)

    async def fault(self, kind: str, rng: random.Random) -> None:
        c = self.cluster
        t0 = time.monotonic()
        if kind == "kill-instance":
            candidates = [r for r in c.instances if r.alive]
            if len(candidates) < 2:
                return
            await self._kill_restart(rng.choice(candidates), kind, t0)
        elif kind == "kill-relay":
            await self._kill_restart(rng.choice([c.relay_a, c.relay_b]), kind, t0)
        elif kind == "kill-holder":
            await self._kill_restart(c.holder, kind, t0)
        elif kind == "stall-holder":
            c.holder.pause()
            self._log(kind, c.holder, t0, f"SIGSTOP for {self.stall_s:g} s")
            try:
                await asyncio.sleep(self.stall_s)
            finally:
                c.holder.resume()
        else:  # pragma: no cover - FAULTS lists every kind
            raise ValueError(kind)

    async def _kill_restart(self, role: Role, kind: str, t0: float) -> None:
        self.down.add(role.name)
        try:
            role.kill()
            await role.wait_dead()
            self._log(kind, role, t0, f"SIGKILL, restart after {self.down_s:g} s")
            await asyncio.sleep(self.down_s)
            await role.start()
            self.events[-1]["back_after_s"] = round(time.monotonic() - t0, 3)
        finally:
            self.down.discard(role.name)

    def _log(self, kind: str, role: Role, t0: float, what: str) -> None:
        self.events.append({"t_s": round(t0 - self.started, 3), "fault": kind, "role": role.name, "what": what})
        self.progress(f"chaos t={t0 - self.started:6.1f} s: {kind} {role.name} ({what})")
