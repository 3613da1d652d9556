"""The Index Service's records in Redis (or Valkey): :class:`RedisIndexStore` (kvsp-draft §6.1,
§6.2; DESIGN.md §8).

Layout (every key starts with ``spec.key_prefix`` then ``index:``, so roles share one Redis;
``{S}`` is the hash tag of a scope, the hex of its compat_id and scope_id):

- ``{p}index:{S}:b:{key}`` (hex): one hash per block; field = the replica id
  (the holder URL, then ``"\\n"`` and the MOQT namespace when there is one); value =
  ``"{expiry_ms} {record JSON}"`` (``replica_json.dump_replica``: ``dump_json``'s octets; a
  lookup reads it back with ``load_replica``, a typed decode without the rules, which were
  checked when the record was published). The scope is part of every block's key, so a
  lookup of one scope can never read another's records (§6.2 "MUST NOT return replicas of a
  scope for which the client is not authorized").
- ``{p}index:{S}:due``: a sorted set of the scope's records (member ``{key hex}|{field}``) by
  expiry time, so :meth:`RedisIndexStore.purge` finds the expired ones without a scan.
- ``{p}index:scopes``: a set of the scope tags that have records (what the purge walks).

The hash tag is the scope (docs/deploy.md "Redis Cluster"): every key a script touches is of
one scope, so on a Redis Cluster each script runs in one slot, and a §6.2 lookup (one scope,
one prompt) stays one script, one round trip. Scopes spread over the cluster's primaries.

Why per-record expiry in the value rather than Redis key TTLs: a block has one hash with
several replicas, each with its own TTL; Redis 7.0 and Valkey 8 have no per-field expiry, and a
key per replica would cost a SCAN (or a second index) per lookup. Time is Redis's own: every
script reads ``TIME``, so several IS processes agree on what has expired whatever their
clocks (tests inject a clock instead, passed to the scripts, so the same contract tests run
on both stores). As a safety net, each block hash also carries a key TTL that only grows to
its latest record's expiry, so Redis reclaims a dead block even if no IS ever purges.

Every operation is one script call (atomic): a put of up to :data:`PUT_CHUNK` records of one
scope, a withdrawal, a whole §6.2 lookup (the script walks the keys and stops at the first
without an unexpired replica), a purge step. A refresh batch is one pipeline of put scripts,
one round trip (per primary on a cluster), acknowledged once ``store_wait_replicas`` replicas
have it (``common/store_scripts.py``). Calls are bounded by the spec's timeout; an unreachable
or hung Redis raises ``StoreUnavailable`` (503).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...kvsp.records import ReplicaRecord
from ...kvsp.records.replica_json import dump_replica, load_replica
from ..common.clock import Clock
from ..common.store import StoreClient, StoreSpec, open_redis, store_call
from ..common.store_scripts import ScriptCall, run_scripts
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

# KEYS[1] due set of a scope; ARGV clock, step, the scope's block key prefix. Drops up to
# `step` due records;
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

# KEYS[1] due set of a scope; ARGV clock. The number of its unexpired records.
_COUNT = _PRELUDE + """
return redis.call('ZCOUNT', KEYS[1], '(' .. string.format('%d', now_ms(ARGV[1])), '+inf')
"""

# KEYS[1] the scopes set; ARGV[1] a scope tag.
_ADD_SCOPE = "return redis.call('SADD', KEYS[1], ARGV[1])"


def _field(replica: ReplicaId) -> bytes:
    name = replica.holder if replica.moqt_namespace is None else f"{replica.holder}\n{replica.moqt_namespace}"
    return name.encode()


def _scope(compat_id: bytes, scope_id: bytes) -> bytes:
    """A scope's hash tag: the hex of its compat_id and scope_id."""
    return (compat_id + scope_id).hex().encode()


class RedisIndexStore(IndexStore):
    """Replica records in Redis or a Redis Cluster; several IS processes over one store give
    the same answers.

    ``clock`` is for tests only: without it (the deployment) Redis's ``TIME`` is the clock."""

    def __init__(self, redis: StoreClient, spec: StoreSpec, *, clock: Clock | None = None) -> None:
        self.redis = redis
        self.spec = spec
        self._clock = clock
        self._base = f"{spec.key_prefix}index:".encode()
        self._scopes = self._base + b"scopes"
        self._prefix = redis.register_script(_PREFIX)

    @classmethod
    def open(cls, spec: StoreSpec, *, clock: Clock | None = None) -> RedisIndexStore:
        """A store on a new bounded client for ``spec`` (``common.store.open_redis``)."""
        return cls(open_redis(spec), spec, clock=clock)

    @store_call(lambda self: self.spec)
    async def _run(self, calls: Sequence[ScriptCall], *, write: bool = True) -> list[Any]:
        """Script calls as one pipeline (``common.store_scripts``), bounded by the spec's
        timeout: ``StoreUnavailable`` when Redis is unreachable or does not answer."""
        return await run_scripts(self.redis, self.spec, calls, write=write)

    def _now(self) -> bytes:
        return b"" if self._clock is None else str(self._clock.now_ms()).encode()

    def _tagged(self, scope: bytes) -> bytes:
        return self._base + b"{" + scope + b"}:"

    def _key(self, block: BlockRef) -> bytes:
        return self._tagged(_scope(block.compat_id, block.scope_id)) + b"b:" + block.block_key.hex().encode()

    async def put(self, record: ReplicaRecord, ttl_ms: int) -> bool:
        return (await self.put_many([(record, ttl_ms)]))[0]

    async def put_many(self, records: Sequence[tuple[ReplicaRecord, int]]) -> list[bool]:
        """Each record as :meth:`put` would, in one pipeline: per scope, :data:`PUT_CHUNK`
        records per script call (a holder's refresh batch, §6.1); each call is atomic, the
        batch as a whole is not."""
        if any(ttl <= 0 for _, ttl in records):
            raise ValueError("ttl_ms must be > 0")
        by_scope: dict[bytes, list[int]] = {}
        for i, (record, _) in enumerate(records):
            by_scope.setdefault(_scope(record.compat_id, record.scope_id), []).append(i)
        now = self._now()
        calls: list[ScriptCall] = []
        order: list[list[int]] = []
        for scope, members in by_scope.items():
            tag = self._tagged(scope)
            blocks = tag + b"b:"
            for start in range(0, len(members), PUT_CHUNK):
                chunk = members[start:start + PUT_CHUNK]
                keys: list[bytes] = [tag + b"due"]
                args: list[bytes | int] = [now]
                for i in chunk:
                    record, ttl = records[i]
                    key, field = record.block_key.hex().encode(), _field(ReplicaId.of(record))
                    keys.append(blocks + key)
                    args += [field, ttl, dump_replica(record), key + b"|" + field]
                calls.append(ScriptCall(_PUT, keys, args))
                order.append(chunk)
            calls.append(ScriptCall(_ADD_SCOPE, [self._scopes], [scope]))
            order.append([])
        out = [False] * len(records)
        for chunk, created in zip(order, await self._run(calls)):
            for i, c in zip(chunk, created if chunk else []):
                out[i] = bool(c)
        return out

    async def delete(self, block: BlockRef, replica: ReplicaId) -> bool:
        field = _field(replica)
        tag = self._tagged(_scope(block.compat_id, block.scope_id))
        args = [self._now(), field, block.block_key.hex().encode() + b"|" + field]
        return bool((await self._run([ScriptCall(_DELETE, [tag + b"due", self._key(block)], args)]))[0])

    async def get(self, block: BlockRef) -> list[StoredReplica]:
        found = await self.get_prefix(block.compat_id, block.scope_id, [block.block_key])
        return found[0] if found else []

    async def get_prefix(self, compat_id: bytes, scope_id: bytes, block_keys: Sequence[bytes]) -> list[list[StoredReplica]]:
        """The whole §6.2 walk in one script call (one round trip: the keys share the
        scope's hash tag)."""
        if not block_keys:
            return []
        tag = self._tagged(_scope(compat_id, scope_id)) + b"b:"
        keys = [tag + k.hex().encode() for k in block_keys]
        found = await self._read(keys)
        out: list[list[StoredReplica]] = []
        for flat in found:
            replicas = [StoredReplica(load_replica(flat[i + 1]), int(flat[i]))
                        for i in range(0, len(flat), 2)]
            replicas.sort(key=lambda s: ReplicaId.of(s.record).sort_key())
            out.append(replicas)
        return out

    @store_call(lambda self: self.spec)
    async def _read(self, keys: list[bytes]) -> Any:
        return await self._prefix(keys=keys, args=[self._now()])

    @store_call(lambda self: self.spec)
    async def _scope_tags(self) -> list[bytes]:
        members = await self.redis.smembers(self._scopes)
        return sorted(m if isinstance(m, bytes) else m.encode() for m in members)

    async def purge(self) -> int:
        dropped = 0
        now = self._now()
        for scope in await self._scope_tags():
            tag = self._tagged(scope)
            while True:
                call = ScriptCall(_PURGE, [tag + b"due"], [now, PURGE_STEP, tag + b"b:"])
                step = (await self._run([call]))[0]
                dropped += int(step[0])
                if int(step[1]) < PURGE_STEP:
                    break
        return dropped

    async def count(self) -> int:
        now = self._now()
        calls = [ScriptCall(_COUNT, [self._tagged(scope) + b"due"], [now]) for scope in await self._scope_tags()]
        return sum(int(n) for n in await self._run(calls, write=False))

    async def close(self) -> None:
        await self.redis.aclose()
