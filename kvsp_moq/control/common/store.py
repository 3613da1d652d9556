"""Where a role keeps the state that must outlive its process (DESIGN.md §8).

Each role section of the configuration names its store with one key:

```toml
[index]                                 # likewise [holder], [pc], [frontend]
store = "memory"                        # the embedded default: state lives and dies with the process
# store = "redis://127.0.0.1:6379/0"    # Redis (or Valkey): state survives restarts, processes share it
# store = "rediss://:PASSWORD@redis.example:6380/2"   # TLS, verified against the system trust store
# store = "redis+cluster://10.0.0.1:6379,10.0.0.2:6379"  # Redis Cluster: any of its nodes (rediss+cluster://: TLS)
store_password_file = "redis.pass"      # the password read from a file (relative to the config)
store_timeout_ms = 2000                 # every store call gives up after this: 503 kvsp-unavailable
store_key_prefix = "kvsp:"              # keys of this deployment (several may share one Redis)
store_wait_replicas = 1                 # a write is acknowledged once this many replicas have it
                                        # (WAIT; default 1 on a cluster, 0 on one Redis)
```

:func:`parse_store` validates the key (:class:`~.errors.ConfigError` names it);
:func:`open_redis` opens a client whose every call is bounded by the timeout (a
``redis.asyncio.cluster.RedisCluster`` for a cluster, which follows MOVED/ASK and topology
changes; each store's keys carry a hash tag that keeps each of its scripts in one slot);
:func:`~.store_scripts.run_scripts` acknowledges a write once ``wait_replicas`` replicas have it; and
:func:`store_call` turns a store that cannot be reached into :class:`~.errors.StoreUnavailable`,
which the HTTP layer sends as 503 ``kvsp-unavailable`` with ``Retry-After``.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeAlias, TypeVar
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import (ClusterDownError, ReadOnlyError, RedisClusterUnreachableError, SlotNotCoveredError,
                              TryAgainError)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .errors import ConfigError, StoreUnavailable

MEMORY = "memory"
REDIS_SCHEMES = ("redis", "rediss")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
DEFAULT_TIMEOUT_MS = 2_000
DEFAULT_KEY_PREFIX = "kvsp:"
#: Tries of a cluster call that met a dead node, a ``CLUSTERDOWN`` or a slot being moved,
#: after the first: enough to follow a failover the cluster finished, few enough to stay bounded.
CLUSTER_RETRIES = 3

#: What a role's store talks to: one Redis (or a Sentinel-managed address), or a cluster.
StoreClient: TypeAlias = "Redis | RedisCluster"
#: Errors of a store that cannot serve now (unreachable, hung, failing over): 503.
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError, RedisTimeoutError, OSError, TimeoutError, ReadOnlyError, ClusterDownError,
    TryAgainError, SlotNotCoveredError, RedisClusterUnreachableError)

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class StoreSpec:
    """A validated ``store`` setting. ``url`` is None for the embedded store; ``nodes`` are the
    seed nodes of a cluster (empty for one Redis)."""

    url: str | None = None
    password_file: Path | None = None
    timeout_ms: int = DEFAULT_TIMEOUT_MS
    key_prefix: str = DEFAULT_KEY_PREFIX
    nodes: tuple[tuple[str, int], ...] = ()
    #: Replicas a write must reach before it is acknowledged (``WAIT``, see :func:`replicated`).
    wait_replicas: int = 0

    @property
    def is_memory(self) -> bool:
        return self.url is None

    @property
    def is_cluster(self) -> bool:
        return bool(self.nodes)

    @property
    def redacted(self) -> str:
        """The URL without its password, for logs and errors."""
        if self.url is None:
            return MEMORY
        parts = urlsplit(self.url)
        creds, _, hosts = parts.netloc.rpartition("@")
        if not self.is_cluster:
            host = parts.hostname or ""
            hosts = f"{host}:{parts.port}" if parts.port else host
        netloc = f"***@{hosts}" if creds else hosts
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _node(section: str, text: str) -> tuple[str, int]:
    """``HOST:PORT`` of a cluster URL (``[v6]:PORT`` too)."""
    parts = urlsplit(f"//{text}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or parts.username is not None:
        raise ConfigError(f"{section}.store", f"the cluster node {text!r} is not HOST:PORT")
    return parts.hostname, port


def _cluster_nodes(section: str, value: str) -> tuple[tuple[str, int], ...]:
    parts = urlsplit(value)
    hosts = parts.netloc.rpartition("@")[2]
    if not hosts:
        raise ConfigError(f"{section}.store", 'must be "redis+cluster://HOST:PORT[,HOST:PORT...]"')
    if parts.path not in ("", "/", "/0"):
        raise ConfigError(f"{section}.store", "a cluster has only database 0: no other path")
    return tuple(_node(section, h) for h in hosts.split(","))


def parse_store(section: str, value: object, *, password_file: object = None,
                timeout_ms: object = DEFAULT_TIMEOUT_MS, key_prefix: object = DEFAULT_KEY_PREFIX,
                wait_replicas: object = None, base_dir: Path | None = None) -> StoreSpec:
    """The store of one role section; :class:`ConfigError` names the key at fault.
    ``wait_replicas`` None is the default: 1 on a cluster, 0 on one Redis."""
    if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) or timeout_ms < 1:
        raise ConfigError(f"{section}.store_timeout_ms", "must be an integer >= 1")
    if not isinstance(key_prefix, str) or not key_prefix or any(c.isspace() for c in key_prefix):
        raise ConfigError(f"{section}.store_key_prefix", "must be a non-empty string without spaces")
    if wait_replicas is not None and (isinstance(wait_replicas, bool) or not isinstance(wait_replicas, int)
                                      or not 0 <= wait_replicas <= 16):
        raise ConfigError(f"{section}.store_wait_replicas", "must be an integer from 0 to 16")
    if value == MEMORY:
        if password_file is not None:
            raise ConfigError(f"{section}.store_password_file", "only with a redis:// store")
        return StoreSpec(timeout_ms=timeout_ms, key_prefix=key_prefix)
    if not isinstance(value, str):
        raise ConfigError(f"{section}.store", 'must be "memory", a redis:// or rediss:// URL or a redis+cluster:// one')
    parts = urlsplit(value)
    nodes: tuple[tuple[str, int], ...] = ()
    if parts.scheme in CLUSTER_SCHEMES:
        nodes = _cluster_nodes(section, value)
    elif parts.scheme not in REDIS_SCHEMES or not parts.hostname:
        raise ConfigError(f"{section}.store", 'must be "memory", a redis://HOST:PORT/DB or rediss:// URL, '
                                              'or redis+cluster://HOST:PORT[,HOST:PORT...]')
    else:
        try:
            parts.port
        except ValueError:
            raise ConfigError(f"{section}.store", "has an invalid port") from None
        db = parts.path.lstrip("/")
        if db and not db.isdigit():
            raise ConfigError(f"{section}.store", "the path must be a database number (/0, /1, ...)")
    if parts.query or parts.fragment:
        raise ConfigError(f"{section}.store", "takes no query or fragment")
    path: Path | None = None
    if password_file is not None:
        if not isinstance(password_file, str) or not password_file:
            raise ConfigError(f"{section}.store_password_file", "must be a file name")
        if parts.password:
            raise ConfigError(f"{section}.store_password_file", "the URL already has a password")
        path = Path(password_file)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
    wait = (1 if nodes else 0) if wait_replicas is None else wait_replicas
    return StoreSpec(url=value, password_file=path, timeout_ms=timeout_ms, key_prefix=key_prefix, nodes=nodes,
                     wait_replicas=wait)


def _password(spec: StoreSpec) -> str | None:
    if spec.password_file is None:
        return None
    try:
        text = spec.password_file.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError("store_password_file", f"{spec.password_file}: {exc.strerror or exc}") from None
    if not text:
        raise ConfigError("store_password_file", f"{spec.password_file} is empty")
    return text


def _open_cluster(spec: StoreSpec, timeout: float) -> RedisCluster:
    """A cluster client: MOVED/ASK are followed, a dead node or a ``CLUSTERDOWN`` refreshes the
    topology and retries (at most :data:`CLUSTER_RETRIES` times, each bounded by the timeout)."""
    assert spec.url is not None
    parts = urlsplit(spec.url)
    creds = parts.netloc.rpartition("@")[0]
    user, _, password = creds.partition(":")
    secret = _password(spec) or (unquote(password) if password else None)
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in spec.nodes],
        username=unquote(user) or None,
        password=secret,
        ssl=parts.scheme == "rediss+cluster",
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=CLUSTER_RETRIES),
        health_check_interval=0,
        decode_responses=False,
    )


def open_redis(spec: StoreSpec) -> StoreClient:
    """A Redis client for ``spec`` (not yet connected: the first call connects). Connecting
    and every reply are bounded by ``spec.timeout_ms``. A connection the server closed (a
    restarted Redis) is replaced once, at once; a timeout is not retried, so a hung Redis
    costs a caller at most about twice the timeout before :class:`StoreUnavailable`. A
    cluster (``redis+cluster://``) gets redis-py's cluster client (:func:`_open_cluster`)."""
    if spec.url is None:
        raise ValueError("the embedded store has no Redis client")
    timeout = spec.timeout_ms / 1000
    if spec.is_cluster:
        return _open_cluster(spec, timeout)
    parts = urlsplit(spec.url)
    password = _password(spec)
    url = spec.url
    if password is not None:
        user = quote(unquote(parts.username or ""), safe="")
        netloc = f"{user}:{quote(password, safe='')}@{parts.netloc.rpartition('@')[2]}"
        url = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    client: Redis = Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry_on_timeout=False,
        retry=Retry(NoBackoff(), retries=1, supported_errors=(RedisConnectionError,)),
        health_check_interval=0,
        decode_responses=False,
    )
    return client


def unavailable(spec: StoreSpec, exc: BaseException) -> StoreUnavailable:
    return StoreUnavailable(f"the store {spec.redacted} is unavailable: {type(exc).__name__}: {exc}")


def store_call(spec_of: Callable[[Any], StoreSpec]) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:
    """Decorate a store method: a store that cannot be reached, does not answer within its
    timeout, or is failing over (a cluster's ``CLUSTERDOWN``, a replica's ``READONLY``) raises
    :class:`StoreUnavailable` (503) instead of a client library error. ``spec_of(self)`` gives
    the store's spec."""

    def wrap(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
        @functools.wraps(fn)
        async def call(*args: P.args, **kwargs: P.kwargs) -> T:
            try:
                return await fn(*args, **kwargs)
            except UNAVAILABLE_ERRORS as exc:
                raise unavailable(spec_of(args[0]), exc) from exc

        return call

    return wrap
