"""The instance's inference engine (``control/engine*.py``) against real roles on loopback: an
Index Service, an HTTP holder, an in-process MOQT relay, and instances running the reference
model (``serve_instance`` with ``[instance.engine]``). No doubles, no sleeps.

Checked: Block Keys → lookup → load (local store, MOQT layer-wise through the relay, HTTP) →
recompute → publish (store + IS, HTTP holder, MOQT via the relay); the counters agree with the
relay's and the IS's; reused KV gives the same greedy output as recomputing everything.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvsp_moq.control.client.http import HttpIndexClient  # noqa: E402
from kvsp_moq.control.common.auth import Authorizer, Grant, Principal  # noqa: E402
from kvsp_moq.control.common.clock import MonotonicClock  # noqa: E402
from kvsp_moq.control.common.config import (  # noqa: E402
    ControlConfig, HolderConfig, IndexConfig, InstanceConfig, TierConfig)
from kvsp_moq.control.common.engine_config import EngineConfig  # noqa: E402
from kvsp_moq.control.common.tls import TlsConfig  # noqa: E402
from kvsp_moq.control.engine.engine import InferenceEngine  # noqa: E402
from kvsp_moq.control.engine.records import GenerateRequest  # noqa: E402
from kvsp_moq.control.holder.serve import serve_holder  # noqa: E402
from kvsp_moq.control.http.server import RunningServer  # noqa: E402
from kvsp_moq.control.index.serve import serve_index  # noqa: E402
from kvsp_moq.control.instance.serve import INSTANCE_SERVICE, serve_instance  # noqa: E402
from kvsp_moq.kvsp import scope  # noqa: E402
from kvsp_moq.kvsp.blockkeys import BlockKeyChain  # noqa: E402
from kvsp_moq.kvsp.records import LookupRequest  # noqa: E402
from kvsp_moq.model import ByteTokenizer, ReferenceModel, Sampler, build_descriptor, ensure_model_files, generate  # noqa: E402
from bridge_support import ca_file, start_relay  # noqa: E402

GUARD = 60.0
B = 16  # small blocks: several per prompt, a fast suite
MiB = 1 << 20
PROMPT = "System: answer briefly, cite sources, never invent facts. " * 2 + "User: what is KVSP?"
TOKEN = secrets.token_urlsafe(24)
SCOPE_KEY = secrets.token_bytes(32)
SCOPE_ID = scope.scope_id(SCOPE_KEY)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return ensure_model_files(directory=tmp_path_factory.mktemp("model")).directory


@dataclass
class Cluster:
    stack: AsyncExitStack
    model_dir: Path
    auth: Authorizer
    index: RunningServer
    holder: RunningServer
    relay: Any
    index_client: HttpIndexClient
    descriptor: dict[str, Any]

    async def instance(self, *, relay: bool = True, holder: bool = True) -> RunningServer:
        engine = EngineConfig(model_dir=str(self.model_dir), block_tokens=B, torch_threads=1,
                              relay_url=self.relay.url if relay else None,
                              holder_url=self.holder.url if holder else None,
                              scope_keys={SCOPE_ID: SCOPE_KEY}, moqt_timeout_s=10)
        ic = InstanceConfig(index_url=self.index.url, token=TOKEN, tiers=(TierConfig("host", 64 * MiB),), engine=engine)
        return await self.stack.enter_async_context(
            await serve_instance(ControlConfig(auth=self.auth, instance=ic, tls=TlsConfig(ca_file=ca_file())),
                                 report=False))


def engine_of(server: RunningServer) -> InferenceEngine:
    engine = server.app[INSTANCE_SERVICE].inference
    assert engine is not None
    return engine


@pytest.fixture
async def cluster(model_dir: Path) -> AsyncIterator[Cluster]:
    descriptor = build_descriptor(ensure_model_files(directory=model_dir), block_tokens=B)
    auth = Authorizer.from_tokens({TOKEN: Principal("all", scopes=Grant(everything=True), holders=Grant(everything=True),
                                                    instances=Grant(everything=True))})
    async with AsyncExitStack() as stack:
        clock = MonotonicClock()
        index = await stack.enter_async_context(await serve_index(
            ControlConfig(auth=auth, index=IndexConfig(descriptors=(descriptor,))), clock=clock))
        relay = await start_relay()
        stack.push_async_callback(relay.close)
        hc = HolderConfig(index_url=index.url, index_token=TOKEN, tiers=(TierConfig("host", 64 * MiB),))
        holder = await stack.enter_async_context(await serve_holder(ControlConfig(auth=auth, holder=hc), clock=clock))
        client = HttpIndexClient(index.url, TOKEN)
        stack.push_async_callback(client.close)
        yield Cluster(stack, model_dir, auth, index, holder, relay, client, descriptor)


def request(prompt: str = PROMPT, max_tokens: int = 12) -> GenerateRequest:
    return GenerateRequest(scope_id=SCOPE_ID, prompt=prompt, max_tokens=max_tokens)


def everyone() -> Principal:
    return Principal("all", scopes=Grant(everything=True), holders=Grant(everything=True), instances=Grant(everything=True))


def reference_output(model_dir: Path, prompt: str, max_tokens: int) -> list[int]:
    """Greedy output recomputing everything, with the model alone."""
    model = ReferenceModel.load(directory=model_dir)
    ids = ByteTokenizer().encode(prompt)
    return [t.token_id for t in generate(model, ids, Sampler.greedy(), max_tokens)]


async def within(aw: Any) -> Any:
    return await asyncio.wait_for(aw, GUARD)


def sources(result: Any) -> list[str]:
    return [b.source for b in result.blocks]


async def test_cold_compute_publishes_then_another_instance_reuses_over_moqt(cluster: Cluster) -> None:
    a = await cluster.instance()
    b = await cluster.instance()
    ea, eb = engine_of(a), engine_of(b)
    ids = ByteTokenizer().encode(PROMPT)
    blocks = len(ids) // B
    assert blocks >= 3

    cold = await within(ea.generate(everyone(), request()))
    assert cold.matched == 0 and sources(cold) == ["recomputed"] * blocks
    assert cold.published == ("holder", "moqt", "store") and not cold.layerwise
    assert [t.index for t in cold.tokens] == list(range(len(cold.tokens)))
    # every block now has three records: the instance (resident), the HTTP holder, the relay
    keys = BlockKeyChain(SCOPE_KEY, ea.compat_id, B).extend(ids)
    looked = await cluster.index_client.lookup(LookupRequest(scope_id=SCOPE_ID, compat_id=ea.compat_id, block_keys=tuple(keys)))
    assert looked.matched == blocks
    holders = [sorted(r.holder.split(":")[0] for r in blk.replicas) for blk in looked.blocks]
    assert holders == [["http", "http", "moqt"]] * blocks
    assert ea.counters.published_store == ea.counters.published_holder == ea.counters.published_moqt == blocks

    warm = await within(eb.generate(everyone(), request()))
    assert warm.matched == blocks
    assert sources(warm) == ["moqt"] * blocks and warm.layerwise
    # reused KV gives the same greedy output as recomputing everything
    assert [t.token for t in warm.tokens] == [t.token for t in cold.tokens]
    assert [t.token for t in cold.tokens] == reference_output(cluster.model_dir, PROMPT, 12)
    # the counters agree with the relay's: every layer of every block came through it once
    stats = cluster.relay.stats.snapshot()
    layers = ea.bundle.layers
    assert stats["objects_in"] == blocks * layers and stats["upstream_fetches"] == blocks
    assert eb.counters.moqt.blocks == blocks and eb.counters.moqt.octets == stats["bytes_in"] == stats["bytes_out"]
    assert eb.counters.hits == blocks and eb.counters.misses == 0 and eb.counters.recomputed_blocks == 0

    # B kept the blocks: the next request with the same prefix is served from its own store
    again = await within(eb.generate(everyone(), request(PROMPT + " And MOQT?")))
    assert sources(again)[:blocks] == ["local"] * blocks
    assert eb.counters.local.blocks == blocks
    assert cluster.relay.stats.snapshot()["objects_in"] == blocks * layers  # nothing new over the relay


async def test_prefetch_and_engine_loads_share_the_session_opened_at_start(cluster: Cluster) -> None:
    """The instance opens its loads' session to the relay while it starts (setup.RelayAttachment),
    and a prefetch directive's MOQT loads go over that same session (CountingRetriever.share_pool):
    no QUIC handshake on a directive's first block, and the instance's token on every load."""
    import uuid

    from kvsp_moq.kvsp.records import PrefetchBlock, PrefetchDirective
    from kvsp_moq.storage import RecordKey

    a = await cluster.instance()
    ea = engine_of(a)
    cold = await within(ea.generate(everyone(), request()))
    assert cold.published == ("holder", "moqt", "store")
    b = await cluster.instance(holder=False)
    eb = engine_of(b)
    assert eb.pool is not None
    sessions = cluster.relay.stats.snapshot()["sessions"]
    assert sessions == 4  # per instance: its holder's relay session and its loads' session
    loads = await within(eb.pool.get(cluster.relay.url))  # already open: no new session

    keys = BlockKeyChain(SCOPE_KEY, ea.compat_id, B).extend(ByteTokenizer().encode(PROMPT))
    directive = PrefetchDirective(
        directive=uuid.uuid4(), scope_id=SCOPE_ID, compat_id=ea.compat_id,
        blocks=tuple(PrefetchBlock(block_key=k, sources=(cluster.relay.url,)) for k in keys),
        deadline_ms=30_000, lease_ms=30_000)
    run = b.app[INSTANCE_SERVICE].prefetch.start(directive)
    await within(run.done.wait())
    assert run.state == "complete" and len(run.loaded) == len(keys), run.error
    assert eb.counters.prefetch_moqt.blocks == len(keys)
    assert all(RecordKey(ea.compat_id, SCOPE_ID, k) in eb.store for k in keys)
    assert cluster.relay.stats.snapshot()["sessions"] == sessions  # the directive opened none
    assert await within(eb.pool.get(cluster.relay.url)) is loads


async def test_http_when_the_instance_has_no_relay(cluster: Cluster) -> None:
    a = await cluster.instance()
    c = await cluster.instance(relay=False)
    cold = await within(engine_of(a).generate(everyone(), request()))
    warm = await within(engine_of(c).generate(everyone(), request()))
    blocks = len(cold.blocks)
    assert sources(warm) == ["http"] * blocks and not warm.layerwise
    assert all(b.holder == cluster.holder.url for b in warm.blocks)
    assert [t.token for t in warm.tokens] == [t.token for t in cold.tokens]
    ec = engine_of(c)
    assert ec.counters.http.blocks == blocks and ec.counters.http.octets == sum(b.octets for b in warm.blocks) > 0


async def test_a_dead_moqt_origin_falls_back_to_http(cluster: Cluster) -> None:
    a = await cluster.instance()
    b = await cluster.instance()
    cold = await within(engine_of(a).generate(everyone(), request()))
    blocks = len(cold.blocks)
    await engine_of(a).moqt_holder.close()  # the origin leaves the relay; its moqt:// records stay at the IS
    warm = await within(engine_of(b).generate(everyone(), request()))
    assert sources(warm) == ["http"] * blocks
    assert engine_of(b).counters.moqt_fallbacks >= 1
    assert [t.token for t in warm.tokens] == [t.token for t in cold.tokens]


async def test_a_draining_instance_takes_no_request(cluster: Cluster) -> None:
    from kvsp_moq.control.common.errors import NotActive

    a = await cluster.instance()
    service = a.app[INSTANCE_SERVICE]
    await service.set_state(everyone(), "sleeping")
    with pytest.raises(NotActive):
        await engine_of(a).generate(everyone(), request())


def test_instance_engine_section_of_the_toml(tmp_path: Path) -> None:
    from kvsp_moq.control.common.config import load_config
    from kvsp_moq.control.common.errors import ConfigError

    (tmp_path / "scope.key").write_text(SCOPE_KEY.hex() + "\n")
    (tmp_path / "short.key").write_text("00" * 16)
    base = '[instance]\nindex_url = "http://127.0.0.1:1/"\n[instance.engine]\nblock_tokens = 32\n'
    path = tmp_path / "ii.toml"
    path.write_text(base + 'model_dir = "m"\nrelay_url = "moqt://127.0.0.1:4443/moq"\nscope_key_files = ["scope.key"]\n')
    engine = load_config(path).instance.engine
    assert engine is not None and engine.block_tokens == 32 and engine.torch_threads == 1
    assert engine.model_dir == str(tmp_path / "m") and engine.scope_key(SCOPE_ID) == SCOPE_KEY
    for extra, key in (('colour = "red"\n', "instance.engine.colour"),
                       ('scope_key_files = ["short.key"]\n', "instance.engine.scope_key_files[0]"),
                       ('relay_url = "https://x/"\n', "instance.engine.relay_url")):
        path.write_text(base + extra)
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert err.value.key == key
    path.write_text('[instance]\nindex_url = "http://127.0.0.1:1/"\n')
    assert load_config(path).instance.engine is None


async def test_moqt_limits_of_the_toml_reach_the_engine_sessions(cluster: Cluster, tmp_path: Path) -> None:
    """``[instance.engine.moqt_limits]``: loaded from the TOML, given to the engine's load pool,
    its holder's relay session and the prefetch loads' pool (pubsub/limits.py ReceiveLimits);
    a bad value is a ConfigError naming the key."""
    import dataclasses

    from kvsp_moq.control.common.config import load_config
    from kvsp_moq.control.common.errors import ConfigError
    from kvsp_moq.control.engine.counters import CountingRetriever
    from kvsp_moq.pubsub import ReceiveLimits

    base = ('[instance]\nindex_url = "http://127.0.0.1:1/"\n[instance.engine]\nblock_tokens = 16\n'
            '[instance.engine.moqt_limits]\n')
    path = tmp_path / "ii.toml"
    path.write_text(base + "max_object_size = 4096\nmax_incoming_publishes = 0\n")
    loaded = load_config(path).instance.engine
    assert loaded is not None
    limits = loaded.moqt_limits
    assert limits == ReceiveLimits(max_object_size=4096, max_incoming_publishes=0)
    for extra, key in (("max_object_size = -1\n", "instance.engine.moqt_limits.max_object_size"),
                       ('max_queued_objects = "many"\n', "instance.engine.moqt_limits.max_queued_objects"),
                       ("preallocate = true\n", "instance.engine.moqt_limits.preallocate"),
                       ("max_objects = 3\n", "instance.engine.moqt_limits.max_objects")):
        path.write_text(base + extra)
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert err.value.key == key
    path.write_text('[instance]\nindex_url = "http://127.0.0.1:1/"\n[instance.engine]\nmoqt_limits = 5\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.key == "instance.engine.moqt_limits"

    engine = EngineConfig(model_dir=str(cluster.model_dir), block_tokens=B, torch_threads=1,
                          relay_url=cluster.relay.url, scope_keys={SCOPE_ID: SCOPE_KEY})
    assert engine.moqt_limits == ReceiveLimits()  # the default
    ic = InstanceConfig(index_url=cluster.index.url, token=TOKEN, tiers=(TierConfig("host", 64 * MiB),),
                        engine=dataclasses.replace(engine, moqt_limits=limits))
    a = await cluster.stack.enter_async_context(await serve_instance(
        ControlConfig(auth=cluster.auth, instance=ic, tls=TlsConfig(ca_file=ca_file())), report=False))
    ea = engine_of(a)
    assert ea.pool is not None and ea.pool.receive_limits == limits
    session = await within(ea.pool.get(cluster.relay.url))
    assert session.receive_limits == limits
    assert ea.moqt_holder is not None
    assert [s.receive_limits for s in ea.moqt_holder.relay_sessions()] == [limits]
    retriever = a.app[INSTANCE_SERVICE].prefetch.moqt_retriever
    assert isinstance(retriever, CountingRetriever) and retriever.receive_limits == limits
    from kvsp_moq.control.client.moqt import MoqtBlockRetriever

    own = MoqtBlockRetriever(receive_limits=limits)
    assert own.pool.receive_limits == limits
    await own.close()
