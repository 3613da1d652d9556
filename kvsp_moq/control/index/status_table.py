"""The latest Instance Status Record of each instance, with TTL and epoch rules (kvsp-draft §6.3).

Used by the Index Service for lookup estimates (§6.2, §6.4); the PC can use the same table.

- A record expires ``ttl_ms`` after it is received; an expired record is treated as absent
  (§6.3: "The PC considers an instance failed when its record expires"). ``ttl_ms`` is capped
  at a configured maximum.
- A record with an epoch lower than the highest seen for its instance is refused with
  :class:`StaleEpoch` (§6.3: "MUST discard records with an epoch lower than the highest it has
  seen for that instance"). The highest epoch is remembered after the record expires, so a
  delayed report from before a restart cannot come back.

:class:`InstanceStatusTable` keeps them in the process (the embedded store);
:class:`SharedStatusTable` shares them through the IS's Redis store (or cluster), so every IS
process answers with every instance's status and links (``fetch_us``, §6.4).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass

from ...kvsp.records import InstanceStatusRecord, dump_json, parse_json
from ..common.clock import Clock, MonotonicClock
from ..common.errors import StaleEpoch
from ..common.store import StoreClient, StoreSpec
from ..common.store_scripts import ScriptCall, run_scripts

log = logging.getLogger(__name__)

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


# -- shared through the store (several IS processes) ------------------------------------------

#: How often a :class:`SharedStatusTable` reads every instance's status from the store.
DEFAULT_SYNC_MS = 1_000

# KEYS: latest hash (instance -> "{expiry_ms} {record}"), epochs hash. ARGV: instance, epoch,
# ttl_ms, record. §6.3: a lower epoch than the highest seen is refused ({0, highest}), else
# the record is kept until Redis TIME + ttl_ms ({1, epoch}).
_PUT_STATUS = """
local high = redis.call('HGET', KEYS[2], ARGV[1])
if high and tonumber(ARGV[2]) < tonumber(high) then return {0, high} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], string.format('%d ', now + tonumber(ARGV[3])) .. ARGV[4])
return {1, ARGV[2]}
"""

# KEYS: latest, epochs. Drops expired statuses; answers {now, flat latest, flat epochs}.
_SYNC_STATUSES = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local flat = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #flat, 2 do
  local v = flat[i + 1]
  local sp = string.find(v, ' ', 1, true)
  if tonumber(string.sub(v, 1, sp - 1)) <= now then
    redis.call('HDEL', KEYS[1], flat[i])
  else
    out[#out + 1] = flat[i]
    out[#out + 1] = v
  end
end
return {now, out, redis.call('HGETALL', KEYS[2])}
"""


class SharedStatusTable(InstanceStatusTable):
    """The statuses (and their links, for ``fetch_us``) shared by every IS process over one
    Redis or cluster (docs/deploy.md "Index Service"): :meth:`update` applies the §6.3 rules
    here at once and writes the record to the store (one script that applies them again
    against every process's reports: the highest epoch is the store's); :meth:`sync`, run every
    ``sync_ms`` by the server, replaces this process's view with the store's. A status reported
    to one process is used by all within ``sync_ms``. Keys: ``{{prefix}index:status}:latest``
    and ``:epochs`` (one hash tag: one slot)."""

    def __init__(self, client: StoreClient, spec: StoreSpec, clock: Clock | None = None, *,
                 max_ttl_ms: int = DEFAULT_MAX_STATUS_TTL_MS) -> None:
        super().__init__(clock, max_ttl_ms=max_ttl_ms)
        self.client = client
        self.spec = spec
        tag = f"{{{spec.key_prefix}index:status}}:"
        self._keys = [f"{tag}latest", f"{tag}epochs"]
        self._writes: set[asyncio.Task[None]] = set()

    def update(self, record: InstanceStatusRecord) -> InstanceStatusRecord:
        granted = super().update(record)
        task = asyncio.get_running_loop().create_task(self._write(granted))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return granted

    async def _write(self, record: InstanceStatusRecord) -> None:
        call = ScriptCall(_PUT_STATUS, self._keys, [record.instance, record.epoch, record.ttl_ms, dump_json(record)])
        try:
            (code, high), = await asyncio.wait_for(run_scripts(self.client, self.spec, [call]),
                                                   self.spec.timeout_ms / 1000 * 2)
        except Exception as exc:  # unreachable, failing over: the status stays here; the next report retries
            log.warning("instance status of %s not shared: %s", record.instance, exc)
            return
        if not int(code):  # another process saw a higher epoch: learn it now
            self._highest_epoch[record.instance] = max(self._highest_epoch.get(record.instance, 0), int(high))

    async def sync(self) -> None:
        """This process's view := the store's (every unexpired status, every highest epoch)."""
        answers = await asyncio.wait_for(
            run_scripts(self.client, self.spec, [ScriptCall(_SYNC_STATUSES, self._keys, [])], write=False),
            self.spec.timeout_ms / 1000 * 2)
        now, latest, epochs = answers[0]
        local_now = self._clock.now_ms()
        fresh: dict[str, _Status] = {}
        for value in latest[1::2]:
            expiry, _, doc = bytes(value).partition(b" ")
            record = parse_json(doc, InstanceStatusRecord)
            fresh[record.instance] = _Status(record, local_now + int(expiry) - int(now))
        for name, epoch in zip(epochs[::2], epochs[1::2]):
            instance = name.decode() if isinstance(name, bytes) else str(name)
            self._highest_epoch[instance] = max(self._highest_epoch.get(instance, 0), int(epoch))
        self._latest = fresh

    async def close(self) -> None:
        """Wait (bounded: each write is) for the writes in flight."""
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
