"""Resharding (kvsp-draft §6.9) of real model KV between real instance processes.

Three ``kvsp instance`` processes on 127.0.0.1 each hold one token range of one context's KV
cache, computed here by the reference model (a prefill of 96 tokens) and installed with
``PUT {ii}shards/{map}/{v}?tokens=a-b``. The PC (in this process) moves the map from 3 to 2
instances: only the ranges that change hands travel (``GET {peer}shards/...``), their octets
counted exactly against the plan, and afterwards each new holder serves, bit for bit, the
model's KV of its new range. A reshard whose member was killed with SIGKILL aborts and leaves
version v intact: same ranges, same bytes, nothing of v+1 visible.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvsp_moq.kvsp.compat import compat_id as derive_compat_id  # noqa: E402
from kvsp_moq.model import ByteTokenizer, ReferenceModel, build_descriptor, encode_block, ensure_model_files  # noqa: E402
from test_migration_support import B, PROMPT, Cluster, cluster  # noqa: E402

CONTEXT = 96
KV_OCTETS_PER_TOKEN = 4 * 2 * 2 * 32 * 4  # layers x (K, V) x kv_heads x head_dim x fp32
BLOCK = "application/kvsp-block"


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], bytes]:
    torch.set_num_threads(1)
    files = ensure_model_files(directory=tmp_path_factory.mktemp("model"))
    descriptor = build_descriptor(files, block_tokens=B)
    return files.directory, descriptor, derive_compat_id(descriptor)


@pytest.fixture(scope="module")
def kv(model_files: Any) -> Any:
    """``kv(a, b)``: the KVB1 container of the model's KV of context tokens [a, b)."""
    model = ReferenceModel.load(directory=model_files[0])
    ids = ByteTokenizer().encode(PROMPT * 2)[:CONTEXT]
    cache = model.prefill(ids).cache
    return lambda a, b: encode_block(cache, a, b)


def shard_map(name: str, version: int, *shards: tuple[int, int, str]) -> dict[str, Any]:
    return {"map": name, "version": version, "shards": [{"tokens": [a, b], "instance": i} for a, b, i in shards]}


async def install_v(c: Cluster, kv: Any, name: str, version: int, members: list[str]) -> dict[str, Any]:
    """Each member holds its third of the context (the prefill computed it), then the PC learns the map."""
    thirds = [(0, 32), (32, 64), (64, 96)]
    for (a, b), url in zip(thirds, members):
        put = await c.call("PUT", f"{url}shards/{name}/{version}", kv(a, b), content_type=BLOCK, params={"tokens": f"{a}-{b}"})
        assert put.status == 201, put.body
        assert put.json == {"map": name, "version": version, "tokens": [a, b], "held": [[a, b]]}
    body = shard_map(name, version, *((a, b, u) for (a, b), u in zip(thirds, members)))
    installed = await c.call("PUT", f"{c.pc.url}shard-maps/{name}", body)
    assert installed.json == {"map": name, "state": "installed", "version": version, "members": []}
    return body


async def served(c: Cluster, url: str, name: str, version: int, a: int, b: int) -> Any:
    return await c.call("GET", f"{url}shards/{name}/{version}", params={"tokens": f"{a}-{b}"})


async def test_three_to_two_moves_exactly_the_model_kv_that_changes_hands(tmp_path: Path, model_files: Any, kv: Any) -> None:
    model_dir, descriptor, compat = model_files
    async with cluster(tmp_path, model_dir, descriptor, compat) as c:
        i1, i2, i3 = [await c.start_instance(n, engine=False) for n in ("i1", "i2", "i3")]
        await install_v(c, kv, "ctx", 4, [i1, i2, i3])
        # hostile installs change nothing: another token count, another version, not a container
        short = await c.call("PUT", f"{i1}shards/ctx/4", kv(0, 16), content_type=BLOCK, params={"tokens": "0-32"})
        assert short.status == 400 and short.json["member"] == "tokens"
        other = await c.call("PUT", f"{i1}shards/ctx/3", kv(0, 32), content_type=BLOCK, params={"tokens": "0-32"})
        assert other.status == 409 and other.problem == "kvsp-stale-epoch"
        junk = await c.call("PUT", f"{i1}shards/ctx/4", b"KVB1 junk", content_type=BLOCK, params={"tokens": "0-32"})
        assert junk.status == 400 and junk.json["member"] == "body"
        assert (await c.call("PUT", f"{i1}shards/ctx/4", kv(0, 32), params={"tokens": "0-32"})).status == 415
        v5 = shard_map("ctx", 5, (0, 48, i1), (48, 96, i2))
        reply = await c.call("PUT", f"{c.pc.url}shard-maps/ctx", v5)
        assert reply.status == 200 and reply.json["state"] == "committed" and reply.json["version"] == 5, reply.body
        # the plan: i1 retains [0,32) and fetches [32,48) from i2; i2 retains [48,64), fetches
        # [64,96) from i3 and releases [32,48); i3 releases [64,96). Retained KV never travels.
        fetched = {m["instance"]: m["fetched_octets"] for m in reply.json["members"]}
        assert fetched == {i1: 16 * KV_OCTETS_PER_TOKEN, i2: 32 * KV_OCTETS_PER_TOKEN, i3: 0}
        for url, (a, b) in ((i1, (0, 48)), (i2, (48, 96))):
            got = await served(c, url, "ctx", 5, a, b)
            assert got.status == 200 and got.body == kv(a, b)  # the model's KV, bit for bit
        gone = await served(c, i3, "ctx", 5, 64, 96)
        assert gone.status == 404  # released after the commit
        assert (await served(c, i2, "ctx", 5, 32, 48)).status == 404  # i2 gave [32, 48) up
        assert (await served(c, i1, "ctx", 4, 0, 32)).status == 404  # v4 is history
        assert (await c.call("GET", f"{c.pc.url}shard-maps/ctx")).json == v5


async def test_a_killed_member_aborts_and_version_v_stays_intact(tmp_path: Path, model_files: Any, kv: Any) -> None:
    model_dir, descriptor, compat = model_files
    async with cluster(tmp_path, model_dir, descriptor, compat) as c:
        i1, i2, i3 = [await c.start_instance(n, engine=False) for n in ("i1", "i2", "i3")]
        v1 = await install_v(c, kv, "ctx", 1, [i1, i2, i3])
        c.kill(i3)
        assert await c.wait_dead(i3) == -signal.SIGKILL
        reply = await c.call("PUT", f"{c.pc.url}shard-maps/ctx", shard_map("ctx", 2, (0, 48, i1), (48, 96, i2)))
        assert reply.status == 200 and reply.json["state"] == "aborted" and reply.json["version"] == 1, reply.body
        results = {m["instance"]: m["result"] for m in reply.json["members"]}
        assert results[i3] == "refused"  # unreachable (its fetchers' plans fail on it too)
        # version 1 intact at the survivors: the same ranges, the same bytes; nothing of v2 served
        for url, (a, b) in ((i1, (0, 32)), (i2, (32, 64))):
            got = await served(c, url, "ctx", 1, a, b)
            assert got.status == 200 and got.body == kv(a, b)
            assert (await served(c, url, "ctx", 2, a, b)).status == 404
        assert (await served(c, i1, "ctx", 1, 0, 48)).status == 404  # i1 holds [0, 32) only: nothing was committed
        assert (await c.call("GET", f"{c.pc.url}shard-maps/ctx")).json == v1
