"""The Index Service's records in Redis (or Valkey): :class:`RedisIndexStore` (kvsp-draft §6.1,
§6.2; DESIGN.md §8).

Layout (every key starts with ``spec.key_prefix`` then ``index:``, so roles share one Redis):

- ``{p}index:b:{compat}{scope}{key}`` (hex): one hash per block; field = the replica id
  (the holder URL, then ``"\\n"`` and the MOQT namespace when there is one); value =
  ``"{expiry_ms} {record JSON}"``. The scope is part of every block's key, so a lookup of one
  scope can never read another's records (§6.2 "MUST NOT return replicas of a scope for which
  the client is not authorized").
- ``{p}index:due``: a sorted set of every record (member ``{block hex}|{field}``) by expiry
  time, so :meth:`RedisIndexStore.purge` finds the expired ones without a scan.

Why per-record expiry in the value rather than Redis key TTLs: a block has one hash with
several replicas, each with its own TTL; Redis 7.0 and Valkey 8 have no per-field expiry, and a
key per replica would cost a SCAN (or a second index) per lookup. Time is Redis's own: every
script reads ``TIME``, so several IS processes agree on what has expired whatever their
clocks (tests inject a clock instead, passed to the scripts, so the same contract tests run
on both stores). As a safety net, each block hash also carries a key TTL that only grows to
its latest record's expiry, so Redis reclaims a dead block even if no IS ever purges.

Every operation is one script call (one round trip, atomic): a put of up to
:data:`PUT_CHUNK` records, a withdrawal, a whole §6.2 lookup (the script walks the keys and
stops at the first without an unexpired replica), a purge step. Calls are bounded by the
spec's timeout; an unreachable or hung Redis raises ``StoreUnavailable`` (503).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from ...kvsp.records import ReplicaRecord, dump_json, parse_json
from ..common.clock import Clock
from ..common.store import StoreSpec, open_redis, store_call
from .store import BlockRef, IndexStore, ReplicaId, StoredReplica

__all__ = ["PURGE_STEP", "PUT_CHUNK", "RedisIndexStore"]

#: Records per put script call (a refresh batch is split into calls of this many).
PUT_CHUNK = 256
#: Due records examined per purge script call (each call blocks Redis for a bounded time).
PURGE_STEP = 1_000

# Shared by every script: ARGV[1] is the caller's clock ("" = Redis TIME), a value is
# "{expiry_ms} {record}".
_PRELUDE = """
local function now_ms(arg)
  if arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function expiry(v)
  local sp = string.find(v, ' ', 1, true)
  return tonumber(string.sub(v, 1, sp - 1)), sp
end
"""

# KEYS[1] due set, KEYS[2..] block hashes; ARGV[1] clock, then per record: field, ttl_ms,
# record JSON, due member. Returns 1 (a new replica) or 0 (a refresh) per record (§6.1).
_PUT = _PRELUDE + """
local now = now_ms(ARGV[1])
local out = {}
for i = 2, #KEYS do
  local a = 2 + (i - 2) * 4
  local field, ttl = ARGV[a], tonumber(ARGV[a + 1])
  local old = redis.call('HGET', KEYS[i], field)
  local created = 1
  if old and expiry(old) > now then created = 0 end
  local exp = now + ttl
  redis.call('HSET', KEYS[i], field, string.format('%d ', exp) .. ARGV[a + 2])
  redis.call('ZADD', KEYS[1], exp, ARGV[a + 3])
  if ARGV[1] == '' and redis.call('PTTL', KEYS[i]) < ttl then
    redis.call('PEXPIRE', KEYS[i], ttl)
  end
  out[#out + 1] = created
end
return out
"""

# KEYS[1] due set, KEYS[2] block hash; ARGV clock, field, due member. 1 if an unexpired
# record was withdrawn (§6.1 DELETE).
_DELETE = _PRELUDE + """
local now = now_ms(ARGV[1])
local v = redis.call('HGET', KEYS[2], ARGV[2])
redis.call('ZREM', KEYS[1], ARGV[3])
if not v then return 0 end
redis.call('HDEL', KEYS[2], ARGV[2])
if expiry(v) > now then return 1 end
return 0
"""

# KEYS block hashes in prompt order; ARGV[1] clock. Per leading block with an unexpired
# replica: {remaining_ms, record, remaining_ms, record, ...}; stops at the first block
# without one (§6.2 "the IS MUST stop at the first key without a replica").
_PREFIX = _PRELUDE + """
local now = now_ms(ARGV[1])
local out = {}
for i = 1, #KEYS do
  local found = {}
  for _, v in ipairs(redis.call('HVALS', KEYS[i])) do
    local e, sp = expiry(v)
    if e > now then
      found[#found + 1] = e - now
      found[#found + 1] = string.sub(v, sp + 1)
    end
  end
  if #found == 0 then break end
  out[#out + 1] = found
end
return out
"""

# KEYS[1] due set; ARGV clock, step, block key prefix. Drops up to `step` due records;
# returns {dropped, examined}.
_PURGE = _PRELUDE + """
local now = now_ms(ARGV[1])
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
local dropped = 0
for _, m in ipairs(due) do
  local sep = string.find(m, '|', 1, true)
  local k, f = ARGV[3] .. string.sub(m, 1, sep - 1), string.sub(m, sep + 1)
  local v = redis.call('HGET', k, f)
  if v and expiry(v) <= now then
    redis.call('HDEL', k, f)
    dropped = dropped + 1
  end
  redis.call('ZREM', KEYS[1], m)
end
return {dropped, #due}
"""

# KEYS[1] due set; ARGV clock. The number of unexpired records.
_COUNT = _PRELUDE + """
return redis.call('ZCOUNT', KEYS[1], '(' .. string.format('%d', now_ms(ARGV[1])), '+inf')
"""


def _field(replica: ReplicaId) -> bytes:
    name = replica.holder if replica.moqt_namespace is None else f"{replica.holder}\n{replica.moqt_namespace}"
    return name.encode()


def _block(block: BlockRef) -> bytes:
    return (block.compat_id + block.scope_id + block.block_key).hex().encode()


class RedisIndexStore(IndexStore):
    """Replica records in Redis; several IS processes over one Redis give the same answers.

    ``clock`` is for tests only: without it (the deployment) Redis's ``TIME`` is the clock."""

    def __init__(self, redis: Redis, spec: StoreSpec, *, clock: Clock | None = None) -> None:
        self.redis = redis
        self.spec = spec
        self._clock = clock
        prefix = f"{spec.key_prefix}index:".encode()
        self._blocks = prefix + b"b:"
        self._due = prefix + b"due"
        self._put = redis.register_script(_PUT)
        self._delete = redis.register_script(_DELETE)
        self._prefix = redis.register_script(_PREFIX)
        self._purge = redis.register_script(_PURGE)
        self._count = redis.register_script(_COUNT)

    @classmethod
    def open(cls, spec: StoreSpec, *, clock: Clock | None = None) -> RedisIndexStore:
        """A store on a new bounded client for ``spec`` (``common.store.open_redis``)."""
        return cls(open_redis(spec), spec, clock=clock)

    @store_call(lambda self: self.spec)
    async def _run(self, script: AsyncScript, keys: Sequence[bytes], args: Sequence[bytes | int]) -> Any:
        """One script call (EVALSHA; the script is loaded on NOSCRIPT), bounded by the
        spec's timeout: ``StoreUnavailable`` when Redis is unreachable or does not answer."""
        return await script(keys=list(keys), args=list(args))

    def _now(self) -> bytes:
        return b"" if self._clock is None else str(self._clock.now_ms()).encode()

    def _key(self, block: BlockRef) -> bytes:
        return self._blocks + _block(block)

    async def put(self, record: ReplicaRecord, ttl_ms: int) -> bool:
        return (await self.put_many([(record, ttl_ms)]))[0]

    async def put_many(self, records: Sequence[tuple[ReplicaRecord, int]]) -> list[bool]:
        """Each record as :meth:`put` would, :data:`PUT_CHUNK` per script call (a holder's
        refresh batch, §6.1); each call is atomic, the batch as a whole is not."""
        if any(ttl <= 0 for _, ttl in records):
            raise ValueError("ttl_ms must be > 0")
        out: list[bool] = []
        for start in range(0, len(records), PUT_CHUNK):
            keys: list[bytes] = [self._due]
            args: list[bytes | int] = [self._now()]
            for record, ttl in records[start:start + PUT_CHUNK]:
                block, field = _block(BlockRef.of(record)), _field(ReplicaId.of(record))
                keys.append(self._blocks + block)
                args += [field, ttl, dump_json(record), block + b"|" + field]
            created = await self._run(self._put, keys, args)
            out += [bool(c) for c in created]
        return out

    async def delete(self, block: BlockRef, replica: ReplicaId) -> bool:
        field = _field(replica)
        args = [self._now(), field, _block(block) + b"|" + field]
        return bool(await self._run(self._delete, [self._due, self._key(block)], args))

    async def get(self, block: BlockRef) -> list[StoredReplica]:
        found = await self.get_prefix(block.compat_id, block.scope_id, [block.block_key])
        return found[0] if found else []

    async def get_prefix(self, compat_id: bytes, scope_id: bytes, block_keys: Sequence[bytes]) -> list[list[StoredReplica]]:
        """The whole §6.2 walk in one script call (one round trip)."""
        if not block_keys:
            return []
        keys = [self._key(BlockRef(compat_id, scope_id, k)) for k in block_keys]
        found = await self._run(self._prefix, keys, [self._now()])
        out: list[list[StoredReplica]] = []
        for flat in found:
            replicas = [StoredReplica(parse_json(flat[i + 1], ReplicaRecord), int(flat[i]))
                        for i in range(0, len(flat), 2)]
            replicas.sort(key=lambda s: ReplicaId.of(s.record).sort_key())
            out.append(replicas)
        return out

    async def purge(self) -> int:
        dropped = 0
        while True:
            step = await self._run(self._purge, [self._due], [self._now(), PURGE_STEP, self._blocks])
            dropped += int(step[0])
            if int(step[1]) < PURGE_STEP:
                return dropped

    async def count(self) -> int:
        return int(await self._run(self._count, [self._due], [self._now()]))

    async def close(self) -> None:
        await self.redis.aclose()
