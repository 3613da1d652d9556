"""The front end's delivery state in Redis (kvsp-draft §6.8; DESIGN.md §8; ``store = "redis://..."``).

Keys (``P`` is ``store_key_prefix``, ``S`` the session UUID; the ``{S}`` hash tag keeps one
session's keys in one Cluster slot, so every script touches one slot):

- ``P frontend:{S}:meta`` — hash: ``scope`` (hex), ``max_tokens``, ``epoch`` (the highest seen),
  ``end`` once known, ``failed`` (the PC's reason) once given up, ``expires`` (ms since the epoch);
- ``P frontend:{S}:out`` — list: the delivered tokens, index ``i`` at position ``i``
  (its length is the next index to deliver);
- ``P frontend:{S}:ahead`` — hash: index -> token, tokens buffered beyond a gap;
- ``P frontend:sessions`` — sorted set: registered sessions by expiry (``max_sessions``).

The hash tag is the session (docs/deploy.md "Redis Cluster"): sessions spread over a cluster's
primaries, and the registration claim (one key) is a script of its own. Every key of a session
expires ``retain_s`` (``[frontend] retain_s``, 24 h by default) after its registration (a
session's output is kept that long for clients to re-read it). Accepting a batch and marking a session failed are
one Lua script each (the same rules as :class:`~.delivery.MemoryDeliveryStore`), so two front
ends over one Redis never both take an index, and a lower epoch is refused atomically (§6.8
"front ends MUST discard tokens that carry a lower epoch").

Live streams: each script publishes the session id on ``P frontend:changed`` when it changed
the session. One subscription per process (:meth:`RedisDeliveryStore.watch`) wakes the local
readers of sessions another process delivered to; the front end wakes its own readers itself.
Pub/sub may drop a message (a reconnect, a slow subscriber), so a waiting reader also re-reads
the store every ``poll_s``: a lost notice costs latency, never a token. (Redis Streams with a
blocking XREAD per reader would hold one connection per open stream; polling alone costs a
read per stream per interval.)

Every call is bounded by ``store_timeout_ms`` (``common.store.open_redis``) and a Redis that
cannot be reached raises ``StoreUnavailable`` (503 ``kvsp-unavailable``). A write is
acknowledged once ``store_wait_replicas`` replicas have it (``common/store_scripts.py``). On a
cluster, the scripts' ``PUBLISH`` reaches every node, and the subscription is redis-py's
cluster pub/sub.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..common.errors import NotActive
from ..common.session_records import OutputTokens, SessionFailed
from ..common.store import StoreClient, StoreSpec, open_redis, store_call
from ..common.store_scripts import ScriptCall, run_scripts
from .delivery import ChangeListener, Outcome, Registration, Snapshot

__all__ = ["RedisDeliveryStore"]

log = logging.getLogger(__name__)

#: How long a session's delivery state is kept after its registration.
DEFAULT_RETAIN_S = 24 * 3600
#: A waiting reader re-reads the store at least this often (a lost pub/sub notice).
DEFAULT_POLL_S = 1.0

# The 9-element answer of the scripts: code, accepted, duplicates, next, epoch, at, index,
# kind, failed (see delivery.Outcome).
_ACCEPT = """
local meta, out, ahead = KEYS[1], KEYS[2], KEYS[3]
local m = redis.call('HMGET', meta, 'max_tokens', 'epoch', 'end', 'failed', 'expires')
if not m[1] then return {'missing', 0, 0, 0, 0, 0, 0, '', ''} end
local max_tokens, epoch = tonumber(m[1]), tonumber(m[2])
local stored_end = m[3] and tonumber(m[3]) or nil
local batch_epoch = tonumber(ARGV[1])
local nxt = redis.call('LLEN', out)
if m[4] then return {'failed', 0, 0, nxt, epoch, 0, 0, '', m[4]} end
if batch_epoch < epoch then return {'stale', 0, 0, nxt, epoch, 0, 0, '', ''} end
local limit = math.min(max_tokens, nxt + tonumber(ARGV[2]))
if stored_end and stored_end < limit then limit = stored_end end
local n = (#ARGV - 5) / 2
for i = 1, n do
  local index = tonumber(ARGV[4 + 2 * i])
  if index >= limit then
    local kind = 'ahead'
    if index >= max_tokens then kind = 'max_tokens' elseif stored_end and index >= stored_end then kind = 'end' end
    return {'index', 0, 0, nxt, epoch, i - 1, index, kind, ''}
  end
end
local new_end = nil
if ARGV[3] ~= '' then new_end = tonumber(ARGV[3]) end
if new_end then
  if new_end > max_tokens then return {'end_max', 0, 0, nxt, epoch, 0, 0, '', ''} end
  if new_end < nxt then return {'end_low', 0, 0, nxt, epoch, 0, 0, '', ''} end
end
local changed = false
if batch_epoch > epoch then
  redis.call('HSET', meta, 'epoch', ARGV[1])
  redis.call('DEL', ahead)
  epoch = batch_epoch
  changed = true
end
local accepted, duplicates = 0, 0
for i = 1, n do
  local index = ARGV[4 + 2 * i]
  if tonumber(index) < nxt or redis.call('HSETNX', ahead, index, ARGV[5 + 2 * i]) == 0 then
    duplicates = duplicates + 1
  else
    accepted = accepted + 1
  end
end
if new_end then
  redis.call('HSET', meta, 'end', ARGV[3])
  for _, k in ipairs(redis.call('HKEYS', ahead)) do
    if tonumber(k) >= new_end then redis.call('HDEL', ahead, k) end
  end
  changed = true
end
local run = {}
while true do
  local key = string.format('%d', nxt)
  local token = redis.call('HGET', ahead, key)
  if not token then break end
  redis.call('HDEL', ahead, key)
  run[#run + 1] = token
  nxt = nxt + 1
  if #run == 1000 then redis.call('RPUSH', out, unpack(run)); run = {} end
end
if #run > 0 then redis.call('RPUSH', out, unpack(run)) end
if m[5] then
  redis.call('PEXPIREAT', out, m[5])
  redis.call('PEXPIREAT', ahead, m[5])
end
if changed or accepted > 0 then redis.call('PUBLISH', ARGV[4], ARGV[5]) end
return {'ok', accepted, duplicates, nxt, epoch, 0, 0, '', ''}
"""

_FAIL = """
local meta, out, ahead = KEYS[1], KEYS[2], KEYS[3]
local m = redis.call('HMGET', meta, 'max_tokens', 'epoch', 'end', 'failed')
if not m[1] then return {'missing', 0, 0, 0, 0, 0, 0, '', ''} end
local epoch = tonumber(m[2])
local nxt = redis.call('LLEN', out)
if m[3] and nxt >= tonumber(m[3]) then return {'complete', 0, 0, nxt, epoch, 0, 0, '', ''} end
if m[4] then return {'already', 0, 0, nxt, epoch, 0, 0, '', m[4]} end
if tonumber(ARGV[1]) < epoch then return {'stale', 0, 0, nxt, epoch, 0, 0, '', ''} end
redis.call('HSET', meta, 'epoch', ARGV[1], 'failed', ARGV[2])
redis.call('DEL', ahead)
redis.call('PUBLISH', ARGV[3], ARGV[4])
return {'ok', 0, 0, nxt, tonumber(ARGV[1]), 0, 0, '', ARGV[2]}
"""

# KEYS: the sessions set. ARGV: session, max_sessions, retain_ms. The expiry (ms) of the
# session's keys, or -1 when max_sessions unexpired sessions are registered.
_CLAIM = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZSCORE', KEYS[1], ARGV[1])
if held then return tonumber(held) end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return -1 end
local expires = now + tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], expires, ARGV[1])
return expires
"""

# KEYS: meta. ARGV: scope (hex), max_tokens, expires (ms). Creates the session once.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'scope', ARGV[1], 'max_tokens', ARGV[2], 'epoch', '0', 'expires', ARGV[3])
redis.call('PEXPIREAT', KEYS[1], ARGV[3])
return 1
"""

# KEYS: meta, out, ahead. ARGV: channel, session. Drops the session's keys and says so.
_FORGET = """
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('PUBLISH', ARGV[1], ARGV[2])
return 1
"""
_UNCLAIM = "return redis.call('ZREM', KEYS[1], ARGV[1])"

# KEYS: meta, out. ARGV: first, last index. {meta fields, tokens, next}.
_READ = """
return {redis.call('HMGET', KEYS[1], 'max_tokens', 'epoch', 'end', 'failed'),
        redis.call('LRANGE', KEYS[2], ARGV[1], ARGV[2]), redis.call('LLEN', KEYS[2])}
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _outcome(reply: list[Any]) -> Outcome:
    code, accepted, duplicates, nxt, epoch, at, index, kind, failed = reply
    return Outcome(_text(code), accepted=int(accepted), duplicates=int(duplicates), next=int(nxt),
                   epoch=int(epoch), at=int(at), index=int(index), kind=_text(kind),
                   failed=failed.decode("utf-8", "replace") if isinstance(failed, bytes) else str(failed))


def _spec_of(store: RedisDeliveryStore) -> StoreSpec:
    return store.spec


class RedisDeliveryStore:
    """Delivery state in Redis (see the module notes)."""

    def __init__(self, spec: StoreSpec, *, retain_s: int = DEFAULT_RETAIN_S,
                 poll_s: float = DEFAULT_POLL_S, client: StoreClient | None = None) -> None:
        self.spec = spec
        self.retain_ms = retain_s * 1000
        self.poll_s: float | None = poll_s
        self.redis = client if client is not None else open_redis(spec)
        base = f"{spec.key_prefix}frontend:"
        self._base = base
        self._sessions = f"{base}sessions"
        self.channel = f"{base}changed"
        self._listeners: list[ChangeListener] = []
        self._watcher: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()

    def _keys(self, session: uuid.UUID) -> list[str]:
        tag = f"{self._base}{{{session}}}"
        return [f"{tag}:meta", f"{tag}:out", f"{tag}:ahead"]

    async def _run(self, *calls: ScriptCall) -> list[Any]:
        """Write scripts in one pipeline, acknowledged once replicated (``common.store_scripts``)."""
        return await run_scripts(self.redis, self.spec, calls)

    @store_call(_spec_of)
    async def register(self, session: uuid.UUID, registration: Registration, *, max_sessions: int) -> None:
        (expires,) = await self._run(ScriptCall(_CLAIM, [self._sessions], [str(session), max_sessions, self.retain_ms]))
        if int(expires) < 0:
            raise NotActive(f"the front end serves {max_sessions} sessions, its maximum")
        await self._run(ScriptCall(_CREATE, self._keys(session)[:1],
                                   [registration.scope_id.hex(), registration.max_tokens, int(expires)]))

    @store_call(_spec_of)
    async def registration(self, session: uuid.UUID) -> Registration | None:
        scope, max_tokens = await self.redis.hmget(self._keys(session)[0], ["scope", "max_tokens"])
        if scope is None or max_tokens is None:
            return None
        return Registration(scope_id=bytes.fromhex(_text(scope)), max_tokens=int(max_tokens))

    @store_call(_spec_of)
    async def forget(self, session: uuid.UUID) -> None:
        await self._run(ScriptCall(_FORGET, self._keys(session), [self.channel, str(session)]),
                        ScriptCall(_UNCLAIM, [self._sessions], [str(session)]))

    @store_call(_spec_of)
    async def accept(self, session: uuid.UUID, batch: OutputTokens, *, max_ahead: int) -> Outcome:
        args: list[str | int] = [batch.epoch, max_ahead, "" if batch.end is None else batch.end,
                                 self.channel, str(session)]
        for t in batch.tokens:
            args += [str(t.index), str(t.token)]
        return _outcome((await self._run(ScriptCall(_ACCEPT, self._keys(session), args)))[0])

    @store_call(_spec_of)
    async def fail(self, session: uuid.UUID, notice: SessionFailed) -> Outcome:
        args: list[str | int] = [notice.epoch, notice.reason, self.channel, str(session)]
        return _outcome((await self._run(ScriptCall(_FAIL, self._keys(session), args)))[0])

    @store_call(_spec_of)
    async def read(self, session: uuid.UUID, start: int, limit: int) -> Snapshot | None:
        meta, out, _ = self._keys(session)
        # One read script (atomic; on a cluster one command, which follows a failover).
        (max_tokens, epoch, end, failed), tokens, nxt = await self.redis.eval(
            _READ, 2, meta, out, start, start + limit - 1)
        if max_tokens is None:
            return None
        return Snapshot(start=start, tokens=tuple(int(t) for t in tokens), next=int(nxt), epoch=int(epoch),
                        end=None if end is None else int(end),
                        failed=None if failed is None else failed.decode("utf-8", "replace"))

    # -- live streams ---------------------------------------------------------------------------

    def watch(self, listener: ChangeListener) -> None:
        self._listeners.append(listener)
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._listen())

    async def _listen(self) -> None:
        """Relay ``P frontend:changed`` to the listeners; after a failure, subscribe again
        (waiting ``poll_s`` between tries: the readers re-read the store meanwhile)."""
        while not self._closing.is_set():
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                while not self._closing.is_set():
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=self.poll_s)
                    if message is None or message.get("type") != "message":
                        continue
                    try:
                        session = uuid.UUID(_text(message["data"]))
                    except ValueError:
                        continue
                    for listener in self._listeners:
                        listener(session)
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                log.warning("front end: the %s subscription failed, retrying: %s", self.spec.redacted, exc)
                try:
                    await asyncio.wait_for(self._closing.wait(), timeout=self.poll_s)
                except TimeoutError:
                    pass
            finally:
                try:
                    await pubsub.aclose()
                except (RedisConnectionError, RedisTimeoutError, OSError):
                    pass

    async def close(self) -> None:
        self._closing.set()
        if self._watcher is not None:
            self._watcher.cancel()
            try:
                await self._watcher
            except asyncio.CancelledError:
                pass
        await self.redis.aclose()
