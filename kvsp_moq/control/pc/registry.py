"""The PC's view of the instances (kvsp-draft §6.3): status records, TTLs, epochs, lifecycle.

- A record expires ``ttl_ms`` (capped) after it arrives; the instance is then **failed**
  (§6.3 "The PC considers an instance failed when its record expires"). Time is read from an
  injectable :class:`~.common.clock.Clock`.
- A record whose epoch is lower than the highest seen for its instance is discarded with
  :class:`~.common.errors.StaleEpoch` (§6.3 MUST); the highest epoch outlives expiry. A higher epoch
  is a restart: what the PC had assigned to the old incarnation is forgotten.
- Lifecycle (§6.3): the PC *assigns* draining, sleeping or active. An instance is **active**
  for placement only when its last record says active and the PC has not assigned draining
  or sleeping: an assignment takes effect at once, before the instance reports it, and an
  instance the PC put to sleep counts as active again only after the PC woke it ("A sleeping
  instance becomes active only on a state change from the PC") *and* it reported active.
- An instance the PC started itself (§6.4) is active from its start until its first record
  arrives or ``start_grace_ms`` passes, so the PC can send it a prefetch directive at once.

The registry is the active PC's cache of its store (``pc/store``, DESIGN.md §8): every change
is written there first, through the leader's fenced :class:`~.pc.leader.Leadership`, and the
store decides the epoch rule atomically (two PCs cannot both accept conflicting records).
A PC that becomes active loads the stored records (:meth:`InstanceRegistry.load`); since PCs
share no clock, each one gets a fresh TTL from that moment (an instance failed before the
takeover stays failed), and is failed if it does not report within it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...kvsp.records import InstanceStatusRecord
from ...kvsp.records.instance import ACTIVE, DRAINING, FAILED, SLEEPING
from ..common.clock import Clock
from ..common.errors import StaleEpoch
from .leader import Leadership
from .store import MemoryPcStore, PcSnapshot, StoredInstance


@dataclass
class InstanceEntry:
    record: InstanceStatusRecord
    expires_ms: int
    assigned: str | None = None  # the last state the PC set for this epoch


class InstanceRegistry:
    """Latest status, highest epoch and assigned state per instance URL."""

    def __init__(self, clock: Clock, *, max_ttl_ms: int = 60_000, start_grace_ms: int = 60_000,
                 leader: Leadership | None = None) -> None:
        self._clock = clock
        self.leader = leader if leader is not None else Leadership(MemoryPcStore(), lease_ms=None)
        self._max_ttl_ms = max_ttl_ms
        self._start_grace_ms = start_grace_ms
        self._entries: dict[str, InstanceEntry] = {}
        self._highest_epoch: dict[str, int] = {}
        self._starting: dict[str, int] = {}  # started by the PC, not yet reported: until when

    # -- reports (§6.3) -------------------------------------------------------------------------

    async def report(self, record: InstanceStatusRecord) -> InstanceStatusRecord:
        """Keep ``record`` (ttl_ms capped); :class:`StaleEpoch` for an epoch lower than one seen
        (here, or in the store: the store's answer is the rule)."""
        highest = self._highest_epoch.get(record.instance)
        if highest is not None and record.epoch < highest:
            raise StaleEpoch(f"epoch {record.epoch} of {record.instance} is lower than {highest}, already seen")
        if record.ttl_ms > self._max_ttl_ms:
            record = dataclasses.replace(record, ttl_ms=self._max_ttl_ms)
        entry = self._entries.get(record.instance)
        assigned = entry.assigned if entry is not None and highest == record.epoch else None
        stored = StoredInstance(record, assigned)
        await self.leader.write(lambda token: self.leader.store.put_instance(token, stored))
        if record.epoch < self._highest_epoch.get(record.instance, record.epoch):
            return record  # a higher epoch arrived meanwhile (kept in the store as well)
        self._highest_epoch[record.instance] = record.epoch
        self._entries[record.instance] = InstanceEntry(record, self._clock.now_ms() + record.ttl_ms, assigned)
        self._starting.pop(record.instance, None)
        return record

    def load(self, snapshot: PcSnapshot) -> None:
        """The stored records, each with a fresh TTL from now (module notes)."""
        self.clear()
        now = self._clock.now_ms()
        self._highest_epoch.update(snapshot.epochs)
        for instance, stored in snapshot.instances.items():
            expires = now if stored.failed else now + stored.record.ttl_ms
            self._entries[instance] = InstanceEntry(stored.record, expires, stored.assigned)

    def clear(self) -> None:
        """Forget the cache (this PC stopped being the active one)."""
        self._entries.clear()
        self._highest_epoch.clear()
        self._starting.clear()

    async def _store(self, entry: InstanceEntry, *, failed: bool = False) -> None:
        stored = StoredInstance(entry.record, entry.assigned, failed)
        await self.leader.write(lambda token: self.leader.store.put_instance(token, stored))

    def started(self, instance: str) -> None:
        """The PC started ``instance`` (§6.4): active until it reports or the grace passes."""
        self._starting[instance] = self._clock.now_ms() + self._start_grace_ms

    async def fail(self, instance: str) -> bool:
        """The instance was reported failed (§6.8): its record expires now, so it is failed
        until it reports again (also for a PC that takes over). Whether the PC knew it."""
        entry = self._entries.get(instance)
        self._starting.pop(instance, None)
        if entry is None:
            return False
        await self._store(entry, failed=True)
        entry.expires_ms = min(entry.expires_ms, self._clock.now_ms())
        return True

    def highest_epoch(self, instance: str) -> int | None:
        """The highest epoch seen for ``instance`` (§6.3), also after expiry."""
        return self._highest_epoch.get(instance)

    async def assign(self, instance: str, state: str) -> None:
        """The PC set the instance's state (an accepted sleep request, or ``PUT state``)."""
        entry = self._entries.get(instance)
        if entry is not None:
            await self._store(dataclasses.replace(entry, assigned=state), failed=entry.expires_ms <= self._clock.now_ms())
            entry.assigned = state

    # -- queries ----------------------------------------------------------------------------------

    def known(self, instance: str) -> bool:
        return instance in self._entries or instance in self._starting

    def record(self, instance: str) -> InstanceStatusRecord | None:
        """The unexpired record of ``instance``, or ``None``."""
        entry = self._entries.get(instance)
        if entry is None or entry.expires_ms <= self._clock.now_ms():
            return None
        return entry.record

    def entry(self, instance: str) -> InstanceEntry | None:
        return self._entries.get(instance)

    def state(self, instance: str) -> str | None:
        """The effective state (see the module notes); ``None`` for an unknown instance."""
        entry = self._entries.get(instance)
        if entry is None:
            until = self._starting.get(instance)
            return ACTIVE if until is not None and until > self._clock.now_ms() else None
        if entry.expires_ms <= self._clock.now_ms():
            return FAILED
        reported = entry.record.state
        if reported != ACTIVE:
            return reported
        if entry.assigned in (DRAINING, SLEEPING):
            return entry.assigned
        return ACTIVE

    def is_active(self, instance: str) -> bool:
        return self.state(instance) == ACTIVE

    def instances(self) -> list[str]:
        return sorted(set(self._entries) | set(self._starting))

    def active_records(self) -> list[InstanceStatusRecord]:
        """The records of the active instances that have reported, by URL."""
        out = []
        for instance in sorted(self._entries):
            record = self.record(instance)
            if record is not None and self.is_active(instance):
                out.append(record)
        return out
