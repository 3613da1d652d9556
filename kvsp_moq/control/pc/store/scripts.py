"""The Lua scripts of the Redis PC store (``store/shared.py``): each checks the leader token
and applies one rule of ``store/base.py`` atomically (Redis runs a script to its end before
any other command). Every script answers ``{status, value}``; the status is one of ``ok``,
``not-leader``, ``stale``, ``ahead``, ``missing`` or ``exists``.

KEYS[1] is always the leader lock and ARGV[1] the writer's token. Integers travel as decimal
strings; epochs and offsets are below 2^53, exact in Lua's numbers.
"""

from __future__ import annotations

__all__ = [
    "ACQUIRE", "BEGIN_RESHARD", "CREATE_SESSION", "DECIDE_RESHARD", "DELETE_SESSION", "END_RESHARD", "LOAD", "LOAD_MAP",
    "PUT_CHECKPOINT", "PUT_DIRECTIVE", "PUT_INSTANCE", "PUT_SHARD_MAP", "RELEASE", "RENEW", "SAVE_SESSION",
]

_FENCE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'not-leader', 0} end
"""

#: Everything but the sessions, in one atomic read. KEYS: session ids, epochs, instances,
#: map documents, directives, reshards, reshard decisions. Answers {ids, then each hash flat}.
LOAD = """
return {redis.call('SMEMBERS', KEYS[1]), redis.call('HGETALL', KEYS[2]), redis.call('HGETALL', KEYS[3]),
        redis.call('HGETALL', KEYS[4]), redis.call('HGETALL', KEYS[5]), redis.call('HGETALL', KEYS[6]),
        redis.call('HGETALL', KEYS[7])}
"""

#: One map and its reshard in flight, in one atomic read. KEYS: maps, reshards, reshard decisions.
#: ARGV: map. Answers {map document or false, reshard document or false, decision or false}.
LOAD_MAP = """
return {redis.call('HGET', KEYS[1], ARGV[1]), redis.call('HGET', KEYS[2], ARGV[1]), redis.call('HGET', KEYS[3], ARGV[1])}
"""

#: The lock: take it if free (or extend it if the token holds it), extend / delete only if the
#: token still holds it.
ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

#: §6.3. KEYS: lock, epochs hash, instances hash. ARGV: token, instance, epoch, doc.
PUT_INSTANCE = _FENCE + """
local high = redis.call('HGET', KEYS[2], ARGV[2])
if high and tonumber(ARGV[3]) < tonumber(high) then return {'stale', high} end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[4])
return {'ok', ARGV[3]}
"""

#: KEYS: lock, session hash, session-id set. ARGV: token, id, epoch, doc, checkpoint, offset.
CREATE_SESSION = _FENCE + """
if redis.call('EXISTS', KEYS[2]) == 1 then return {'exists', 0} end
redis.call('HSET', KEYS[2], 'epoch', ARGV[3], 'doc', ARGV[4], 'cp', ARGV[5], 'offset', ARGV[6])
redis.call('SADD', KEYS[3], ARGV[2])
return {'ok', ARGV[3]}
"""

#: §6.8 compare-and-set. KEYS: lock, session hash. ARGV: token, expected epoch, epoch, doc.
SAVE_SESSION = _FENCE + """
local cur = redis.call('HGET', KEYS[2], 'epoch')
if not cur then return {'missing', 0} end
if tonumber(cur) ~= tonumber(ARGV[2]) or tonumber(ARGV[3]) < tonumber(cur) then return {'stale', cur} end
redis.call('HSET', KEYS[2], 'epoch', ARGV[3], 'doc', ARGV[4])
return {'ok', ARGV[3]}
"""

#: §6.8 the highest output_offset of the session epoch. KEYS: lock, session hash.
#: ARGV: token, epoch, offset, checkpoint.
PUT_CHECKPOINT = _FENCE + """
local cur = redis.call('HGET', KEYS[2], 'epoch')
if not cur then return {'missing', 0} end
if tonumber(ARGV[2]) < tonumber(cur) then return {'stale', cur} end
if tonumber(ARGV[2]) > tonumber(cur) then return {'ahead', cur} end
local kept = tonumber(redis.call('HGET', KEYS[2], 'offset'))
if tonumber(ARGV[3]) >= kept then
  redis.call('HSET', KEYS[2], 'cp', ARGV[4], 'offset', ARGV[3])
  kept = tonumber(ARGV[3])
end
return {'ok', tostring(kept)}
"""

#: KEYS: lock, session hash, session-id set. ARGV: token, id, epoch.
DELETE_SESSION = _FENCE + """
local cur = redis.call('HGET', KEYS[2], 'epoch')
if not cur then return {'missing', 0} end
if tonumber(cur) ~= tonumber(ARGV[3]) then return {'stale', cur} end
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[3], ARGV[2])
return {'ok', cur}
"""

#: §6.9. KEYS: lock, versions hash, maps hash. ARGV: token, map, version, doc.
PUT_SHARD_MAP = _FENCE + """
local cur = redis.call('HGET', KEYS[2], ARGV[2])
if cur and tonumber(ARGV[3]) <= tonumber(cur) then return {'stale', cur} end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[4])
return {'ok', ARGV[3]}
"""

#: §6.5. KEYS: lock, directives hash, expiry sorted set. ARGV: token, id, doc, until (unix ms),
#: now (unix ms): the expired ones are dropped first.
PUT_DIRECTIVE = _FENCE + """
local gone = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', ARGV[5])
for _, id in ipairs(gone) do redis.call('HDEL', KEYS[2], id) end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[5])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[2])
return {'ok', ARGV[4]}
"""

#: §6.9 a reshard in flight, one per map (``store/base.py``). KEYS: lock, reshard target
#: versions, reshard documents, reshard decisions, map versions. ARGV: token, map, from, to, doc.
#: An undecided reshard of the map is ``exists``; a decided one (sent already) is replaced.
BEGIN_RESHARD = _FENCE + """
local held = redis.call('HGET', KEYS[2], ARGV[2])
if held and not redis.call('HGET', KEYS[4], ARGV[2]) then return {'exists', held} end
local v = redis.call('HGET', KEYS[5], ARGV[2])
if (not v) or tonumber(v) ~= tonumber(ARGV[3]) then return {'stale', v or 'none'} end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[4])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[5])
redis.call('HDEL', KEYS[4], ARGV[2])
return {'ok', ARGV[4]}
"""

#: §6.9 the decision, once; a commit makes the new version authoritative in the same step.
#: KEYS: lock, reshard target versions, reshard decisions, map versions, maps. ARGV: token,
#: map, to, decision, the new map's document. Answers the decision that stands.
DECIDE_RESHARD = _FENCE + """
local held = redis.call('HGET', KEYS[2], ARGV[2])
if (not held) or tonumber(held) ~= tonumber(ARGV[3]) then return {'missing', 0} end
local d = redis.call('HGET', KEYS[3], ARGV[2])
if d then return {'ok', d} end
if ARGV[4] == 'commit' then
  local cur = redis.call('HGET', KEYS[4], ARGV[2])
  if cur and tonumber(ARGV[3]) <= tonumber(cur) then return {'stale', cur} end
  redis.call('HSET', KEYS[4], ARGV[2], ARGV[3])
  redis.call('HSET', KEYS[5], ARGV[2], ARGV[5])
end
redis.call('HSET', KEYS[3], ARGV[2], ARGV[4])
return {'ok', ARGV[4]}
"""

#: KEYS: lock, reshard target versions, reshard documents, reshard decisions. ARGV: token, map, to.
END_RESHARD = _FENCE + """
local held = redis.call('HGET', KEYS[2], ARGV[2])
if held and tonumber(held) == tonumber(ARGV[3]) then
  redis.call('HDEL', KEYS[2], ARGV[2])
  redis.call('HDEL', KEYS[3], ARGV[2])
  redis.call('HDEL', KEYS[4], ARGV[2])
end
return {'ok', ARGV[3]}
"""
