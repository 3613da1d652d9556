"""A holder's leases in Redis (kvsp-draft §6.6; DESIGN.md §8): they outlive the holder process.

Keys (``P`` = ``"{"`` + ``store_key_prefix`` + ``"holder}:"``; one holder per prefix, see
docs/deploy.md):

- ``P lease:{id}``: a hash ``owner``, ``octets``, ``expires`` (ms on the lease clock), ``scope``
  (hex), ``replicas`` (JSON ``[[compat, scope, block_key, replica_id], ...]`` in hex);
- ``P expiry``: a sorted set, lease id -> expiry (purge, and the reload after a restart);
- ``P owner:{name}``: a sorted set per owner, lease id -> expiry (its live leases);
- ``P usage``: a hash, owner -> leased octets of its leases not yet purged;
- ``P released:{id}``: a released lease's hash (as ``lease:{id}`` was) until its expiry
  (``PEXPIRE``): the owner's repeated release is answered as released (a 503 retried).

A lease granted for a request with an ``Idempotency-Key`` also has ``request`` (the request's
fingerprint): the same grant repeated finds it and answers it (code 3), counted once.

Every write is one Lua script, so each is atomic in Redis: :meth:`RedisLeaseStore.grant` drops
the owner's expired leases, checks the quota (§6.6 "MUST enforce a per-client quota") and
records the lease in one step, so two requests or two holder processes over one Redis cannot
both pass the last bit of a quota. A renewal or a release checks owner and expiry in the same
step as its write. Every call is bounded by ``store_timeout_ms`` (``common/store.py``); a Redis
that does not answer, or a replica that refuses writes (``READONLY``), is
:class:`~..common.errors.StoreUnavailable` (503 ``kvsp-unavailable``).

The scripts touch keys they compute from ``P`` (not only those in KEYS). ``P`` is a hash tag
(``{kvsp:holder}``): every key of one holder is in one slot, so on a Redis Cluster each script
runs in that slot (KEYS[1], ``P expiry``, routes it), and holders with different prefixes spread
over the primaries. The tag is the holder because a grant checks the owner's quota over all its
leases in the same atomic step (docs/deploy.md "Redis Cluster"). A write is acknowledged once
``store_wait_replicas`` replicas have it (``common/store_scripts.py``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ...storage import RecordKey
from ..common.store import StoreClient, StoreSpec, open_redis, store_call
from ..common.store_scripts import ScriptCall, run_scripts
from .lease_store import GrantOutcome, Lease, LeaseLimits, ReleaseOutcome, Usage

__all__ = ["RedisLeaseStore"]

#: Leases one purge script removes at most (a long backlog is purged in several calls).
PURGE_BATCH = 500
#: Lease hashes read per pipeline round trip when reloading.
LOAD_BATCH = 1000
_FIELDS = ("owner", "octets", "expires", "scope", "replicas")

# ARGV[1] is always P. drop(id) removes one lease and frees its quota; it returns the lease's
# fields (id first) so the caller can unpin its replicas.
_COMMON = """
local P = ARGV[1]
local function drop(id)
  local lk = P .. 'lease:' .. id
  local f = redis.call('HMGET', lk, 'owner', 'octets', 'expires', 'scope', 'replicas')
  redis.call('ZREM', P .. 'expiry', id)
  if not f[1] then return false end
  redis.call('ZREM', P .. 'owner:' .. f[1], id)
  if redis.call('HINCRBY', P .. 'usage', f[1], -tonumber(f[2])) <= 0 then
    redis.call('HDEL', P .. 'usage', f[1])
  end
  redis.call('DEL', lk)
  return {id, f[1], f[2], f[3], f[4], f[5]}
end
local function purge_owner(owner, now)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. 'owner:' .. owner, '-inf', now)) do drop(id) end
end
local function usage(owner)
  return tonumber(redis.call('HGET', P .. 'usage', owner) or '0'), redis.call('ZCARD', P .. 'owner:' .. owner)
end
local function live(id, owner, now)
  local f = redis.call('HMGET', P .. 'lease:' .. id, 'owner', 'expires')
  return f[1] == owner and tonumber(f[2]) > now
end
"""

# ARGV: P, now, id, owner, octets, expires, max_leases, max_octets, scope, replicas, request.
# Answers {1 granted | 0 over the quota | 2 id taken | 4 id is the owner's lease of another
# request, octets used, live leases}, or {3, used, leases, the lease's fields}: the same request
# (ARGV[11], not empty) granted it before.
_GRANT = _COMMON + """
local now, id, owner, octets, request = tonumber(ARGV[2]), ARGV[3], ARGV[4], tonumber(ARGV[5]), ARGV[11]
purge_owner(owner, now)
local used, count = usage(owner)
local lk = P .. 'lease:' .. id
if redis.call('EXISTS', lk) == 1 then
  local f = redis.call('HMGET', lk, 'owner', 'octets', 'expires', 'scope', 'replicas', 'request')
  if request == '' or f[1] ~= owner then return {2, used, count} end
  if f[6] ~= request then return {4, used, count} end
  return {3, used, count, id, f[1], f[2], f[3], f[4], f[5]}
end
if count + 1 > tonumber(ARGV[7]) or used + octets > tonumber(ARGV[8]) then return {0, used, count} end
redis.call('HSET', lk, 'owner', owner, 'octets', ARGV[5], 'expires', ARGV[6], 'scope', ARGV[9], 'replicas', ARGV[10])
if request ~= '' then redis.call('HSET', lk, 'request', request) end
redis.call('ZADD', P .. 'expiry', ARGV[6], id)
redis.call('ZADD', P .. 'owner:' .. owner, ARGV[6], id)
redis.call('HINCRBY', P .. 'usage', owner, ARGV[5])
return {1, used, count}
"""

# ARGV: P, now, id, owner, expires. The lease's fields, or nil (unknown, expired, another's).
_RENEW = _COMMON + """
local now, id, owner = tonumber(ARGV[2]), ARGV[3], ARGV[4]
if not live(id, owner, now) then return false end
local lk = P .. 'lease:' .. id
redis.call('HSET', lk, 'expires', ARGV[5])
redis.call('ZADD', P .. 'expiry', ARGV[5], id)
redis.call('ZADD', P .. 'owner:' .. owner, ARGV[5], id)
local f = redis.call('HMGET', lk, 'owner', 'octets', 'expires', 'scope', 'replicas')
return {id, f[1], f[2], f[3], f[4], f[5]}
"""

# ARGV: P, now, id, owner. The released lease's fields, also when the owner released it before
# (its tombstone, kept until the lease's expiry); nil.
_RELEASE = _COMMON + """
local now, id, owner = tonumber(ARGV[2]), ARGV[3], ARGV[4]
local tk = P .. 'released:' .. id
if not live(id, owner, now) then
  local t = redis.call('HMGET', tk, 'owner', 'octets', 'expires', 'scope', 'replicas')
  if t[1] == owner and tonumber(t[3]) > now then return {id, t[1], t[2], t[3], t[4], t[5]} end
  return false
end
local f = drop(id)
redis.call('HSET', tk, 'owner', f[2], 'octets', f[3], 'expires', f[4], 'scope', f[5], 'replicas', f[6])
redis.call('PEXPIRE', tk, math.max(1, tonumber(f[4]) - now))
return f
"""

# ARGV: P, now, owner. {octets, leases} of the owner's live leases.
_USAGE = _COMMON + """
purge_owner(ARGV[3], tonumber(ARGV[2]))
local used, count = usage(ARGV[3])
return {used, count}
"""

# ARGV: P, now, limit. The fields of the expired leases removed (at most limit).
_PURGE = _COMMON + """
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. 'expiry', '-inf', ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))) do
  local f = drop(id)
  if f then out[#out + 1] = f end
end
return out
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _encode_replicas(lease: Lease) -> str:
    return json.dumps([[k.compat_id.hex(), k.scope_id.hex(), k.block_key.hex(), rid.hex()]
                       for k, rid in lease.replicas.items()], separators=(",", ":"))


def _decode(fields: Sequence[Any]) -> Lease:
    """A lease from ``[id, owner, octets, expires, scope, replicas]``."""
    lease_id, owner, octets, expires, scope, replicas = (_text(f) for f in fields)
    pairs = {RecordKey(bytes.fromhex(c), bytes.fromhex(s), bytes.fromhex(b)): bytes.fromhex(r)
             for c, s, b, r in json.loads(replicas)}
    return Lease(lease_id, owner, pairs, int(octets), int(expires), bytes.fromhex(scope))


def _spec_of(store: RedisLeaseStore) -> StoreSpec:
    return store.spec


class RedisLeaseStore:
    """Leases in Redis (``[holder] store = "redis://..."``): they survive a holder restart."""

    durable = True

    def __init__(self, spec: StoreSpec, client: StoreClient | None = None) -> None:
        self.spec = spec
        self.client = client if client is not None else open_redis(spec)
        self.prefix = f"{{{spec.key_prefix}holder}}:"
        self._grant, self._renew, self._release, self._usage, self._purge = _GRANT, _RENEW, _RELEASE, _USAGE, _PURGE

    async def _run(self, script: str, *args: str | int) -> Any:
        """One script, acknowledged once replicated; a replica's ``READONLY`` (after a
        failover) is as unavailable as a dead primary (``store_call``)."""
        call = ScriptCall(script, [f"{self.prefix}expiry"], [self.prefix, *args])
        return (await run_scripts(self.client, self.spec, [call]))[0]

    @store_call(_spec_of)
    async def grant(self, lease: Lease, limits: LeaseLimits, now_ms: int) -> GrantOutcome:
        code, used, count, *fields = await self._run(
            self._grant, now_ms, lease.id, lease.owner, lease.octets, lease.expires_ms,
            limits.max_leases, limits.max_octets, lease.scope_id.hex(), _encode_replicas(lease), lease.request)
        usage, code = Usage(int(used), int(count)), int(code)
        if code == 3:
            return GrantOutcome(True, usage, existing=replace(_decode(fields), request=lease.request))
        return GrantOutcome(code == 1, usage, duplicate=code == 2, conflict=code == 4)

    @store_call(_spec_of)
    async def renew(self, owner: str, lease_id: str, expires_ms: int, now_ms: int) -> Lease | None:
        fields = await self._run(self._renew, now_ms, lease_id, owner, expires_ms)
        return _decode(fields) if fields else None

    @store_call(_spec_of)
    async def release(self, owner: str, lease_id: str, now_ms: int) -> ReleaseOutcome:
        fields = await self._run(self._release, now_ms, lease_id, owner)
        return ReleaseOutcome(True, _decode(fields)) if fields else ReleaseOutcome(False)

    @store_call(_spec_of)
    async def get(self, owner: str, lease_id: str, now_ms: int) -> Lease | None:
        fields = await self.client.hmget(f"{self.prefix}lease:{lease_id}", list(_FIELDS))
        if fields[0] is None or _text(fields[0]) != owner or int(_text(fields[2])) <= now_ms:
            return None
        return _decode([lease_id, *fields])

    @store_call(_spec_of)
    async def usage(self, owner: str, now_ms: int) -> Usage:
        used, count = await self._run(self._usage, now_ms, owner)
        return Usage(int(used), int(count))

    @store_call(_spec_of)
    async def purge(self, now_ms: int) -> list[Lease]:
        removed: list[Lease] = []
        while True:
            batch = await self._run(self._purge, now_ms, PURGE_BATCH)
            removed += [_decode(fields) for fields in batch]
            if len(batch) < PURGE_BATCH:
                return removed

    @store_call(_spec_of)
    async def live(self, now_ms: int) -> list[Lease]:
        ids = [_text(i) for i in await self.client.zrangebyscore(f"{self.prefix}expiry", f"({now_ms}", "+inf")]
        leases: list[Lease] = []
        for start in range(0, len(ids), LOAD_BATCH):
            chunk = ids[start:start + LOAD_BATCH]
            pipe = self.client.pipeline(transaction=False)
            for lease_id in chunk:
                pipe.hmget(f"{self.prefix}lease:{lease_id}", list(_FIELDS))
            for lease_id, fields in zip(chunk, await pipe.execute()):
                if fields[0] is not None and int(_text(fields[2])) > now_ms:
                    leases.append(_decode([lease_id, *fields]))
        return leases

    async def close(self) -> None:
        await self.client.aclose()
