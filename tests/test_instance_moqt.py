"""Prefetch from ``moqt://`` holders (kvsp-draft §6.5, §6.7; binding v1 §5, §10): a real
MoqtHolder publishing over loopback QUIC, its record at a real IS, a real instance executing
the directive through ``control.moqt_retrieval``. No doubles, no sleeps."""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import os
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest

from kvsp_moq.bridge import MoqtHolder
from kvsp_moq.control.client.moqt import MoqtBlockRetriever, retrieve_block
from kvsp_moq.control.client.retrieval import RetrievalFailed
from kvsp_moq.control.client import retrieval
from kvsp_moq.kvsp.container import decode_container
from kvsp_moq.kvsp.records import ReplicaRecord
from kvsp_moq.storage import BlockStore, HostTier, RecordKey
from kvsp_moq.control.common.tls import TlsConfig
from kvsp_moq.transport import TransportConfig
from kvsp_moq.transport.tls import make_self_signed
from test_instance import directive, post, wait_done
from test_instance_support import COMPAT, SCOPE_A, World, bkey, container, instance_service, world

CERT = make_self_signed()
# The instances trust the MOQT holders' CA ([tls] ca_file): the default verifies (docs/security.md).
_CA = tempfile.NamedTemporaryFile(prefix="kvsp-test-ca-", suffix=".pem", delete=False)
_CA.write(CERT.ca_pem)
_CA.close()
atexit.register(os.unlink, _CA.name)
TRUST = TlsConfig(ca_file=_CA.name)
GUARD = 60.0


def key(i: int) -> RecordKey:
    return RecordKey(COMPAT, SCOPE_A, bkey(i))


@asynccontextmanager
async def moqt_holder(*blocks: int) -> AsyncIterator[MoqtHolder]:
    """A real binding-v1 holder on 127.0.0.1 serving ``container(i)`` for each ``i``."""
    store = BlockStore([HostTier(1 << 20)])
    holder = MoqtHolder(store)
    await holder.serve("127.0.0.1", 0, TransportConfig(certificate_pem=CERT.cert_pem, private_key_pem=CERT.key_pem))
    try:
        for i in blocks:
            store.put(key(i), container(i))
            holder.publish(key(i))
        yield holder
    finally:
        await asyncio.wait_for(holder.close(), GUARD)


def at(record: ReplicaRecord, holder: str) -> ReplicaRecord:
    """The same replica's record naming another ``moqt://`` endpoint."""
    return ReplicaRecord.from_json({**record.to_json(), "holder": holder})


def stored_bytes(store: BlockStore, k: RecordKey) -> bytes:
    return b"".join(bytes(part) for part in store.open_reader(k, touch=False))


async def run_directive(w: World, ii: Any, body: dict[str, Any]) -> dict[str, Any]:
    status, _, _ = await post(w, ii.url, body)
    assert status == 202
    return await asyncio.wait_for(wait_done(w, ii, body["directive"]), GUARD)


def test_the_hook_is_the_control_side_adapter() -> None:
    # bridge may not import control (tests/test_layering.py): the adapter lives in control
    assert retrieval.BRIDGE_MODULE == "kvsp_moq.control.client.moqt"
    assert retrieval._bridge_retriever() is retrieve_block


async def test_prefetch_from_a_moqt_holder_is_byte_identical_and_published() -> None:
    async with world(holders=0) as w, moqt_holder(0) as holder:
        record = holder.replica_record(key(0))
        assert record.holder.startswith("moqt://") and record.moqt_namespace is not None
        await w.publish(record)
        ii = await w.start_instance(links=(), tls=TRUST)
        done = await run_directive(w, ii, directive([(0, [record.holder])]))
        assert done == {"directive": done["directive"], "state": "complete", "loaded": [bkey(0).hex()]}
        store = instance_service(ii).store
        assert stored_bytes(store, key(0)) == container(0) == stored_bytes(holder.store, key(0))
        assert store.info(key(0)).digest == record.digest
        # §6.5: the instance publishes its new replica to the IS
        replicas = await instance_service(ii).prefetch.replicas.replicas(key(0))
        assert sorted(r.holder for r in replicas) == sorted([record.holder, ii.url])


async def test_the_adapter_returns_what_a_verified_http_retrieval_returns() -> None:
    async with moqt_holder(1) as holder:
        record = holder.replica_record(key(1))
        retrieved = await asyncio.wait_for(retrieve_block([record], config=TRUST.transport()), GUARD)
    expected = decode_container(container(1))
    assert retrieved.record == record and retrieved.attempts == ()
    assert retrieved.header == expected.header
    assert [(layer.index, bytes(layer.k), bytes(layer.v), layer.digest) for layer in retrieved.layers] == [
        (lv.index, bytes(lv.k), bytes(lv.v), lv.digest()) for lv in expected.layers()
    ]
    assert retrieved.container_sha256 == hashlib.sha256(container(1)).digest()


async def test_a_tampered_moqt_source_falls_back_to_the_next_moqt_source() -> None:
    async with world(holders=0) as w, moqt_holder(2) as bad, moqt_holder(2) as good:
        record = good.replica_record(key(2))
        # The bad holder stored the same bytes (its own replica: same layer digests), then one
        # octet of layer 1 flips in its tier: its Track Properties still announce the right
        # digests, so only the per-layer verification (binding §4.1) can catch it.
        bad_record = bad.replica_record(key(2))
        assert bad_record.layer_digests == record.layer_digests
        tier_buffer = bad.store.layer_payload(key(2), 1, touch=False).obj  # the host tier's own array
        assert isinstance(tier_buffer, np.ndarray) and tier_buffer.flags.writeable
        tier_buffer[5] ^= 0x01  # a bit flips in the holder's RAM
        await w.publish(bad_record)
        await w.publish(record)
        ii = await w.start_instance(links=(), tls=TRUST)
        only_bad = await run_directive(w, ii, directive([(2, [bad_record.holder])]))
        assert only_bad["state"] == "failed" and "rejected" in only_bad["error"] and "digest" in only_bad["error"]
        assert instance_service(ii).store.get(key(2)) is None  # nothing of the bad source was kept
        done = await run_directive(w, ii, directive([(2, [bad_record.holder, record.holder])]))
        assert done["state"] == "complete" and done["loaded"] == [bkey(2).hex()]
        assert stored_bytes(instance_service(ii).store, key(2)) == container(2)


async def test_an_absent_moqt_source_falls_back_to_an_http_source() -> None:
    async with world(holders=1) as w, moqt_holder() as empty, moqt_holder(3) as origin:
        await w.put_block(0, 3)  # the HTTP holder has it (and publishes its record)
        gone = at(origin.replica_record(key(3)), empty.url)  # a record of a holder that lost it
        await w.publish(gone)
        ii = await w.start_instance(tls=TRUST)
        only_gone = await run_directive(w, ii, directive([(3, [empty.url])]))
        assert only_gone["state"] == "failed" and "miss" in only_gone["error"]
        done = await run_directive(w, ii, directive([(3, [empty.url, w.holders[0].url])]))
        assert done["state"] == "complete" and done["loaded"] == [bkey(3).hex()]
        assert stored_bytes(instance_service(ii).store, key(3)) == container(3)


async def test_every_replica_failing_reports_each_attempt() -> None:
    async with moqt_holder() as empty, moqt_holder(4) as origin:
        record = origin.replica_record(key(4))
        retriever = MoqtBlockRetriever(TransportConfig(insecure=True))
        try:
            with pytest.raises(RetrievalFailed) as failed:
                await asyncio.wait_for(retriever([at(record, empty.url)]), GUARD)
            assert [a.outcome for a in failed.value.attempts] == ["miss"]
            assert failed.value.layers == (0, 3)
            # a reused pool: the next block comes through the same retriever
            assert (await asyncio.wait_for(retriever([at(record, empty.url), record]), GUARD)).attempts[0].outcome == "miss"
        finally:
            await retriever.close()


def lookups(w: World) -> float:
    return sum(s.value for m in w.is_service.metrics.lookups.collect() for s in m.samples if s.name.endswith("_total"))


async def test_a_directive_reads_its_records_in_one_lookup_and_lands_its_blocks() -> None:
    from kvsp_moq.control.common.config import ControlConfig, InstanceConfig, TierConfig
    from kvsp_moq.control.instance.serve import serve_instance
    from test_instance_support import AUTH, TOKENS

    async with world(holders=0) as w, moqt_holder(5, 6, 7) as holder:
        for i in (5, 6, 7):
            await w.publish(holder.replica_record(key(i)))
        retriever = MoqtBlockRetriever(TRUST.transport())  # has land(): blocks go straight to the store
        ic = InstanceConfig(index_url=w.index.url, pc_url=w.pc.url, token=TOKENS["inst"], links=(),
                            tiers=(TierConfig("host", 1 << 20),))
        ii = await w.stack.enter_async_context(await serve_instance(
            ControlConfig(auth=AUTH, instance=ic, tls=TRUST), clock=w.clock, epoch=1, report=False,
            moqt_retriever=retriever))
        w.stack.push_async_callback(retriever.close)
        before = lookups(w)
        done = await run_directive(w, ii, directive([(i, [holder.url]) for i in (5, 6, 7)]))
        assert done["state"] == "complete" and done["loaded"] == [bkey(i).hex() for i in (5, 6, 7)]
        assert lookups(w) == before + 1  # one §6.2 lookup for the three blocks' records
        store = instance_service(ii).store
        for i in (5, 6, 7):
            assert stored_bytes(store, key(i)) == container(i)
            assert sorted(r.holder for r in await instance_service(ii).prefetch.replicas.replicas(key(i))) == \
                sorted([holder.url, ii.url])  # published (§6.5)
