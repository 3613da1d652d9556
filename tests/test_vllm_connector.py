"""The KVSP connector in real vLLM engines (issues 15 and 26; docs/vllm.md).

Two engine processes (``engine_process``, vLLM on CPU with the tiny local Llama in **bf16**,
the dtype production models run, block size 32, vLLM's own prefix cache on as it is by
default) share one loopback cluster: a real Index Service and HTTP holder, and the MOQT relay
as a child process (tests/vllm_support.py). Engine A computes and publishes; engine B loads.
Each engine starts once for the module (about half a minute each here) and serves every case.

Tenants are chosen by the operator: ``scope_salts`` maps each scope to the digests of the
secret ``cache_salt`` values that select it; requests without a salt are in tenant-a. The
recomputed baseline of a prompt is a request with a fresh salt no scope knows: vLLM's prefix
cache misses (the salt is in its hash) and the connector shares nothing, so every token is
computed. fp32 runs in tests/test_vllm_shards.py and the vLLM demo's test.

Skipped, with the reason, where vLLM is not installed (the ``vllm`` extra).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest

# Only the engine processes import vLLM (importing it here would configure this process).
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install -e '.[vllm]', docs/vllm.md)", allow_module_level=True)

from kvsp_moq.bridge import MoqtHolder  # noqa: E402
from kvsp_moq.control.common.tls import TlsConfig  # noqa: E402
from kvsp_moq.integrations.vllm.engine_process import EngineProcess, EngineSpec  # noqa: E402
from kvsp_moq.integrations.vllm.settings import connector_extra_config, kv_transfer_config, salt_digest  # noqa: E402
from kvsp_moq.integrations.vllm.tiny_model import TinyLlama, write_tiny_llama  # noqa: E402
from kvsp_moq.kvsp.blockkeys import block_keys  # noqa: E402
from kvsp_moq.kvsp.codecs import coded_section_bytes  # noqa: E402
from kvsp_moq.kvsp.compat import compat_id  # noqa: E402
from kvsp_moq.kvsp.container import replica_digest  # noqa: E402
from kvsp_moq.kvsp.hexids import format_digest  # noqa: E402
from kvsp_moq.kvsp.layout import Geometry, encode_raw_block  # noqa: E402
from kvsp_moq.kvsp.records import LookupRequest, ReplicaRecord  # noqa: E402
from kvsp_moq.kvsp.registries import ELEMENT_TYPES  # noqa: E402
from kvsp_moq.kvsp.scope import scope_id  # noqa: E402
from kvsp_moq.storage import BlockStore, HostTier, RecordKey  # noqa: E402

from vllm_support import ROOT, LoopbackCluster  # noqa: E402

B = 32
SCOPES = {"tenant-a": bytes(range(32)), "tenant-b": bytes(range(100, 132)), "tenant-c": bytes(range(150, 182))}
#: The operator's secret salts (the gateway sets a tenant's as the request's cache_salt).
SALT_A, SALT_B, SALT_C = "tenant-a-secret-6f1c", "tenant-b-secret-93ad", "tenant-c-secret-27e0"
SCOPE_SALTS = {"tenant-a": [salt_digest(SALT_A)], "tenant-b": [salt_digest(SALT_B)],
               "tenant-c": [salt_digest(SALT_C)]}
#: The operator's codec policy (docs/vllm.md "Codecs"): tenant-c's blocks load in fp8; a
#: request class "bulk" would load int8, but a request names its class itself, so only where
#: its scope already allows a lossy codec.
CODEC_POLICY = {"scopes": {"tenant-c": "fp8-e4m3"}, "classes": {"bulk": "int8"}}
SHAPE = TinyLlama()
DTYPE, ELEMENT = "bfloat16", ELEMENT_TYPES["bf16"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), SHAPE)


def engine_descriptor(model: Path) -> dict[str, Any]:
    """The Compatibility Descriptor the engines derive for ``model``, as ``kvsp descriptor``
    prints it for an operator (vLLM's served model name is the model path): the test below
    that publishes checks the engine's ``compat_id`` is this descriptor's."""
    proc = subprocess.run([sys.executable, "-m", "kvsp_moq", "descriptor", str(model), "--dtype", DTYPE,
                           "--block-tokens", str(B)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


@pytest.fixture(scope="module")
def cluster(model: Path) -> Iterator[LoopbackCluster]:
    c = LoopbackCluster(descriptors=[engine_descriptor(model)])  # the holder and the relay transcode
    yield c
    c.close()


def start_engines(*specs: tuple[str, EngineSpec], logs: Any) -> list[EngineProcess]:
    """Engine processes started together (their starts overlap), each ready or an error."""
    engines = [EngineProcess(spec, name=name, stderr=open(logs / f"{name.replace(' ', '-')}.log", "w"))  # noqa: SIM115
               for name, spec in specs]
    errors: list[BaseException] = []

    def ready(engine: EngineProcess) -> None:
        try:
            engine.wait_ready(900)
        except BaseException as exc:  # reported below
            errors.append(exc)

    waiters = [threading.Thread(target=ready, args=(e,)) for e in engines]
    for t in waiters:
        t.start()
    for t in waiters:
        t.join()
    if errors:
        for e in engines:
            e.close()
        raise errors[0]
    return engines


def end_child(proc: subprocess.Popen[str]) -> None:
    """End a helper process of these tests: its stdin closed (its way to exit), then killed
    if it is still there 30 s later."""
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def is_forwarder(cluster: LoopbackCluster) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A TCP forwarder process to the cluster's IS (tests/tcp_forwarder.py): engine B reaches
    the IS through it, so a test can stall B's IS (SIGSTOP) without stalling the test's."""
    url = urlsplit(cluster.index_url)
    proc = subprocess.Popen([sys.executable, "tests/tcp_forwarder.py", str(url.hostname), str(url.port)],
                            cwd=str(ROOT), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()  # its first line (the read ends if it exits)
        assert line.startswith("http://127.0.0.1:"), line
        yield proc, line.rstrip("/") + url.path
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        end_child(proc)


@pytest.fixture(scope="module")
def engines(cluster: LoopbackCluster, is_forwarder: tuple[subprocess.Popen[str], str], model: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    specs = []
    for index_url in (cluster.index_url, is_forwarder[1]):  # A directly, B through the forwarder
        extra = connector_extra_config(
            index_url=index_url, relay_url=cluster.relay_url, holder_url=cluster.holder_url,
            index_token=cluster.token, holder_token=cluster.token, moqt_token=cluster.token,
            ca_file=str(cluster.tls.ca_file), scopes=SCOPES, default_scope="tenant-a", scope_salts=SCOPE_SALTS,
            deadline_ms=20_000, moqt_timeout_ms=1_500, codec_policy=CODEC_POLICY)
        specs.append(EngineSpec(str(model), block_size=B, dtype=DTYPE, kv_transfer_config=kv_transfer_config(extra)))
    a, b = start_engines(("engine A", specs[0]), ("engine B", specs[1]), logs=tmp_path_factory.mktemp("engine-logs"))
    try:
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


def baseline(engine: EngineProcess, tokens: list[int], max_tokens: int = 8) -> list[int]:
    """``tokens`` computed from scratch: a fresh salt misses vLLM's prefix cache and selects no
    scope (the connector shares nothing, and says so)."""
    answer = engine.generate(tokens, max_tokens=max_tokens, cache_salt=f"baseline-{uuid.uuid4()}")
    assert kvsp(answer) == {"shared": False, "reason": "its cache_salt selects no scope"}
    out: list[int] = answer["token_ids"]
    return out


def block_octets(layers: int = SHAPE.layers) -> int:
    return layers * 2 * B * SHAPE.kv_heads * SHAPE.head_dim * ELEMENT.itemsize


def matched_at_is(cluster: LoopbackCluster, scope: str, compat_hex: str, tokens: list[int]) -> int:
    """How many leading blocks of ``tokens`` the IS has records for in ``scope``."""
    compat = bytes.fromhex(compat_hex)
    keys = tuple(block_keys(SCOPES[scope], compat, tokens, B))
    answer = cluster.run(cluster.index.lookup(LookupRequest(scope_id=scope_id(SCOPES[scope]), compat_id=compat,
                                                            block_keys=keys)))
    return int(answer.matched)


def test_long_prompt_loads_every_full_block_over_moqt_through_the_relay(
        cluster: LoopbackCluster, engines: tuple[EngineProcess, EngineProcess]) -> None:
    a, b = engines
    p = prompt(1, 300)  # 9 full blocks and 12 tokens
    from_a = a.generate(p, max_tokens=8)
    assert kvsp(from_a)["blocks_published"] == 9
    assert a.flush()  # A's background publications (HTTP holder, IS records) are done
    assert kvsp(from_a)["external_tokens"] == 0
    before = cluster.relay_stats()
    from_b = b.generate(p, max_tokens=8)
    after = cluster.relay_stats()
    stats = kvsp(from_b)
    assert stats["external_tokens"] == 9 * B
    assert stats["blocks_moqt"] == 9 and "blocks_failed" not in stats and "blocks_http" not in stats
    assert stats["bytes_moqt"] == 9 * block_octets()  # bf16: two octets an element, bit for bit
    # Every block through the relay: one FETCH each, every layer an object out of it.
    assert after["relay_fetches_total"] - before["relay_fetches_total"] >= 9
    assert after["relay_objects_out_total"] - before["relay_objects_out_total"] >= 9 * SHAPE.layers
    assert from_b["token_ids"] == from_a["token_ids"] == baseline(b, p)


def test_a_repeat_on_the_same_engine_is_vllms_own_prefix_hit(engines: tuple[EngineProcess, EngineProcess]) -> None:
    """vLLM's prefix cache is on (its default): a prompt engine B has seen is its own hit, the
    connector is asked only for what follows and loads nothing."""
    a, b = engines
    p = prompt(10, 4 * B + 7)
    a.generate(p, max_tokens=2)
    assert a.flush()
    first = kvsp(b.generate(p, max_tokens=2))
    assert first["external_tokens"] == 4 * B and first["local_tokens"] == 0
    again = b.generate(p, max_tokens=8)
    stats = kvsp(again)
    assert stats["local_tokens"] == 4 * B and stats["external_tokens"] == 0 and "blocks_moqt" not in stats
    assert again["token_ids"] == baseline(b, p)


def test_a_prompt_sharing_the_first_blocks_loads_only_those(engines: tuple[EngineProcess, EngineProcess]) -> None:
    a, b = engines
    p = prompt(2, 200)
    a.generate(p, max_tokens=2)
    assert a.flush()
    q = p[: 3 * B] + prompt(3, 70)  # the first 3 blocks shared, then other tokens
    stats = kvsp(from_b := b.generate(q, max_tokens=8))
    assert stats["external_tokens"] == 3 * B
    assert stats["matched_blocks"] == 3 and stats["blocks_moqt"] == 3
    assert from_b["token_ids"] == baseline(b, q)


def test_a_full_hit_leaves_the_last_block_to_compute(engines: tuple[EngineProcess, EngineProcess]) -> None:
    a, b = engines
    p = prompt(4, 4 * B)  # exactly 4 blocks: vLLM must still compute one token
    a.generate(p, max_tokens=2)
    assert a.flush()
    stats = kvsp(from_b := b.generate(p, max_tokens=8))
    assert stats["matched_blocks"] == 4 and stats["external_tokens"] == 3 * B
    assert from_b["token_ids"] == baseline(b, p)


def test_a_tenant_is_chosen_by_the_operator_never_by_the_request(
        cluster: LoopbackCluster, engines: tuple[EngineProcess, EngineProcess]) -> None:
    """Engine A publishes tenant-b's prompt (its secret salt). On engine B, a request naming
    tenant-b in its body (``kvsp_scope``, or tenant-b's *name* as its ``cache_salt``) gets no
    hit, loads nothing and publishes nothing into tenant-b; tenant-b's secret gets the hit."""
    a, b = engines
    p = prompt(5, 150)  # 4 full blocks
    published = kvsp(a.generate(p, max_tokens=2, cache_salt=SALT_B))
    assert published["scope"] == "tenant-b" and published["blocks_published"] == 4
    assert a.flush()
    compat = published["compat_id"]

    # kvsp_scope in the body selects nothing: the request stays in the default scope, tenant-a.
    q = prompt(55, 150)
    named = b.generate(p, max_tokens=2, kv_transfer_params={"kvsp_scope": "tenant-b"})
    assert kvsp(named)["scope"] == "tenant-a" and kvsp(named)["external_tokens"] == 0
    assert "blocks_moqt" not in kvsp(named) and "blocks_http" not in kvsp(named)
    b.generate(q, max_tokens=2, kv_transfer_params={"kvsp_scope": "tenant-b"})
    assert b.flush()
    assert matched_at_is(cluster, "tenant-b", compat, q) == 0  # nothing published into tenant-b
    assert matched_at_is(cluster, "tenant-a", compat, q) == 4

    # A scope's name is not its salt: shares nothing, says why, publishes nothing anywhere.
    r = prompt(56, 150)
    by_name = kvsp(b.generate(r, max_tokens=2, cache_salt="tenant-b"))
    assert by_name == {"shared": False, "reason": "its cache_salt selects no scope"}
    assert b.flush()
    assert matched_at_is(cluster, "tenant-b", compat, r) == matched_at_is(cluster, "tenant-a", compat, r) == 0

    # The tenant's secret (set by its gateway) is the only way in.
    same = b.generate(p, max_tokens=8, cache_salt=SALT_B)
    assert kvsp(same)["scope"] == "tenant-b" and kvsp(same)["external_tokens"] == 4 * B
    assert same["token_ids"] == baseline(b, p)


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
    geometry = Geometry(SHAPE.kv_heads, SHAPE.head_dim, ELEMENT)
    rnd = np.random.default_rng(0)
    # bf16 values near N(0, 1) (random bits would be mostly huge or NaN), as their bit patterns
    layers = [tuple((rnd.standard_normal((B, SHAPE.kv_heads, SHAPE.head_dim), dtype=np.float32).view(np.uint32) >> 16)
                    .astype(np.uint16) for _ in range(2)) for _ in range(SHAPE.layers)]
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
        assert stats["bytes_moqt"] == block_octets(layers=2)  # layers 0 and 1 arrived
        assert from_b["token_ids"] == baseline(b, p)
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
        assert from_b["token_ids"] == baseline(b, p)
    finally:
        cluster.run(holder.close())


@contextlib.contextmanager
def stalled_holder(cluster: LoopbackCluster, compat: bytes, tokens: list[int], tmp_path: Any) -> Iterator[Any]:
    """A real MOQT holder process serving the first block of ``tokens`` that sends layer 0 and
    half of layer 1, then nothing (no FIN, no reset: tests/fault_moqt_peer.py ``stall:1``),
    its record at the IS; yields its stdout (a line ``stalled`` once it stopped sending)."""
    import json

    from faults_support import peer_blocks

    store = BlockStore([HostTier(1 << 20)])
    key, holder = random_block(store, cluster, compat, tokens)
    blocks = tmp_path / "blocks.json"
    blocks.write_text(json.dumps({"blocks": peer_blocks(store, [key])}))
    peer = subprocess.Popen([sys.executable, "tests/fault_moqt_peer.py", "stall:1", str(cluster.tls.cert_file),
                             str(cluster.tls.key_file), str(blocks)], cwd=str(ROOT), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout is not None
        url = peer.stdout.readline().strip()  # its first line (the read ends if it exits)
        assert url.startswith("moqt://"), url
        cluster.run(cluster.index.publish(holder.replica_record(key, holder=url, ttl_ms=60_000)))
        yield peer.stdout
    finally:
        end_child(peer)


def test_a_holder_that_stalls_mid_block_costs_a_bounded_wait_and_the_block_is_recomputed(
        cluster: LoopbackCluster, engines: tuple[EngineProcess, EngineProcess], tmp_path: Any) -> None:
    """B's asynchronous load of a block from a stalled holder (``stalled_holder``) ends at the
    MOQT idle bound (``moqt_timeout_ms``), nothing of it is placed, the block is reported
    failed and recomputed: the output is right and the request did not wait for the holder."""
    a, b = engines
    p = prompt(12, 2 * B + 9)
    compat = bytes.fromhex(kvsp(a.generate(prompt(7, 40), max_tokens=1))["compat_id"])
    with stalled_holder(cluster, compat, p, tmp_path) as peer:
        answer = b.generate(p, max_tokens=8)
        assert peer.readline().startswith("stalled")  # it did send layer 0 and half of layer 1
        stats = kvsp(answer)
        assert stats["matched_blocks"] == 1 and stats["external_tokens"] == B
        assert stats["blocks_failed"] == 1 and "blocks_moqt" not in stats
        assert answer["token_ids"] == baseline(b, p)


def test_a_request_waiting_for_its_kv_never_holds_the_others(
        cluster: LoopbackCluster, engines: tuple[EngineProcess, EngineProcess], tmp_path: Any) -> None:
    """Two requests in one batch on B: one loads a block from a stalled holder, the other
    computes its prompt. The loading request waits outside the batch (vLLM's asynchronous
    loads): the other one runs to its end before the first has its first token; then the
    first's block is given up at the MOQT bound and recomputed, its output right."""
    a, b = engines
    p, other = prompt(13, 2 * B + 9), prompt(14, 2 * B + 9)
    compat = bytes.fromhex(kvsp(a.generate(prompt(7, 40), max_tokens=1))["compat_id"])
    with stalled_holder(cluster, compat, p, tmp_path):
        waiting, running = b.batch([{"prompt_token_ids": p, "max_tokens": 4},
                                    {"prompt_token_ids": other, "max_tokens": 4, "kv_transfer_params": {"kvsp": False}}])
    assert running["finished_s"] < waiting["first_token_s"]  # it never waited for the other's KV
    assert kvsp(waiting)["external_tokens"] == B and kvsp(waiting)["blocks_failed"] == 1
    assert waiting["token_ids"] == baseline(b, p, max_tokens=4)
    assert running["token_ids"] == baseline(b, other, max_tokens=4)


def test_a_stalled_index_service_never_holds_the_engine(
        engines: tuple[EngineProcess, EngineProcess], is_forwarder: tuple[subprocess.Popen[str], str]) -> None:
    """B's way to the IS stalled (the forwarder process SIGSTOPped: connections open, nothing
    answers). A request whose blocks A published waits for its lookup outside the batch, up to
    ``deadline_ms``, then computes its prompt (no hit); a request beside it in the batch runs to
    its end first. Both outputs are right; once resumed, B's lookups answer again."""
    a, b = engines
    p, other = prompt(15, 3 * B + 5), prompt(16, 2 * B + 3)
    a.generate(p, max_tokens=2)
    assert a.flush()
    forwarder = is_forwarder[0]
    os.kill(forwarder.pid, signal.SIGSTOP)
    try:
        waiting, running = b.batch([{"prompt_token_ids": p, "max_tokens": 4},
                                    {"prompt_token_ids": other, "max_tokens": 4, "kv_transfer_params": {"kvsp": False}}])
    finally:
        os.kill(forwarder.pid, signal.SIGCONT)
    assert running["finished_s"] < waiting["first_token_s"]  # the lookup never held the batch
    assert kvsp(waiting)["external_tokens"] == 0 and kvsp(waiting)["matched_blocks"] == 0  # late: no hit
    assert waiting["token_ids"] == baseline(b, p, max_tokens=4)
    assert running["token_ids"] == baseline(b, other, max_tokens=4)
    q = prompt(17, 2 * B + 3)
    a.generate(q, max_tokens=2)
    assert a.flush()
    assert kvsp(b.generate(q, max_tokens=2))["external_tokens"] == 2 * B  # the IS answers B again


def test_the_operators_codec_policy_loads_fp8_blocks_through_the_transcoding_relay(
        cluster: LoopbackCluster, model: Path, engines: tuple[EngineProcess, EngineProcess]) -> None:
    """tenant-c's policy is fp8-e4m3: engine B FETCHes the fp8-e4m3 track of A's raw
    replicas through the relay, which makes it once per replica (docs/binding.md §13); every
    layer is checked against the coded digests, decoded to bf16 and placed, and the request
    says its codec. A request of a raw scope naming a codec or a lossy class in its body
    chooses nothing: its blocks come raw, its output is the exact one."""
    a, b = engines
    p = prompt(61, 4 * B + 9)  # seeds no other test uses: their prompts share no prefix
    published = kvsp(a.generate(p, max_tokens=2, cache_salt=SALT_C))
    assert published["blocks_published"] == 4
    assert published["compat_id"] == compat_id(engine_descriptor(model)).hex()  # the transcoders know it
    assert a.flush()
    before = cluster.relay_stats()
    coded = b.generate(p, max_tokens=8, cache_salt=SALT_C)
    after = cluster.relay_stats()
    stats = kvsp(coded)
    assert stats["scope"] == "tenant-c" and stats["codec"] == "fp8-e4m3" and stats["external_tokens"] == 4 * B
    assert stats["blocks_moqt"] == stats["blocks_coded"] == 4 and "blocks_failed" not in stats
    assert stats["bytes_moqt"] == 4 * block_octets()  # decoded to bf16, the KV cache's dtype
    geometry = Geometry(SHAPE.kv_heads, SHAPE.head_dim, ELEMENT)
    on_wire = 4 * SHAPE.layers * 2 * (coded_section_bytes("fp8-e4m3", geometry, B) or 0)
    assert stats["coded_bytes_moqt"] == on_wire < stats["bytes_moqt"]
    assert after["relay_transcodes_total"] - before["relay_transcodes_total"] == 4  # once per replica
    assert len(coded["token_ids"]) == 8

    q = prompt(62, 2 * B + 3)
    assert kvsp(a.generate(q, max_tokens=2))["blocks_published"] == 2
    assert a.flush()
    raw = b.generate(q, max_tokens=8, kv_transfer_params={"kvsp_codec": "fp8-e4m3", "kvsp_class": "bulk"})
    stats = kvsp(raw)
    assert stats["scope"] == "tenant-a" and stats["blocks_moqt"] == 2 and stats["bytes_moqt"] == 2 * block_octets()
    assert "codec" not in stats and "blocks_coded" not in stats
    assert raw["token_ids"] == baseline(b, q)


def test_with_the_relay_down_blocks_come_over_http(cluster: LoopbackCluster,
                                                   engines: tuple[EngineProcess, EngineProcess]) -> None:
    """Last (it stops the relay): the MOQT records name a dead relay, the HTTP holder's
    replicas still serve; the output is unchanged."""
    a, b = engines
    p = prompt(8, 5 * B + 3)
    assert kvsp(a.generate(p, max_tokens=2))["blocks_published"] == 5
    assert a.flush()
    cluster.stop_relay()
    stats = kvsp(from_b := b.generate(p, max_tokens=8))
    assert stats["external_tokens"] == 5 * B
    assert stats["blocks_http"] == 5 and "blocks_failed" not in stats
    assert from_b["token_ids"] == baseline(b, p)
