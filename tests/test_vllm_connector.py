"""The KVSP connector in real vLLM engines (issue 15; docs/vllm.md).

Two engine processes (``engine_process``, vLLM on CPU with the tiny local Llama, block size
32, vLLM's own prefix cache off so every repeat goes through the connector) share one
loopback cluster: a real Index Service and HTTP holder, and the MOQT relay as a child process
(tests/vllm_support.py). Engine A computes and publishes; engine B loads. Each engine starts
once for the module (about a minute each here) and serves every case. "B with the connector
off" is engine B with ``kv_transfer_params={"kvsp": false}`` on that request.

Skipped, with the reason, where vLLM is not installed (the ``vllm`` extra).
"""

from __future__ import annotations

import importlib.util
import random
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

# Only the engine processes import vLLM (importing it here would configure this process).
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install -e '.[vllm]', docs/vllm.md)", allow_module_level=True)

from kvsp_moq.bridge import MoqtHolder  # noqa: E402
from kvsp_moq.control.common.tls import TlsConfig  # noqa: E402
from kvsp_moq.integrations.vllm.engine_process import EngineProcess, EngineSpec  # noqa: E402
from kvsp_moq.integrations.vllm.settings import connector_extra_config, kv_transfer_config  # noqa: E402
from kvsp_moq.integrations.vllm.tiny_model import TinyLlama, write_tiny_llama  # noqa: E402
from kvsp_moq.kvsp.blockkeys import block_keys  # noqa: E402
from kvsp_moq.kvsp.container import replica_digest  # noqa: E402
from kvsp_moq.kvsp.hexids import format_digest  # noqa: E402
from kvsp_moq.kvsp.layout import Geometry, encode_raw_block  # noqa: E402
from kvsp_moq.kvsp.records import ReplicaRecord  # noqa: E402
from kvsp_moq.kvsp.registries import ELEMENT_TYPES  # noqa: E402
from kvsp_moq.kvsp.scope import scope_id  # noqa: E402
from kvsp_moq.storage import BlockStore, HostTier, RecordKey  # noqa: E402

from vllm_support import LoopbackCluster  # noqa: E402

B = 32
SCOPES = {"tenant-a": bytes(range(32)), "tenant-b": bytes(range(100, 132))}
SHAPE = TinyLlama()


@pytest.fixture(scope="module")
def cluster() -> Iterator[LoopbackCluster]:
    c = LoopbackCluster()
    yield c
    c.close()


@pytest.fixture(scope="module")
def engines(cluster: LoopbackCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), SHAPE)
    extra = connector_extra_config(
        index_url=cluster.index_url, relay_url=cluster.relay_url, holder_url=cluster.holder_url,
        index_token=cluster.token, holder_token=cluster.token, moqt_token=cluster.token,
        ca_file=str(cluster.tls.ca_file), scopes=SCOPES, default_scope="tenant-a",
        deadline_ms=20_000, moqt_timeout_ms=1_500)
    spec = EngineSpec(str(model), block_size=B, kv_transfer_config=kv_transfer_config(extra))
    logs = tmp_path_factory.mktemp("engine-logs")
    a = EngineProcess(spec, name="engine A", stderr=open(logs / "a.log", "w"))  # noqa: SIM115 (closed with the process)
    b = EngineProcess(spec, name="engine B", stderr=open(logs / "b.log", "w"))  # noqa: SIM115
    try:
        errors: list[BaseException] = []

        def ready(engine: EngineProcess) -> None:
            try:
                engine.wait_ready(900)
            except BaseException as exc:  # reported below
                errors.append(exc)

        waiters = [threading.Thread(target=ready, args=(e,)) for e in (a, b)]
        for t in waiters:
            t.start()
        for t in waiters:
            t.join()
        if errors:
            raise errors[0]
        yield a, b
    finally:
        a.close()
        b.close()


def prompt(seed: int, length: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, SHAPE.vocab) for _ in range(length)]


def kvsp(answer: dict[str, Any]) -> dict[str, Any]:
    params = answer.get("kv_transfer_params") or {}
    stats: dict[str, Any] = params.get("kvsp") or {}
    return stats


def off(engine: EngineProcess, tokens: list[int]) -> list[int]:
    answer = engine.generate(tokens, max_tokens=8, kv_transfer_params={"kvsp": False})
    assert kvsp(answer) == {}
    out: list[int] = answer["token_ids"]
    return out


def test_long_prompt_loads_every_full_block_over_moqt_through_the_relay(
        cluster: LoopbackCluster, engines: tuple[EngineProcess, EngineProcess]) -> None:
    a, b = engines
    p = prompt(1, 300)  # 9 full blocks and 12 tokens
    from_a = a.generate(p, max_tokens=8)
    assert kvsp(from_a)["blocks_published"] == 9
    assert kvsp(from_a)["external_tokens"] == 0
    before = cluster.relay_stats()
    from_b = b.generate(p, max_tokens=8)
    after = cluster.relay_stats()
    stats = kvsp(from_b)
    assert stats["external_tokens"] == 9 * B
    assert stats["blocks_moqt"] == 9 and "blocks_failed" not in stats and "blocks_http" not in stats
    assert stats["bytes_moqt"] == 9 * SHAPE.layers * 2 * B * SHAPE.kv_heads * SHAPE.head_dim * 4
    # Every block through the relay: one FETCH each, every layer an object out of it.
    assert after["relay_fetches_total"] - before["relay_fetches_total"] >= 9
    assert after["relay_objects_out_total"] - before["relay_objects_out_total"] >= 9 * SHAPE.layers
    assert from_b["token_ids"] == from_a["token_ids"] == off(b, p)


def test_a_prompt_sharing_the_first_blocks_loads_only_those(engines: tuple[EngineProcess, EngineProcess]) -> None:
    a, b = engines
    p = prompt(2, 200)
    a.generate(p, max_tokens=2)
    q = p[: 3 * B] + prompt(3, 70)  # the first 3 blocks shared, then other tokens
    stats = kvsp(from_b := b.generate(q, max_tokens=8))
    assert stats["external_tokens"] == 3 * B
    assert stats["matched_blocks"] == 3 and stats["blocks_moqt"] == 3
    assert from_b["token_ids"] == off(b, q)


def test_a_full_hit_leaves_the_last_block_to_compute(engines: tuple[EngineProcess, EngineProcess]) -> None:
    a, b = engines
    p = prompt(4, 4 * B)  # exactly 4 blocks: vLLM must still compute one token
    a.generate(p, max_tokens=2)
    stats = kvsp(from_b := b.generate(p, max_tokens=8))
    assert stats["matched_blocks"] == 4 and stats["external_tokens"] == 3 * B
    assert from_b["token_ids"] == off(b, p)


def test_two_scopes_do_not_share(engines: tuple[EngineProcess, EngineProcess]) -> None:
    a, b = engines
    p = prompt(5, 150)
    published = kvsp(a.generate(p, max_tokens=2, kv_transfer_params={"kvsp_scope": "tenant-b"}))
    assert published["scope"] == "tenant-b" and published["blocks_published"] == 4
    other = kvsp(b.generate(p, max_tokens=2))  # the default scope, tenant-a
    assert other["scope"] == "tenant-a" and other["external_tokens"] == 0 and other["matched_blocks"] == 0
    unknown = b.generate(p, max_tokens=2, kv_transfer_params={"kvsp_scope": "tenant-z"})
    assert kvsp(unknown) == {}  # a scope not configured shares nothing
    same = b.generate(p, max_tokens=8, cache_salt="tenant-b")  # the scope named by cache_salt
    assert kvsp(same)["scope"] == "tenant-b" and kvsp(same)["external_tokens"] == 4 * B
    assert same["token_ids"] == off(b, p)


class LyingStore(BlockStore):
    """A holder's store that serves other octets for layer 2 than it recorded: its records and
    Track Properties carry the true digests, the wire does not (a corrupted holder)."""

    def layer_payload(self, key: RecordKey, layer: int, *, touch: bool = True) -> memoryview:
        payload = super().layer_payload(key, layer, touch=touch)
        if layer != 2:
            return payload
        bad = bytearray(payload)
        bad[100] ^= 0xFF
        return memoryview(bytes(bad))


def random_block(store: BlockStore, cluster: LoopbackCluster, compat: bytes, tokens: list[int]) -> tuple[RecordKey, MoqtHolder]:
    """A block of random octets for the first block of ``tokens`` in ``store``, served through
    the relay by a MOQT holder of this process."""
    key = RecordKey(compat, scope_id(SCOPES["tenant-a"]), block_keys(SCOPES["tenant-a"], compat, tokens, B)[0])
    geometry = Geometry(SHAPE.kv_heads, SHAPE.head_dim, ELEMENT_TYPES["fp32"])
    rnd = np.random.default_rng(0)
    layers = [(rnd.standard_normal((B, SHAPE.kv_heads, SHAPE.head_dim), dtype=np.float32),
               rnd.standard_normal((B, SHAPE.kv_heads, SHAPE.head_dim), dtype=np.float32))
              for _ in range(SHAPE.layers)]
    store.put(key, encode_raw_block(layers, geometry))
    return key, MoqtHolder(store)


async def attach(cluster: LoopbackCluster, holder: MoqtHolder, key: RecordKey) -> ReplicaRecord:
    transport = TlsConfig().transport(ca_file=str(cluster.tls.ca_file))
    await holder.attach_relay(cluster.relay_url, transport, setup_tokens=(cluster.token,))
    holder.publish(key)
    await holder.wait_announced()
    return holder.replica_record(key, holder=cluster.relay_url, ttl_ms=60_000)


def test_a_layer_tampered_in_transit_is_recomputed(cluster: LoopbackCluster,
                                                   engines: tuple[EngineProcess, EngineProcess]) -> None:
    """Layers 0 and 1 verify (random octets, written into B's paged cache), layer 2 fails its
    digest mid-transfer: the block is reported and vLLM recomputes the request from it."""
    a, b = engines
    p = prompt(9, 2 * B + 5)
    compat = bytes.fromhex(kvsp(a.generate(prompt(7, 40), max_tokens=1))["compat_id"])
    key, holder = random_block(LyingStore([HostTier(1 << 20)]), cluster, compat, p)

    async def publish() -> None:
        await cluster.index.publish(await attach(cluster, holder, key))

    try:
        cluster.run(publish())
        stats = kvsp(from_b := b.generate(p, max_tokens=8))
        assert stats["matched_blocks"] == 1 and stats["external_tokens"] == B
        assert stats["blocks_failed"] == 1 and "blocks_moqt" not in stats
        assert stats["bytes_moqt"] == 2 * 2 * B * SHAPE.kv_heads * SHAPE.head_dim * 4  # layers 0 and 1 arrived
        assert from_b["token_ids"] == off(b, p)
    finally:
        cluster.run(holder.close())


def test_a_tampered_layer_is_recomputed(cluster: LoopbackCluster, engines: tuple[EngineProcess, EngineProcess]) -> None:
    """A replica (random octets) announced under a record whose layer 2 digest is not its
    own: the consumer refuses it (the track's LAYER_DIGESTS differ from the record's, binding
    §10, before any layer is used), reports the block and vLLM recomputes it."""
    a, b = engines
    p = prompt(6, 2 * B + 10)
    compat = bytes.fromhex(kvsp(a.generate(prompt(7, 40), max_tokens=1))["compat_id"])
    key, holder = random_block(BlockStore([HostTier(1 << 20)]), cluster, compat, p)

    async def publish() -> ReplicaRecord:
        true = await attach(cluster, holder, key)
        digests = list(true.layer_digests or ())
        digests[2] = bytes(32)
        doc = true.to_json()
        doc["layer_digests"] = [d.hex() for d in digests]
        doc["digest"] = format_digest(replica_digest(digests))
        return await cluster.index.publish(ReplicaRecord.from_json(doc))

    try:
        cluster.run(publish())
        stats = kvsp(from_b := b.generate(p, max_tokens=8))
        assert stats["matched_blocks"] == 1 and stats["external_tokens"] == B
        assert stats["blocks_failed"] == 1 and "blocks_moqt" not in stats
        assert from_b["token_ids"] == off(b, p)
    finally:
        cluster.run(holder.close())


def test_with_the_relay_down_blocks_come_over_http(cluster: LoopbackCluster,
                                                   engines: tuple[EngineProcess, EngineProcess]) -> None:
    """Last (it stops the relay): the MOQT records name a dead relay, the HTTP holder's
    replicas still serve; the output is unchanged."""
    a, b = engines
    p = prompt(8, 5 * B + 3)
    assert kvsp(a.generate(p, max_tokens=2))["blocks_published"] == 5
    cluster.stop_relay()
    stats = kvsp(from_b := b.generate(p, max_tokens=8))
    assert stats["external_tokens"] == 5 * B
    assert stats["blocks_http"] == 5 and "blocks_failed" not in stats
    assert from_b["token_ids"] == off(b, p)
