"""The KVSP connector on a tensor-parallel engine with LoRA adapters, in fp32, and on an fp8 KV
cache loading layer-wise with KVSP blocks of two vLLM blocks (issues 26, 27; docs/vllm.md
"Dtypes, tensor parallelism, adapters", "Block size").

vLLM's CPU build runs an fp8 KV cache only on x86 with AVX-512 or AMX: elsewhere the layer-wise
engine runs a bf16 KV cache (the fp8 layouts and scales are checked without vLLM in
tests/test_vllm_parts.py).

One real vLLM CPU engine with ``tensor_parallel_size=2`` (a worker process per rank, each bound
to its own core) and LoRA enabled, in fp32, shares blocks with itself through a loopback cluster
(tests/vllm_support.py): the operator gave tenant-a two secret salts, and vLLM's own prefix
cache keys on the salt, so the prompt computed under the first salt misses vLLM's cache under
the second and comes back through the connector (the IS lookup, MOQT through the relay, each
rank's FETCH into its own workers' paged cache). Every rank's shard is a block of its own,
under a Compatibility ID that names its heads; every adapter's blocks are under a
Compatibility ID that names the adapter.

Skipped, with the reason, where vLLM is not installed (the ``vllm`` extra).
"""

from __future__ import annotations

import importlib.util
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:  # the test process itself never imports vLLM
    pytest.skip("vLLM is not installed (pip install -e '.[vllm]', docs/vllm.md)", allow_module_level=True)

from kvsp_moq.integrations.vllm.engine_process import EngineProcess, EngineSpec  # noqa: E402
from kvsp_moq.integrations.vllm.settings import connector_extra_config, kv_transfer_config, salt_digest  # noqa: E402
from kvsp_moq.integrations.vllm.tiny_model import TinyLlama, write_tiny_llama, write_tiny_lora  # noqa: E402
from kvsp_moq.kvsp.blockkeys import block_keys  # noqa: E402
from kvsp_moq.kvsp.records import LookupRequest  # noqa: E402
from kvsp_moq.kvsp.scope import scope_id  # noqa: E402

from vllm_support import LoopbackCluster  # noqa: E402

B = 32
TP = 2
KEY = bytes(range(50, 82))
SALT_1, SALT_2 = "tenant-a-gateway-1-51c2", "tenant-a-gateway-2-0d7e"
SHAPE = TinyLlama()
ELEMENT_OCTETS = 4  # fp32


@pytest.fixture(scope="module")
def cluster() -> Iterator[LoopbackCluster]:
    c = LoopbackCluster()
    yield c
    c.close()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: {"name": name, "id": i + 1, "path": str(write_tiny_lora(root / name, SHAPE, seed=seed))}
            for i, (name, seed) in enumerate((("one", 1), ("two", 2)))}


@pytest.fixture(scope="module")
def engine(cluster: LoopbackCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), SHAPE)
    extra = connector_extra_config(
        index_url=cluster.index_url, relay_url=cluster.relay_url, holder_url=cluster.holder_url,
        index_token=cluster.token, holder_token=cluster.token, moqt_token=cluster.token,
        ca_file=str(cluster.tls.ca_file), scopes={"tenant-a": KEY},
        scope_salts={"tenant-a": [salt_digest(SALT_1), salt_digest(SALT_2)]},
        deadline_ms=20_000, moqt_timeout_ms=1_500)
    # vLLM's CPU build binds each rank's threads to a NUMA node unless told the cores: one each.
    spec = EngineSpec(str(model), block_size=B, dtype="float32", tensor_parallel_size=TP, max_loras=2,
                      kv_transfer_config=kv_transfer_config(extra), env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    logs = tmp_path_factory.mktemp("engine-logs")
    e = EngineProcess(spec, name="engine TP2", stderr=open(Path(logs) / "tp2.log", "w"))  # noqa: SIM115
    try:
        e.wait_ready(900)
        yield e
    finally:
        e.close()


def prompt(seed: int, length: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, SHAPE.vocab) for _ in range(length)]


def kvsp(answer: dict[str, Any]) -> dict[str, Any]:
    stats: dict[str, Any] = (answer.get("kv_transfer_params") or {}).get("kvsp") or {}
    return stats


def baseline(engine: EngineProcess, tokens: list[int], lora: dict[str, Any] | None = None) -> list[int]:
    """Computed from scratch: a fresh salt misses vLLM's cache and selects no scope."""
    answer = engine.generate(tokens, max_tokens=8, lora=lora, cache_salt=f"baseline-{uuid.uuid4()}")
    assert kvsp(answer) == {"shared": False, "reason": "its cache_salt selects no scope"}
    out: list[int] = answer["token_ids"]
    return out


def matched_at_is(cluster: LoopbackCluster, compat_hex: str, tokens: list[int]) -> int:
    compat = bytes.fromhex(compat_hex)
    request = LookupRequest(scope_id=scope_id(KEY), compat_id=compat, block_keys=tuple(block_keys(KEY, compat, tokens, B)))
    return int(cluster.run(cluster.index.lookup(request)).matched)


def test_each_rank_publishes_and_loads_only_its_own_shard(cluster: LoopbackCluster, engine: EngineProcess) -> None:
    p = prompt(1, 5 * B + 12)
    computed = engine.generate(p, max_tokens=8, cache_salt=SALT_1)
    stats = kvsp(computed)
    assert stats["blocks_published"] == 5 * TP  # each rank its shard of each block
    assert engine.flush()  # every rank's background publications
    ranks = stats["compat_ids"]
    assert len(set(ranks)) == TP and ranks[0] == stats["compat_id"]
    assert [matched_at_is(cluster, c, p) for c in ranks] == [5] * TP  # one replica per shard

    loaded = engine.generate(p, max_tokens=8, cache_salt=SALT_2)  # vLLM's cache misses: the salt differs
    stats = kvsp(loaded)
    assert stats["local_tokens"] == 0 and stats["external_tokens"] == 5 * B and stats["matched_blocks"] == 5
    assert stats["blocks_moqt"] == 5 * TP and "blocks_failed" not in stats and "blocks_http" not in stats
    # Each rank fetched its own heads only: half the model's KV heads' octets each.
    assert stats["bytes_moqt"] == 5 * SHAPE.layers * 2 * B * SHAPE.kv_heads * SHAPE.head_dim * ELEMENT_OCTETS
    assert loaded["token_ids"] == computed["token_ids"] == baseline(engine, p)


def test_blocks_computed_under_an_adapter_are_shared_only_under_that_adapter(
        cluster: LoopbackCluster, engine: EngineProcess, adapters: dict[str, dict[str, Any]]) -> None:
    one, two = adapters["one"], adapters["two"]
    q = prompt(2, 3 * B + 5)
    computed = engine.generate(q, max_tokens=8, cache_salt=SALT_1, lora=one)
    stats = kvsp(computed)
    assert stats["blocks_published"] == 3 * TP
    assert engine.flush()
    with_adapter = stats["compat_id"]

    # The same prompt without the adapter, or under another one: not the adapter's blocks.
    base = engine.generate(q, max_tokens=8, cache_salt=SALT_2)
    assert kvsp(base)["compat_id"] != with_adapter
    assert kvsp(base)["external_tokens"] == 0 and kvsp(base)["matched_blocks"] == 0
    other = engine.generate(q, max_tokens=8, cache_salt=SALT_2, lora=two)
    assert kvsp(other)["compat_id"] not in (with_adapter, kvsp(base)["compat_id"])
    assert kvsp(other)["external_tokens"] == 0 and kvsp(other)["matched_blocks"] == 0
    assert base["token_ids"] != computed["token_ids"]  # the adapter changes the KV (and the output)

    # Under the same adapter: loaded, and the output is the adapter's.
    loaded = engine.generate(q, max_tokens=8, cache_salt=SALT_2, lora=one)
    assert kvsp(loaded)["compat_id"] == with_adapter
    assert kvsp(loaded)["external_tokens"] == 3 * B and kvsp(loaded)["blocks_moqt"] == 3 * TP
    assert loaded["token_ids"] == computed["token_ids"] == baseline(engine, q, lora=one)
    assert base["token_ids"] == baseline(engine, q)


def cpu_runs_fp8_kv() -> bool:
    """vLLM's CPU build runs an fp8 KV cache only with AVX-512 or AMX (its worker refuses it
    otherwise: 'FP8 KV cache on CPU requires x86 with AVX-512 or AMX')."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512f" in flags or "amx_tile" in flags


FP8 = cpu_runs_fp8_kv()


@pytest.fixture(scope="module")
def layerwise_engine(cluster: LoopbackCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """bf16 weights, an fp8-e4m3 KV cache where the CPU runs one (else bf16), loads
    layer-wise, KVSP blocks of two vLLM blocks."""
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-layerwise"), SHAPE)
    extra = connector_extra_config(
        index_url=cluster.index_url, relay_url=cluster.relay_url, index_token=cluster.token,
        moqt_token=cluster.token, ca_file=str(cluster.tls.ca_file), scopes={"tenant-a": KEY},
        scope_salts={"tenant-a": [salt_digest(SALT_1), salt_digest(SALT_2)]}, deadline_ms=20_000,
        moqt_timeout_ms=1_500, async_loads=False,  # the layer-wise path: layer l placed before layer l runs
        block_tokens=2 * B)  # a KVSP block is two of vLLM's blocks
    spec = EngineSpec(str(model), block_size=B, dtype="bfloat16", kv_cache_dtype="fp8_e4m3" if FP8 else "auto",
                      kv_transfer_config=kv_transfer_config(extra))
    logs = tmp_path_factory.mktemp("layerwise-logs")
    e = EngineProcess(spec, name="engine layer-wise", stderr=open(logs / "layerwise.log", "w"))  # noqa: SIM115
    try:
        e.wait_ready(900)
        yield e
    finally:
        e.close()


def test_kv_moves_bit_exact_layer_wise_in_blocks_of_two_pages(cluster: LoopbackCluster,
                                                               layerwise_engine: EngineProcess) -> None:
    """The KV cache's elements (fp8-e4m3 under its scales, named in the descriptor as
    ``kv_scales`` and checked by the worker against the scales its layers run with; bf16 where
    the CPU runs no fp8 KV) go out and come back bit for bit: the output is the recomputed
    one. This engine loads layer-wise (``async_loads`` off): each layer placed during the
    forward pass, before it is used; each KVSP block is two of vLLM's blocks
    (``block_tokens``), read out of and written into both pages."""
    p = prompt(3, 4 * B + 9)  # 2 KVSP blocks of 2 B and 9 tokens
    computed = layerwise_engine.generate(p, max_tokens=8, cache_salt=SALT_1)
    assert kvsp(computed)["blocks_published"] == 2
    assert layerwise_engine.flush()
    loaded = layerwise_engine.generate(p, max_tokens=8, cache_salt=SALT_2)
    stats = kvsp(loaded)
    assert stats["external_tokens"] == 4 * B and stats["blocks_moqt"] == 2
    octets = 1 if FP8 else 2
    assert stats["bytes_moqt"] == 4 * SHAPE.layers * 2 * B * SHAPE.kv_heads * SHAPE.head_dim * octets
    assert loaded["token_ids"] == computed["token_ids"] == baseline(layerwise_engine, p)


def test_a_kvsp_block_partly_in_vllms_own_cache_loads_only_its_other_pages(
        cluster: LoopbackCluster, layerwise_engine: EngineProcess) -> None:
    """vLLM's own prefix cache holds the first page of a two-page KVSP block (a request under
    the same salt computed it): the connector is asked from there, loads the block and writes
    only its second page, then the next block whole; the output is the recomputed one."""
    q = prompt(4, 4 * B + 9)
    layerwise_engine.generate(q[: B + 5], max_tokens=2, cache_salt=SALT_2)  # page 0 in vLLM's cache under SALT_2
    assert kvsp(layerwise_engine.generate(q, max_tokens=2, cache_salt=SALT_1))["blocks_published"] == 2
    assert layerwise_engine.flush()
    loaded = layerwise_engine.generate(q, max_tokens=8, cache_salt=SALT_2)
    stats = kvsp(loaded)
    assert stats["local_tokens"] == B and stats["external_tokens"] == 3 * B
    assert stats["blocks_moqt"] == 2 and "blocks_failed" not in stats
    assert loaded["token_ids"] == baseline(layerwise_engine, q)
