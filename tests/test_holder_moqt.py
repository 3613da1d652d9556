"""``kvsp holder`` publishing over MOQT (issue 16; binding v1 §8, §10; ``control/holder/moqt.py``):
a real holder (``serve_holder`` with ``[holder] moqt_relays``), a real relay (``relay.core.Relay``
on loopback QUIC, its certificate verified against the test CA), a real IS. Blocks PUT over HTTP
get a ``moqt://`` record naming the relay beside the HTTP one; a client fetches them through
the relay from the holder's host tier and from its disk tier; an eviction (on purpose, and to
make room) withdraws the record and the namespace (DOES_NOT_EXIST). No mocks, no sleeps."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from bridge_support import ca_file, start_relay, within
from kvsp_moq.control.client.http import HttpIndexClient
from kvsp_moq.control.client.moqt import MoqtBlockRetriever
from kvsp_moq.control.client.retrieval import RetrievalFailed
from kvsp_moq.control.common.clock import ManualClock
from kvsp_moq.control.common.config import ControlConfig, HolderConfig, IndexConfig, TierConfig
from kvsp_moq.control.holder.serve import HOLDER_SERVICE, serve_holder
from kvsp_moq.control.holder.service import HolderService
from kvsp_moq.control.http.server import RunningServer
from kvsp_moq.control.index.serve import serve_index
from kvsp_moq.control.common.tls import TlsConfig
from kvsp_moq.kvsp.records import ReplicaRecord
from kvsp_moq.storage import BlockStore, HostTier, RecordKey
from relay import Relay
from test_instance_support import AUTH, COMPAT, DESCRIPTOR, SCOPE_A, TOKENS, bkey, call, container

BLOCK = 4 * 2 * 32  # payload octets of container(i): 4 layers of K || V, 32-octet sections


@dataclass
class Cluster:
    index: RunningServer
    relay: Relay
    holder: RunningServer
    http: aiohttp.ClientSession
    index_client: HttpIndexClient

    @property
    def service(self) -> HolderService:
        return self.holder.app[HOLDER_SERVICE]

    async def put(self, i: int) -> None:
        reply = await call(self.http, "PUT", f"{self.holder.url}blocks/{COMPAT.hex()}/{SCOPE_A.hex()}/{bkey(i).hex()}",
                           who="holder-svc", body=container(i), content_type="application/kvsp-block",
                           extra={"If-None-Match": "*"})
        assert reply.status == 201, reply.body

    async def records(self, i: int) -> dict[str, ReplicaRecord]:
        return {r.holder: r for r in await self.index_client.replicas(key(i))}


def key(i: int) -> RecordKey:
    return RecordKey(COMPAT, SCOPE_A, bkey(i))


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    clock = ManualClock(10_000_000)
    async with AsyncExitStack() as stack:
        index = await stack.enter_async_context(await serve_index(
            ControlConfig(auth=AUTH, index=IndexConfig(purge_interval_ms=0, descriptors=(DESCRIPTOR,))), clock=clock))
        relay = await start_relay()
        stack.push_async_callback(lambda: within(relay.close()))
        # Room for one block in host memory, two on disk: a second PUT demotes the first to
        # disk, a fourth evicts the oldest (LRU).
        hc = HolderConfig(index_url=index.url, index_token=TOKENS["holder-svc"],
                          tiers=(TierConfig("host", BLOCK), TierConfig("disk", 2 * BLOCK, path=str(tmp_path / "disk"))),
                          moqt_relays=(relay.url,), moqt_ca_file=ca_file())
        holder = await stack.enter_async_context(await serve_holder(ControlConfig(auth=AUTH, holder=hc), clock=clock))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        index_client = HttpIndexClient(index.url, TOKENS["inst"])
        stack.push_async_callback(index_client.close)
        yield Cluster(index, relay, holder, http, index_client)


def fetched(retriever: MoqtBlockRetriever) -> Callable[[ReplicaRecord, int], Awaitable[bytes]]:
    async def land(record: ReplicaRecord, i: int) -> bytes:
        store = BlockStore([HostTier(1 << 20)])
        landed = await within(retriever.land([record], store, key(i)))
        assert landed.info is not None and landed.info.digest == record.digest
        return b"".join(bytes(part) for part in store.open_reader(key(i), touch=False))
    return land


async def test_blocks_of_the_host_and_disk_tiers_are_fetched_through_the_relay(cluster: Cluster) -> None:
    await cluster.put(0)
    await cluster.put(1)  # block 0 moves to disk
    tiers = {i: {r.tier for r in cluster.service.store.residency(key(i))} for i in (0, 1)}
    assert tiers == {0: {"disk"}, 1: {"host"}}
    retriever = MoqtBlockRetriever(TlsConfig(ca_file=ca_file()).transport())
    try:
        for i in (0, 1):
            records = await cluster.records(i)
            assert set(records) == {cluster.holder.url, cluster.relay.url}  # HTTP and moqt://
            moqt = records[cluster.relay.url]
            assert moqt.moqt_namespace is not None and moqt.layer_digests == records[cluster.holder.url].layer_digests
            assert await fetched(retriever)(moqt, i) == container(i)
    finally:
        await retriever.close()


async def test_eviction_withdraws_the_record_and_the_namespace(cluster: Cluster) -> None:
    await cluster.put(2)
    record = (await cluster.records(2))[cluster.relay.url]
    assert await cluster.service.evict(key(2))
    assert await cluster.records(2) == {}  # both records withdrawn before the eviction
    retriever = MoqtBlockRetriever(TlsConfig(ca_file=ca_file()).transport())
    try:
        with pytest.raises(RetrievalFailed) as failed:
            await fetched(retriever)(record, 2)
        assert [a.outcome for a in failed.value.attempts] == ["miss"]  # DOES_NOT_EXIST at the relay
        # An eviction to make room (LRU, the store's own): room for 3 blocks, 4 PUT: the oldest goes.
        await cluster.put(3)
        oldest = (await cluster.records(3))[cluster.relay.url]
        for i in (4, 5, 6):
            await cluster.put(i)
        assert cluster.service.store.get(key(3)) is None
        assert await cluster.records(3) == {}  # withdrawn before the PUT that evicted it answered
        with pytest.raises(RetrievalFailed) as failed:
            await fetched(retriever)(oldest, 3)
        assert [a.outcome for a in failed.value.attempts] == ["miss"]
        assert set(await cluster.records(6)) == {cluster.holder.url, cluster.relay.url}
    finally:
        await retriever.close()


def test_the_holder_moqt_keys_are_read_and_checked(tmp_path: Path) -> None:
    from kvsp_moq.control.common.config import config_from_mapping
    from kvsp_moq.control.common.errors import ConfigError

    doc = {"holder": {"moqt_relays": ["moqt://relay.example:4443/moq"], "moqt_ca_file": "ca.pem",
                      "moqt_token": "t" * 32, "moqt_timeout_ms": 2000}}
    hc = config_from_mapping(doc, base_dir=tmp_path).holder
    assert hc.moqt_relays == ("moqt://relay.example:4443/moq",) and hc.moqt_ca_file == str(tmp_path / "ca.pem")
    assert (hc.moqt_timeout_ms, hc.moqt_insecure) == (2000, None)
    # [transport] max_datagram_size reaches every MOQT client config of the process (the relays').
    tls = config_from_mapping({**doc, "transport": {"max_datagram_size": 16384}}, base_dir=tmp_path).tls
    assert tls.transport(purpose="test").max_datagram_size == 16384
    assert config_from_mapping(doc, base_dir=tmp_path).tls.transport(purpose="test").max_datagram_size == 1200
    assert HolderConfig().moqt_relays == ()  # default: HTTP only
    for bad, key_name in (({"moqt_relays": ["https://relay.example/"]}, "holder.moqt_relays"),
                          ({"moqt_timeout_ms": 0}, "holder.moqt_timeout_ms"),
                          ({"moqt_insecure": "yes"}, "holder.moqt_insecure")):
        with pytest.raises(ConfigError) as err:
            config_from_mapping({"holder": bad}, base_dir=tmp_path)
        assert err.value.key == key_name
    with pytest.raises(ConfigError) as err:
        config_from_mapping({"transport": {"max_datagram_size": 65528}}, base_dir=tmp_path)
    assert err.value.key == "transport.max_datagram_size"
    # A token over unverified MOQT to a host other than loopback is refused (docs/security.md).
    with pytest.raises(ConfigError) as err:
        config_from_mapping({"holder": {**doc["holder"], "moqt_insecure": True}}, base_dir=tmp_path)
    assert err.value.key == "holder.moqt_relays"
