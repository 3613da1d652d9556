"""The latest Instance Status Record of each instance, with TTL and epoch rules (kvsp-draft §6.3).

Used by the Index Service for lookup estimates (§6.2, §6.4); the PC can use the same table.

- A record expires ``ttl_ms`` after it is received; an expired record is treated as absent
  (§6.3: "The PC considers an instance failed when its record expires"). ``ttl_ms`` is capped
  at a configured maximum.
- A record with an epoch lower than the highest seen for its instance is refused with
  :class:`StaleEpoch` (§6.3: "MUST discard records with an epoch lower than the highest it has
  seen for that instance"). The highest epoch is remembered after the record expires, so a
  delayed report from before a restart cannot come back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...kvsp.records import InstanceStatusRecord
from ..common.clock import Clock, MonotonicClock
from ..common.errors import StaleEpoch

#: Default cap on a status record's ttl_ms.
DEFAULT_MAX_STATUS_TTL_MS = 60_000


@dataclass(frozen=True, slots=True)
class _Status:
    record: InstanceStatusRecord
    expires_ms: int


class InstanceStatusTable:
    """Latest unexpired status per instance URL."""

    def __init__(self, clock: Clock | None = None, *, max_ttl_ms: int = DEFAULT_MAX_STATUS_TTL_MS) -> None:
        if max_ttl_ms <= 0:
            raise ValueError("max_ttl_ms must be > 0")
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        self._max_ttl_ms = max_ttl_ms
        self._latest: dict[str, _Status] = {}
        self._highest_epoch: dict[str, int] = {}

    def update(self, record: InstanceStatusRecord) -> InstanceStatusRecord:
        """Keep ``record`` as the instance's status; returns it with its granted ttl_ms.
        :class:`StaleEpoch` if its epoch is lower than one already seen."""
        highest = self._highest_epoch.get(record.instance)
        if highest is not None and record.epoch < highest:
            raise StaleEpoch(f"epoch {record.epoch} of {record.instance} is lower than {highest}, already seen")
        self._highest_epoch[record.instance] = record.epoch
        if record.ttl_ms > self._max_ttl_ms:
            record = dataclasses.replace(record, ttl_ms=self._max_ttl_ms)
        self._latest[record.instance] = _Status(record, self._clock.now_ms() + record.ttl_ms)
        return record

    def get(self, instance: str) -> InstanceStatusRecord | None:
        """The instance's unexpired status, or ``None``."""
        status = self._latest.get(instance)
        if status is None:
            return None
        if status.expires_ms <= self._clock.now_ms():
            del self._latest[instance]
            return None
        return status.record

    def purge(self) -> int:
        """Drop expired records; the number dropped."""
        now = self._clock.now_ms()
        expired = [i for i, s in self._latest.items() if s.expires_ms <= now]
        for instance in expired:
            del self._latest[instance]
        return len(expired)
