"""``kvsp bench index``: the control plane's two hot HTTP paths, each against a baseline
measured in the same run.

* **Lookup** (kvsp-draft §6.2, ``POST {is}lookup``): lookups/s for prompts of
  ``prompt_blocks`` (default 64) Block Keys against a real Index Service
  (``kvsp_moq.control.index.serve.serve_index``) holding ``records`` (default 100 000) Replica
  Records, one per block, each listing ``layers`` layer digests (§4.4: REQUIRED to serve
  layer ranges, so a realistic record carries them). The store is filled directly in-process
  (``IndexStore.put`` on the service's own store: no HTTP PUTs); every prompt's keys are all
  present, so each lookup returns ``prompt_blocks`` matched blocks (the largest answer).
  The client is the control plane's own ``HttpIndexClient.lookup`` (aiohttp, JSON encode and
  I-JSON parse of the answer included). **Baseline**: the same lookups called in-process on
  the same ``IndexService`` (``service.lookup``: the store read and the records built, no
  HTTP, no JSON), so the ratio is what HTTP + JSON cost on top of the index itself.
* **Block GET** (§6.7, ``GET {h}blocks/...``): MB/s of a ``block_layers`` x ``layer_bytes``
  (default 32 x 1 MiB) raw block from the real holder (``serve_holder``) over loopback,
  read (a) as plain body chunks through ``HttpBlockFetcher`` (aiohttp) and (b) with full §6.7
  verification (``retrieval.retrieve_block``: Repr-Digest, every layer digest, the replica
  digest, size). **Baseline**: a raw TCP socket copy of the same number of bytes
  (``bench.baseline.tcp_copy``), same run.

With ``--store redis`` (``[index] store = "redis://..."``, index/redis_store.py), also:

* **Lookup on Redis**: the same HTTP lookups against an IS whose records are in Redis,
  beside the in-memory store's figure of the same run (ratio: the cost of the networked
  store; target >= 0.5).
* **Record refresh** (§6.1 "refresh records before expiry"): ``refresh_records`` (default
  100 000) records already at the IS (on Redis) are refreshed through the control plane's own
  ``HttpIndexClient.publish_many`` in batches of ``ReplicaPublisher``'s size (``POST
  {is}replicas:batch``, what ``ReplicaPublisher.refresh`` sends, one request at a time);
  **baselines**: single PUTs (``HttpIndexClient.publish``, as holders did before, timed on
  ``single_puts`` records) and the rate the TTL needs: every record once per refresh period,
  ``refresh_records / (ttl / 3)`` with the holder's default 60 s TTL.

  The batches of ``holders`` (default 4) holders are in flight at once, as a fleet's holders
  refresh side by side (one IS serves them all). The batched figure's params carry
  ``cpu_us_per_record``: the CPU time of the bench's process (the holders' client and the IS,
  not Redis) per refreshed record, which a busy machine moves less than it moves the rate.

With ``--store cluster`` (``store = "redis+cluster://..."``, docs/deploy.md "Redis Cluster"),
the same lookups (lookups/s, and the p50/p99 latency of one 64-block lookup beside the memory
store's) and the same refresh, on one IS over a Redis Cluster of 3 primaries and 3 replicas
(``bench.redis_cluster``), every write acknowledged by a replica (``store_wait_replicas = 1``),
beside one IS on the memory store in the same run.

With either store, then the same on ``kvsp index`` processes over it (``index_processes``: as
deployed, the IS is not in the holders' process), the bench's clients in its own process:
lookups/s with one client on one IS process (``_1is``) and with a client on each of two
processes at once (``_2is``, with their p50/p99), beside the memory store's; the refresh
through one process and then through two (the holders split between them), against the TTL's
need, and the two processes' rate against the one's (``is_refresh_batched_{store}_2is``: how
refreshes scale with IS processes). The records are written straight into the store first.

The bench starts its own ``redis-server`` (``bench.redis_process``) or cluster unless given a
URL; its keys are under their own prefix and deleted at the end.

This module lives in ``kvsp_moq.cli`` (not ``kvsp_moq.bench``) because it starts control-plane
servers, which ``kvsp_moq.bench`` may not import (tests/test_layering.py); its HTTP clients
are the control plane's own (``kvsp_moq.control.client.http``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import cast

import numpy as np
from redis.asyncio.cluster import RedisCluster

from ...bench.baseline import tcp_copy
from ...bench.report import Figure
from ...control.common.auth import Authorizer, Grant, Principal
from ...control.common.config import ControlConfig, HolderConfig, IndexConfig, TierConfig
from ...control.index.serve import INDEX_SERVICE, serve_index
from ...control.client.http import HttpBlockFetcher, HttpIndexClient
from ...control.holder.serve import serve_holder
from ...control.index.redis_store import RedisIndexStore
from ...control.index.service import IndexService
from ...control.index.store import IndexStore
from ...control.client.publisher import DEFAULT_BATCH
from ...control.common.store import parse_store
from ...bench.redis_cluster import RedisClusterProcess
from ...bench.redis_process import RedisProcess
from .index_processes import index_processes
from ...control.client.retrieval import BlockFetcher, block_url, retrieve_block
from ...kvsp.container import replica_digest
from ...kvsp.records import LookupRequest, ReplicaRecord, Residency
from ...storage import BlockStore, HostTier, RecordKey
from ...transport import new_event_loop

__all__ = ["run"]

_TOKEN = "bench-index-token".ljust(32, "x")
_PRINCIPAL = Principal("bench", scopes=Grant(everything=True), holders=Grant(everything=True))
_COMPAT = b"\x01" * 32
_SCOPE = b"\x02" * 16
_TTL_MS = 3_600_000  # nothing expires during a run
_HOLDERS = tuple(f"http://10.0.0.{i}:8080/kvsp/" for i in range(1, 5))


def _config() -> ControlConfig:
    return ControlConfig(auth=Authorizer.from_tokens({_TOKEN: _PRINCIPAL}),
                         index=IndexConfig(purge_interval_ms=0),
                         holder=HolderConfig(tiers=(TierConfig("host", 1 << 30),)))


def _key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest()


def _records(count: int, layers: int) -> list[ReplicaRecord]:
    """``count`` records, one per block, holders round-robin; the layer digests are shared
    (their values do not change the cost of a lookup, only their number does)."""
    digests = tuple(hashlib.sha256(b"layer %d" % i).digest() for i in range(layers))
    digest = replica_digest(digests)
    residency = (Residency(tier="host", layers=(0, layers - 1)),)
    return [
        ReplicaRecord(block_key=_key(i), compat_id=_COMPAT, scope_id=_SCOPE, holder=_HOLDERS[i % len(_HOLDERS)],
                      codec=1, size=(20 + 16 * layers) + layers * 2 * 4096, digest=digest,
                      layer_digests=digests, residency=residency, ttl_ms=_TTL_MS)
        for i in range(count)
    ]


def _prompts(records: int, prompt_blocks: int, count: int) -> list[LookupRequest]:
    """``count`` prompts, each ``prompt_blocks`` consecutive keys of one chain (all stored)."""
    chains = records // prompt_blocks
    rng = random.Random(7)
    out = []
    for _ in range(count):
        start = rng.randrange(chains) * prompt_blocks
        keys = tuple(_key(i) for i in range(start, start + prompt_blocks))
        out.append(LookupRequest(scope_id=_SCOPE, compat_id=_COMPAT, block_keys=keys))
    return out


async def _best_rate(once: Callable[[], Awaitable[None]], operations: int, repeat: int) -> float:
    """Operations/s of the fastest of ``repeat`` runs, after one warm-up run."""
    await once()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        await once()
        best = min(best, time.perf_counter() - start)
    return operations / best


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _measure_lookups(records: int, prompt_blocks: int, layers: int, lookups: int,
                           repeat: int, store: IndexStore | None = None,
                           latencies: list[float] | None = None) -> tuple[float, float]:
    """(HTTP lookups/s, in-process lookups/s) on ``store`` (default: the embedded one); the
    seconds of each HTTP lookup of the last run go to ``latencies``."""
    server = await serve_index(_config(), store=store)
    client = HttpIndexClient(server.url, _TOKEN)
    try:
        service: IndexService = server.app[INDEX_SERVICE]
        filled = _records(records, layers)
        for start in range(0, records, 1_000):  # straight into the service's store
            await service.store.put_many([(r, _TTL_MS) for r in filled[start:start + 1_000]])
        prompts = _prompts(records, prompt_blocks, lookups)

        async def over_http() -> None:
            times = []
            for request in prompts:
                began = time.perf_counter()
                answer = await client.lookup(request)
                times.append(time.perf_counter() - began)
                if answer.matched != prompt_blocks:
                    raise AssertionError(f"matched {answer.matched} of {prompt_blocks}")
            if latencies is not None:
                latencies[:] = times

        async def in_process() -> None:
            for request in prompts:
                answer = await service.lookup(_PRINCIPAL, request)
                if answer.matched != prompt_blocks:
                    raise AssertionError(f"matched {answer.matched} of {prompt_blocks}")

        http = await _best_rate(over_http, lookups, repeat)
        local = await _best_rate(in_process, lookups, repeat)
        return http, local
    finally:
        await client.close()
        await server.close()


#: Bound on the bench's store calls (and on WAIT, half of it): the default 2 s answers 503 when
#: a replica starved of CPU on a busy machine is a second late, which would end the run.
STORE_TIMEOUT_MS = 10_000
#: The bench's cluster declares a node failed after this long (the tests' 1 s would fail a
#: primary over when a busy machine leaves it without CPU for a second, mid-measurement).
_NODE_TIMEOUT_MS = 15_000
_REFRESH_TTL_MS = 60_000  # the holder's default record TTL; it refreshes every third of it


#: Holders whose refresh batches are in flight at once.
REFRESH_HOLDERS = 4


async def _refresh(clients: list[HttpIndexClient], records: list[ReplicaRecord]) -> float:
    """Records/s of one refresh of ``records`` in batches of ``ReplicaPublisher``'s size,
    :data:`REFRESH_HOLDERS` holders' batches in flight at once, holder ``h`` sending to
    ``clients[h % len(clients)]`` (a fleet's holders spread over the IS processes)."""
    chunks = [records[i:i + DEFAULT_BATCH] for i in range(0, len(records), DEFAULT_BATCH)]

    async def holder(h: int) -> None:
        client = clients[h % len(clients)]
        for chunk in chunks[h::REFRESH_HOLDERS]:
            await client.publish_many(chunk)

    start = time.perf_counter()
    await asyncio.gather(*(holder(h) for h in range(REFRESH_HOLDERS)))
    return len(records) / (time.perf_counter() - start)


def _refresh_records(records: int, layers: int) -> list[ReplicaRecord]:
    return [dataclasses.replace(r, ttl_ms=_REFRESH_TTL_MS) for r in _records(records, layers)]


async def _measure_refresh(store: IndexStore, records: int, single: int, layers: int) -> tuple[float, float, float]:
    """(records/s refreshed in batches, :data:`REFRESH_HOLDERS` batches in flight; records/s
    refreshed by single PUTs; this process's CPU microseconds per record of the batched
    refresh: the holders' client and the IS, not the store) at an IS on ``store`` holding
    ``records`` records (published first, untimed)."""
    server = await serve_index(_config(), store=store)
    client = HttpIndexClient(server.url, _TOKEN, timeout_s=60)
    try:
        recs = _refresh_records(records, layers)
        for first in range(0, records, DEFAULT_BATCH):  # the first publication
            await client.publish_many(recs[first:first + DEFAULT_BATCH])
        cpu = time.process_time()
        batched = await _refresh([client], recs)
        cpu_us = (time.process_time() - cpu) / records * 1e6
        began = time.perf_counter()
        for record in recs[:single]:
            await client.publish(record)
        return batched, single / (time.perf_counter() - began), cpu_us
    finally:
        await client.close()
        await server.close()


@dataclasses.dataclass
class _Processes:
    """What :func:`_measure_processes` measured on 1 and 2 ``kvsp index`` processes."""

    lookups_1: float
    lookups_2: float
    latencies_2: list[float]
    refresh_1: float
    refresh_2: float


async def _lookup_rate(clients: list[HttpIndexClient], prompts: list[LookupRequest], prompt_blocks: int,
                       repeat: int, latencies: list[float]) -> float:
    """Lookups/s of every client sending every prompt, one after the other, the clients at
    once; best of ``repeat`` after a warm-up; the seconds of each lookup of the best run go
    to ``latencies``."""

    async def one(client: HttpIndexClient, times: list[float]) -> None:
        for request in prompts:
            began = time.perf_counter()
            answer = await client.lookup(request)
            times.append(time.perf_counter() - began)
            if answer.matched != prompt_blocks:
                raise AssertionError(f"matched {answer.matched} of {prompt_blocks}")

    best = float("inf")
    for run in range(repeat + 1):
        times: list[list[float]] = [[] for _ in clients]
        start = time.perf_counter()
        await asyncio.gather(*(one(c, t) for c, t in zip(clients, times)))
        took = time.perf_counter() - start
        if run and took < best:  # run 0 warms up
            best, latencies[:] = took, [x for t in times for x in t]
    return len(clients) * len(prompts) / best


async def _measure_processes(url: str, records: int, prompt_blocks: int, layers: int, lookups: int,
                             repeat: int, refresh_records: int) -> _Processes:
    """Lookups and refreshes through 1 and then 2 ``kvsp index`` processes over the store at
    ``url`` (``index_processes``), the bench's clients in this process: the records are
    written straight into the store first (untimed)."""
    prefix = f"kvsp-bench-{uuid.uuid4().hex[:8]}:"
    store = RedisIndexStore.open(parse_store("index", url, key_prefix=prefix, timeout_ms=STORE_TIMEOUT_MS))
    try:
        async with index_processes(2, url, prefix, _TOKEN, store_timeout_ms=STORE_TIMEOUT_MS) as urls:
            clients = [HttpIndexClient(u, _TOKEN, timeout_s=60) for u in urls]
            try:
                filled = _records(records, layers)
                for start in range(0, records, 1_000):
                    await store.put_many([(r, _TTL_MS) for r in filled[start:start + 1_000]])
                prompts = _prompts(records, prompt_blocks, lookups)
                latencies: list[float] = []
                lookups_1 = await _lookup_rate(clients[:1], prompts, prompt_blocks, repeat, [])
                lookups_2 = await _lookup_rate(clients, prompts, prompt_blocks, repeat, latencies)
                await _drop(store)
                recs = _refresh_records(refresh_records, layers)
                for start in range(0, refresh_records, 1_000):  # the first publication, straight in
                    await store.put_many([(r, _REFRESH_TTL_MS) for r in recs[start:start + 1_000]])
                refresh_1 = await _refresh(clients[:1], recs)
                refresh_2 = await _refresh(clients, recs)
                return _Processes(lookups_1, lookups_2, latencies, refresh_1, refresh_2)
            finally:
                for client in clients:
                    await client.close()
    finally:
        await _drop(store)
        await store.close()


async def _measure_redis(url: str, records: int, prompt_blocks: int, layers: int, lookups: int, repeat: int,
                         refresh_records: int, single_puts: int,
                         latencies: list[float] | None = None) -> tuple[float, float, float, float]:
    """(HTTP lookups/s on Redis or a cluster, batched refresh records/s, single-PUT refresh
    records/s, CPU us per batched record in this process); the bench's keys (their own prefix) are deleted afterwards."""
    spec = parse_store("index", url, key_prefix=f"kvsp-bench-{uuid.uuid4().hex[:8]}:", timeout_ms=STORE_TIMEOUT_MS)
    store = RedisIndexStore.open(spec)
    try:
        http, _ = await _measure_lookups(records, prompt_blocks, layers, lookups, repeat, store=store,
                                         latencies=latencies)
        await _drop(store)
        batched, single, cpu_us = await _measure_refresh(store, refresh_records, single_puts, layers)
        return http, batched, single, cpu_us
    finally:
        await _drop(store)
        await store.close()


async def _drop(store: RedisIndexStore) -> None:
    if isinstance(store.redis, RedisCluster):  # every primary's keys, one key per UNLINK (slots)
        for node in store.redis.get_primaries():
            keys = [k async for k in store.redis.scan_iter(match=f"{store.spec.key_prefix}*", count=10_000,
                                                           target_nodes=node)]
            for start in range(0, len(keys), 1_000):
                pipe = store.redis.pipeline(transaction=False)
                for k in keys[start:start + 1_000]:
                    await pipe.unlink(k)
                await pipe.execute()
        return
    keys = [k async for k in store.redis.scan_iter(match=f"{store.spec.key_prefix}*", count=10_000)]
    for start in range(0, len(keys), 10_000):
        await store.redis.unlink(*keys[start:start + 10_000])


async def _measure_block_get(block_layers: int, layer_bytes: int, repeat: int) -> tuple[float, float]:
    """(plain GET MB/s, verified GET MB/s) of one raw block from the real holder."""
    rng = np.random.default_rng(3)
    half = layer_bytes // 2
    sections = [(rng.bytes(half), rng.bytes(half)) for _ in range(block_layers)]
    store = BlockStore([HostTier(4 * block_layers * layer_bytes)])
    key = RecordKey(_COMPAT, _SCOPE, _key(0))
    store.put_layers(key, sections, token_count=1)  # 1 token: sections of any length
    server = await serve_holder(_config(), "127.0.0.1", 0, store=store)
    fetcher = HttpBlockFetcher(_TOKEN, chunk_octets=1 << 20)
    try:
        record = store.info(key).replica_record(server.url, _TTL_MS)
        url = block_url(server.url, record)

        async def plain() -> None:
            got = 0
            async with fetcher.get(url) as response:
                if response.status != 200:
                    raise AssertionError(f"GET {url}: {response.status}")
                async for chunk in response.chunks():
                    got += len(chunk)
            if got != record.size:
                raise AssertionError(f"GET returned {got} of {record.size} octets")

        async def verified() -> None:
            # RetrievalFailed on any failed check; the cast as in control/instance/serve.py serve_instance
            await retrieve_block(cast(BlockFetcher, fetcher), [record])

        mb = record.size / 1e6
        return (await _best_rate(plain, 1, repeat) * mb, await _best_rate(verified, 1, repeat) * mb)
    finally:
        await fetcher.close()
        await server.close()


def run(records: int = 100_000, prompt_blocks: int = 64, layers: int = 32, lookups: int = 200,
        block_layers: int = 32, layer_bytes: int = 1 << 20, repeat: int = 3, store: str = "memory",
        redis_url: str | None = None, refresh_records: int = 100_000, single_puts: int = 5_000) -> list[Figure]:
    if records < prompt_blocks:
        raise ValueError(f"--records {records} is fewer than one prompt of {prompt_blocks} blocks")
    loop = new_event_loop(use_uvloop=True)
    try:
        memory_latencies: list[float] = []
        http, local = loop.run_until_complete(_measure_lookups(records, prompt_blocks, layers, lookups, repeat,
                                                               latencies=memory_latencies))
        plain, verified = loop.run_until_complete(_measure_block_get(block_layers, layer_bytes, repeat))
        on_redis: tuple[float, float, float, float] | None = None
        processes: _Processes | None = None
        store_latencies: list[float] = []
        if store in ("redis", "cluster"):
            with contextlib.ExitStack() as stack:
                server = RedisProcess() if store == "redis" else RedisClusterProcess(node_timeout_ms=_NODE_TIMEOUT_MS)
                url = redis_url if redis_url is not None else stack.enter_context(server)
                on_redis = loop.run_until_complete(_measure_redis(
                    url, records, prompt_blocks, layers, lookups, repeat, refresh_records, single_puts,
                    latencies=store_latencies))
                processes = loop.run_until_complete(_measure_processes(
                    url, records, prompt_blocks, layers, lookups, repeat, refresh_records))
    finally:
        loop.close()
    block = block_layers * layer_bytes
    data = np.random.default_rng(2).integers(0, 256, block, dtype=np.uint8).tobytes()
    tcp_s = min(tcp_copy(data, layer_bytes)[0] for _ in range(max(repeat, 3)))
    tcp = block / tcp_s / 1e6
    lookup_params: dict[str, object] = {"records": records, "prompt_blocks": prompt_blocks,
                                        "layer_digests": layers, "lookups": lookups}
    block_params: dict[str, object] = {"layers": block_layers, "layer_bytes": layer_bytes}
    figures = [
        Figure("is_lookup_http", "lookups/s", http, "is_lookup_in_process", local, params=lookup_params),
        Figure("holder_block_get", "MB/s", plain, "tcp_copy", tcp, params=block_params),
        Figure("holder_block_get_verified", "MB/s", verified, "tcp_copy", tcp, params=block_params),
    ]
    if on_redis is not None:
        on_redis_http, batched, single, cpu_us = on_redis
        needed = refresh_records / (_REFRESH_TTL_MS / 3 / 1000)
        refresh_params: dict[str, object] = {"records": refresh_records, "batch": DEFAULT_BATCH,
                                             "single_puts": single_puts, "ttl_ms": _REFRESH_TTL_MS,
                                             "layer_digests": layers, "holders": REFRESH_HOLDERS}
        figures += [
            Figure(f"is_lookup_http_{store}", "lookups/s", on_redis_http, "is_lookup_http", http, params=lookup_params),
            Figure(f"is_refresh_batched_{store}", "records/s", batched, f"is_refresh_single_put_{store}", single,
                   params=refresh_params | {"cpu_us_per_record": round(cpu_us, 1)}),
            Figure(f"is_refresh_vs_ttl_{store}", "records/s", batched, "refresh_needed", needed,
                   params=refresh_params),
        ]
        if store == "cluster":
            figures += [
                Figure(f"is_lookup_p{q}_ms_cluster", "ms", _percentile(store_latencies, q / 100) * 1000,
                       f"is_lookup_p{q}_ms_memory", _percentile(memory_latencies, q / 100) * 1000,
                       params=lookup_params)
                for q in (50, 99)
            ]
        if processes is not None:  # 1 and 2 `kvsp index` processes over the store
            figures += [
                Figure(f"is_lookup_http_{store}_1is", "lookups/s", processes.lookups_1, "is_lookup_http", http,
                       params=lookup_params),
                Figure(f"is_lookup_http_{store}_2is", "lookups/s", processes.lookups_2, "is_lookup_http", http,
                       params=lookup_params | {"clients": 2}),
                *(Figure(f"is_lookup_p{q}_ms_{store}_2is", "ms", _percentile(processes.latencies_2, q / 100) * 1000,
                         f"is_lookup_p{q}_ms_memory", _percentile(memory_latencies, q / 100) * 1000,
                         params=lookup_params | {"clients": 2})
                  for q in (50, 99)),
                Figure(f"is_refresh_vs_ttl_{store}_1is", "records/s", processes.refresh_1, "refresh_needed", needed,
                       params=refresh_params),
                Figure(f"is_refresh_vs_ttl_{store}_2is", "records/s", processes.refresh_2, "refresh_needed", needed,
                       params=refresh_params),
                Figure(f"is_refresh_batched_{store}_2is", "records/s", processes.refresh_2,
                       f"is_refresh_batched_{store}_1is", processes.refresh_1, params=refresh_params),
            ]
    return figures
