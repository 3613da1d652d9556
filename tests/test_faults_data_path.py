"""Faults on the instance's data path (issue 19), with real peers: a MOQT relay process, faulty
holder processes (``tests/fault_moqt_peer.py``), the IS and the HTTP holder on 127.0.0.1, and
instances running the reference model (tests/faults_support.py).

Each test asserts the outcome — the blocks came from the next source (the HTTP holder), the
output equals the output of a cold run, nothing bad was placed — and its bound: the engine's
recorded time to first token, which contains the whole load, stays within the idle timeout
plus slack, far below the per-request timeout a stalled source would otherwise cost.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from kvsp_moq.control.http.server import RunningServer  # noqa: E402
from kvsp_moq.control.instance.serve import INSTANCE_SERVICE  # noqa: E402
from kvsp_moq.kvsp.records import PrefetchBlock, PrefetchDirective  # noqa: E402
from kvsp_moq.moqt.errors import RequestErrorCode  # noqa: E402
from kvsp_moq.pubsub import MoqtError  # noqa: E402
from kvsp_moq.storage import RecordKey  # noqa: E402
from faults_support import (  # noqa: E402
    IDLE_S,
    REQUEST_S,
    SLACK_S,
    Child,
    Cluster,
    FaultyStore,
    cluster_of,
    engine_of,
    everyone,
    model_dir,
    peer_blocks,
    request,
    sources,
    store_of,
    within,
)

__all__ = ["model_dir"]  # the module-scoped fixture, used by name


@pytest.fixture
async def cluster(tmp_path: Path, model_dir: Path) -> AsyncIterator[Cluster]:
    async for c in cluster_of(tmp_path, model_dir):
        yield c


async def cold_run(cluster: Cluster, **kw: object) -> tuple[object, list[RecordKey], object]:
    """Instance A computes the prompt (its blocks published per ``kw``): (A, keys, result)."""
    a = await cluster.instance(**kw)  # type: ignore[arg-type]
    cold = await within(engine_of(a).generate(everyone(), request()))
    keys = cluster.keys()[: len(cold.blocks)]
    assert sources(cold) == ["recomputed"] * len(keys) and len(keys) >= 3
    return a, keys, cold


def assert_bound(result: object) -> None:
    """The load ended within the idle timeout (+ slack), not the per-request timeout."""
    ttft_s = result.ttft_ms / 1000  # type: ignore[attr-defined]
    assert ttft_s <= IDLE_S + SLACK_S < REQUEST_S, ttft_s


@dataclass
class FromFaultyHolder:
    """A computed the prompt (no relay: its store and the HTTP holder have the blocks); a
    faulty holder process serves the same replicas, its records (true digests) at the IS as
    a holder publishes them; B (loading moqt:// replicas through its pool) then ran it."""

    relay: Child
    a: RunningServer
    keys: list[RecordKey]
    cold: Any
    peer: Child
    b: RunningServer
    warm: Any


async def from_faulty_holder(cluster: Cluster, mode: str) -> FromFaultyHolder:
    relay = await cluster.relay()
    a, keys, cold = await cold_run(cluster)
    peer = await cluster.faulty_holder(mode, peer_blocks(store_of(a), keys))
    for key in keys:
        info = store_of(a).get(key)
        assert info is not None
        await cluster.index_client.publish(info.replica_record(peer.url, 60_000))
    b = await cluster.instance(relay=relay)
    warm = await within(engine_of(b).generate(everyone(), request()))
    # the blocks came from the next source, the HTTP replicas, and the output is a cold run's
    assert sources(warm) == ["http"] * len(keys) and engine_of(b).counters.moqt_fallbacks >= 1
    assert [t.token for t in warm.tokens] == [t.token for t in cold.tokens]
    assert_bound(warm)
    return FromFaultyHolder(relay, a, keys, cold, peer, b, warm)


async def test_a_holder_that_stalls_mid_layer_is_left_after_the_idle_timeout(cluster: Cluster) -> None:
    run = await from_faulty_holder(cluster, "stall:1")
    a, b, keys, peer, relay = run.a, run.b, run.keys, run.peer, run.relay
    # every block's FETCH got layer 0 and half of layer 1, then silence: each left after IDLE_S
    assert (await peer.line("stalled")).startswith("stalled")
    # what was placed is the true replica (the stalled layer's half was never exposed)
    for key in keys:
        assert store_of(b).get(key).digest == store_of(a).get(key).digest  # type: ignore[union-attr]

    # Prefetch directives (§6.5) naming the stalled holder: the instance leaves it after the
    # idle timeout; nothing waits on it until the directive's deadline.
    c = await cluster.instance(relay=relay)
    only_stalled = await directive_run(c, keys, (peer.url,))
    assert only_stalled[0].state == "failed" and "idle timeout" in (only_stalled[0].error or "")
    then_holder = await directive_run(c, keys, (peer.url, cluster.holder.url))
    assert then_holder[0].state == "complete", then_holder[0].error
    assert [bytes(k) for k in then_holder[0].loaded] == [k.block_key for k in keys]
    assert engine_of(c).counters.prefetch_http.blocks == len(keys)
    for _, elapsed in (only_stalled, then_holder):
        assert elapsed <= IDLE_S + SLACK_S < REQUEST_S, elapsed


async def directive_run(instance: RunningServer, keys: list[RecordKey], holders: tuple[str, ...]) -> tuple[Any, float]:
    """A §6.5 directive for ``keys`` from ``holders`` (deadline: REQUEST_S), run to its end:
    (its run, seconds it took)."""
    directive = PrefetchDirective(
        directive=uuid.uuid4(), scope_id=keys[0].scope_id, compat_id=keys[0].compat_id,
        blocks=tuple(PrefetchBlock(block_key=k.block_key, sources=holders) for k in keys),
        deadline_ms=int(REQUEST_S * 1000), lease_ms=30_000)
    loop = asyncio.get_running_loop()
    started = loop.time()
    run = instance.app[INSTANCE_SERVICE].prefetch.start(directive)
    await within(run.done.wait())
    return run, loop.time() - started


async def test_a_flipped_bit_is_caught_by_the_layer_digest_and_never_placed(cluster: Cluster) -> None:
    run = await from_faulty_holder(cluster, "flip:2")
    a, b, keys = run.a, run.b, run.keys
    # layer 2 failed its digest at every block: each block was re-fetched over HTTP (above)
    assert (await run.peer.line("flipped")).startswith("flipped")
    for key in keys:  # B kept the blocks: the true replicas, never the corrupted layer
        held, true = store_of(b).get(key), store_of(a).get(key)
        assert held is not None and true is not None
        assert held.digest == true.digest and held.layer_digests == true.layer_digests
        assert bytes(store_of(b).layer_payload(key, 2, touch=False)) == bytes(store_of(a).layer_payload(key, 2, touch=False))


async def test_the_relay_sigkilled_mid_block_the_instance_falls_over_to_http(cluster: Cluster) -> None:
    relay = await cluster.relay()
    store = FaultyStore()
    a, keys, cold = await cold_run(cluster, relay=relay, store=store)  # A publishes through the relay
    b = await cluster.instance(relay=relay)
    killed: list[tuple[bytes, int]] = []

    def kill_the_relay(key: RecordKey, layer: int) -> None:
        # The relay is FETCHing this block from A's MoqtHolder (B's cold FETCH, forwarded):
        # layers 0 and 1 are on their way through it; now it dies, mid-block.
        if layer == 2 and not killed:
            killed.append((key.block_key, layer))
            os.kill(relay.proc.pid, signal.SIGKILL)

    store.fault = kill_the_relay
    eb = engine_of(b)
    warm = await within(eb.generate(everyone(), request()))
    assert killed and await within(relay.proc.wait()) == -signal.SIGKILL
    assert sources(warm) == ["http"] * len(keys) and eb.counters.moqt_fallbacks >= 1
    assert [t.token for t in warm.tokens] == [t.token for t in cold.tokens]  # type: ignore[attr-defined]
    assert_bound(warm)


async def test_a_holder_evicting_mid_fetch_withdraws_first_and_the_reader_falls_over(
        cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    relay = await cluster.relay()
    store = FaultyStore()
    a, keys, cold = await cold_run(cluster, relay=relay, store=store)
    b = await cluster.instance(relay=relay)
    victim = keys[1]
    evicted: list[bytes] = []  # the replica id of the evicted replica

    def evict(key: RecordKey, layer: int) -> None:
        # A fault at A (its tier failing) while the relay FETCHes the block: evicted mid-FETCH,
        # leased or not; the store's evict listeners withdraw first (the relay namespace, the
        # IS records), then the octets go, and the next read of the FETCH finds nothing.
        if key == victim and layer == 2 and not evicted:
            info = store.get(key)
            assert info is not None
            evicted.append(info.replica_id)
            store.remove(key, force=True)

    store.fault = evict
    eb = engine_of(b)
    warm = await within(eb.generate(everyone(), request()))
    assert evicted
    assert sources(warm)[1] == "http" and eb.counters.moqt_fallbacks >= 1
    # the holder's FETCH server reset the stream with one warning, no traceback (an eviction is routine)
    served = [r for r in caplog.records if r.name == "kvsp_moq.pubsub.fetch_server"]
    assert [r.levelname for r in served] == ["WARNING"] and served[0].exc_info is None
    assert "no longer stored" in served[0].getMessage()
    assert [t.token for t in warm.tokens] == [t.token for t in cold.tokens]  # type: ignore[attr-defined]
    assert_bound(warm)
    # the withdrawals reached the IS: no lookup sends a reader to A's replica any more
    service, ea = a.app[INSTANCE_SERVICE], engine_of(a)
    assert service.prefetch.publisher is not None and ea.publisher.moqt_records is not None
    await within(service.prefetch.publisher.flush())
    await within(ea.publisher.moqt_records.flush())
    looked = await cluster.lookup(keys)
    assert {r.holder for r in looked.blocks[1].replicas} == {cluster.holder.url, b.app[INSTANCE_SERVICE].url}
    assert {service.url, relay.url} <= {r.holder for r in looked.blocks[0].replicas}  # the others stay
    # and the relay no longer routes to it: a FETCH of the evicted replica is DOES_NOT_EXIST
    # (binding §5: a cache miss), never bytes of a replica that is gone
    assert eb.pool is not None
    session = await within(eb.pool.get(relay.url))
    name = victim.block_name(evicted[0])
    with pytest.raises(MoqtError) as refused:
        stream = await within(session.fetch(name.namespace_fields(), "raw", start=(0, 0), end=(0, 3)))
        await within(stream.collect())
    assert refused.value.code == RequestErrorCode.DOES_NOT_EXIST, refused.value
