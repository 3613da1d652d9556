"""``GET {base}metrics`` on every control-plane role (docs/metrics.md), over real HTTP servers
on 127.0.0.1: after real traffic (a lookup, block PUT/GET, leases, prefetch directives, a
session with its deliveries) each role's exposition is parsed with prometheus_client's parser
and its values are the traffic's; access is any principal's token (or none with
``metrics_public``); every name starts with ``kvsp_``."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvsp_moq.control.common.config import ConfigError, ControlConfig, FrontEndConfig, HolderConfig, IndexConfig, config_from_mapping
from kvsp_moq.control.frontend.serve import serve_frontend
from kvsp_moq.control.holder.serve import HOLDER_SERVICE
from kvsp_moq.control.index.serve import serve_index
from kvsp_moq.kvsp.records import SessionCheckpoint
from test_instance_support import AUTH, COMPAT, SCOPE_A, World, bkey, call, container, instance_service, world
from test_sessions_support import CountingEngine, client_request, guarded, read_stream, sampler, session_id, session_world, token_at

import pytest

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(w: World, url: str, who: str | None = "stranger") -> Samples:
    """The parsed exposition at ``{url}metrics``: (sample name, sorted labels) -> value."""
    reply = await call(w.session, "GET", f"{url}metrics", who=who)
    assert reply.status == 200, reply.body
    assert reply.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    out: Samples = {}
    for family in text_string_to_metric_families(reply.body.decode()):
        assert family.name.startswith("kvsp_"), family.name
        assert family.documentation, family.name  # every metric has HELP text
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def lease_body(keys: list[bytes], ttl_ms: int = 10_000) -> dict[str, Any]:
    return {"block_keys": [k.hex() for k in keys], "compat_id": COMPAT.hex(), "scope_id": SCOPE_A.hex(), "ttl_ms": ttl_ms}


async def test_index_lookups_matched_prefix_latency_and_records() -> None:
    async with world(holders=1) as w:
        for i in (0, 1):
            await w.put_block(0, i)  # the holder publishes each replica to the IS (§6.1)
        body = {"scope_id": SCOPE_A.hex(), "compat_id": COMPAT.hex(), "block_keys": [bkey(0).hex(), bkey(1).hex(), bkey(9).hex()]}
        reply = await call(w.session, "POST", f"{w.index.url}lookup", who="client-a", body=body)
        assert reply.status == 200 and reply.json["matched"] == 2
        m = await scrape(w, w.index.url)
        assert value(m, "kvsp_index_lookups_total") == 1
        assert value(m, "kvsp_index_lookup_matched_blocks_count") == 1
        assert value(m, "kvsp_index_lookup_matched_blocks_sum") == 2
        assert value(m, "kvsp_index_lookup_matched_blocks_bucket", le="1.0") == 0
        assert value(m, "kvsp_index_lookup_matched_blocks_bucket", le="2.0") == 1
        assert value(m, "kvsp_index_lookup_duration_seconds_count") == 1
        assert value(m, "kvsp_index_lookup_blocks_total", result="asked") == 3
        assert value(m, "kvsp_index_lookup_blocks_total", result="matched") == 2
        assert value(m, "kvsp_index_replica_records") == 2
        assert value(m, "kvsp_index_replica_puts_total", result="created") == 2
        [(labels, info)] = [(dict(labels), v) for (n, labels), v in m.items() if n == "kvsp_build_info"]
        assert labels["role"] == "index" and labels["version"] and info == 1


async def test_metrics_need_any_principals_token_unless_public() -> None:
    async with world(holders=1) as w:
        for url in (w.index.url, w.holders[0].url, w.pc.url):
            assert (await call(w.session, "GET", f"{url}metrics", who=None)).status == 401
            bad = await call(w.session, "GET", f"{url}metrics", who=None, extra={"Authorization": "Bearer " + "z" * 32})
            assert bad.status == 401
            for who in ("stranger", "client-a", "pc", "holder-svc"):  # any principal, whatever its grants
                assert (await call(w.session, "GET", f"{url}metrics", who=who)).status == 200
        public = ControlConfig(auth=AUTH, index=IndexConfig(metrics_public=True, purge_interval_ms=0))
        async with await serve_index(public) as server:
            m = await scrape(w, server.url, who=None)
            assert value(m, "kvsp_index_lookups_total") == 0
        fe = ControlConfig(auth=AUTH, frontend=FrontEndConfig(metrics_public=True))
        async with await serve_frontend(fe) as server:
            assert value(await scrape(w, server.url, who=None), "kvsp_frontend_tokens_delivered_total") == 0
    assert config_from_mapping({"holder": {"metrics_public": True}}).holder.metrics_public
    with pytest.raises(ConfigError, match="pc.metrics_public"):
        config_from_mapping({"pc": {"metrics_public": "yes"}})


async def test_holder_blocks_by_tier_and_leases_by_result() -> None:
    async with world(holders=1) as w:
        holder = w.holders[0]
        await w.put_block(0, 0)
        url = f"{holder.url}blocks/{COMPAT.hex()}/{SCOPE_A.hex()}/{bkey(0).hex()}"
        got = await call(w.session, "GET", url, who="inst")
        assert got.status == 200 and got.body == container(0)
        ranged = await call(w.session, "GET", url + "?layers=1-2", who="inst")
        assert ranged.status == 200
        granted = await call(w.session, "POST", f"{holder.url}leases", who="inst", body=lease_body([bkey(0)]))
        assert granted.status == 201
        assert (await call(w.session, "POST", f"{holder.url}leases", who="inst", body=lease_body([bkey(5)]))).status == 404
        quota = await call(w.session, "POST", f"{holder.url}leases", who="inst", body=lease_body([bkey(0)], ttl_ms=10**7))
        assert quota.status == 429 and quota.problem == "kvsp-lease-quota"
        tier = holder.app[HOLDER_SERVICE].store.tiers[0]
        m = await scrape(w, holder.url)
        labels = {"tier": tier.name, "kind": tier.kind}
        assert value(m, "kvsp_holder_served_layers_total", **labels) == 4 + 2
        assert value(m, "kvsp_holder_served_octets_total", **labels) == (4 + 2) * 2 * 32  # K and V of 32 octets
        assert value(m, "kvsp_holder_served_blocks_total", transport="http", range="all") == 1
        assert value(m, "kvsp_holder_served_blocks_total", transport="http", range="layers") == 1
        assert value(m, "kvsp_holder_stored_blocks_total", transport="http") == 1
        assert value(m, "kvsp_holder_stored_octets_total", transport="http") == len(container(0))
        assert value(m, "kvsp_holder_lease_requests_total", result="granted") == 1
        assert value(m, "kvsp_holder_lease_requests_total", result="not_found") == 1
        assert value(m, "kvsp_holder_lease_requests_total", result="quota") == 1
        assert value(m, "kvsp_holder_leases") == 1
        assert value(m, "kvsp_holder_leased_octets") == len(container(0))
        assert value(m, "kvsp_holder_replicas_pinned") == 1
        assert value(m, "kvsp_holder_tier_replicas", **labels) == 1
        assert value(m, "kvsp_holder_store_puts_total") == 1
        lease = granted.json["lease"]
        assert (await call(w.session, "DELETE", f"{holder.url}leases/{lease}", who="inst")).status == 204
        m = await scrape(w, holder.url)
        assert value(m, "kvsp_holder_lease_releases_total") == 1
        assert value(m, "kvsp_holder_leases") == 0 and value(m, "kvsp_holder_replicas_pinned") == 0


def directive(blocks: list[tuple[int, list[str]]]) -> dict[str, Any]:
    return {
        "directive": str(uuid.uuid4()), "request_ref": "r1", "scope_id": SCOPE_A.hex(), "compat_id": COMPAT.hex(),
        "blocks": [{"block_key": bkey(i).hex(), "sources": sources} for i, sources in blocks],
        "layer_order": "ascending", "deadline_ms": 10_000, "lease_ms": 2_000,
    }


async def test_instance_prefetch_outcomes_and_durations() -> None:
    async with world(holders=1) as w:
        await w.put_block(0, 0)
        ii = await w.start_instance()
        executor = instance_service(ii).prefetch
        for body in (directive([(0, [w.holders[0].url])]), directive([(7, [w.holders[0].url])])):
            reply = await call(w.session, "POST", f"{ii.url}prefetch", body=body)
            assert reply.status == 202
            run = executor.get(uuid.UUID(body["directive"]))
            assert run is not None
            await guarded(run.done.wait())
        m = await scrape(w, ii.url)
        assert value(m, "kvsp_instance_prefetch_directives_total", outcome="complete") == 1
        assert value(m, "kvsp_instance_prefetch_directives_total", outcome="failed") == 1  # block 7: no replica
        assert value(m, "kvsp_instance_prefetch_directives_total", outcome="partial") == 0
        assert value(m, "kvsp_instance_prefetch_duration_seconds_count", outcome="complete") == 1
        assert value(m, "kvsp_instance_prefetch_duration_seconds_count", outcome="failed") == 1
        assert value(m, "kvsp_instance_prefetch_running") == 0
        assert value(m, "kvsp_instance_state", state="active") == 1
        assert value(m, "kvsp_instance_state", state="sleeping") == 0
        assert value(m, "kvsp_instance_epoch") == 1
        assert not any(name.startswith("kvsp_engine_") for name, _ in m)  # no [instance.engine]
        # the holder served the directive's block and granted, then saw released, its lease
        h = await scrape(w, w.holders[0].url)
        assert value(h, "kvsp_holder_lease_requests_total", result="granted") == 1
        assert value(h, "kvsp_holder_lease_releases_total") == 1


def checkpoint(session: uuid.UUID, epoch: int, n: int) -> Mapping[str, Any]:
    return SessionCheckpoint.from_json({
        "session": str(session), "epoch": epoch, "compat_id": COMPAT.hex(), "scope_id": SCOPE_A.hex(),
        "prompt_blocks": [], "prompt_tail": [374, 264, 11], "generated": [token_at(7, i) for i in range(n)],
        "output_offset": n, "sampler": sampler(7) | {"step": n},
    }).to_json()


async def test_session_pc_instance_and_front_end() -> None:
    engine = CountingEngine("a", hang_at=5)
    async with session_world({"a": engine}, checkpoint_every=4) as sw:
        w = sw.w
        await sw.report("a")
        started = await call(sw.session, "POST", f"{sw.fe.url}sessions", who="client-a", body=client_request(10))
        assert started.status == 201, started.body
        sid = session_id(started.json)
        await guarded(engine.reached.wait())  # indices 0..4 delivered, a checkpoint at 4 acknowledged
        pc = await scrape(w, w.pc.url)
        assert value(pc, "kvsp_pc_sessions", state="serving") == 1
        assert value(pc, "kvsp_pc_sessions", state="pending") == 0
        assert value(pc, "kvsp_pc_session_epoch_max") == 1
        assert value(pc, "kvsp_pc_instances", state="active") == 1
        assert value(pc, "kvsp_pc_checkpoints_total", result="acknowledged") == 1
        assert value(pc, "kvsp_pc_leader") == 1
        ii = await scrape(w, sw.instances["a"].url)
        assert value(ii, "kvsp_instance_sessions_running") == 1
        assert value(ii, "kvsp_instance_session_epoch_max") == 1
        assert value(ii, "kvsp_instance_checkpoint_lag_tokens_max") == 1  # 5 generated, 4 acknowledged
        assert value(ii, "kvsp_instance_checkpoint_lag_tokens_sum") == 1

        stale = await call(sw.session, "PUT", f"{w.pc.url}sessions/{sid}/checkpoint", who="inst", body=checkpoint(sid, 0, 5))
        assert stale.status == 409
        tokens_url = f"{sw.fe.url}sessions/{sid}/tokens"
        dup = await call(sw.session, "POST", tokens_url, who="inst",
                         body={"session": str(sid), "epoch": 1, "tokens": [{"index": 0, "token": token_at(7, 0)}]})
        assert dup.status == 200 and dup.json["duplicates"] == 1
        other = uuid.uuid4()  # a second session, moved to epoch 2: its epoch-1 batch is stale (§6.8)
        await sw.fe_service.register(other, SCOPE_A, 10)
        other_url = f"{sw.fe.url}sessions/{other}/tokens"
        moved = await call(sw.session, "POST", other_url, who="inst",
                           body={"session": str(other), "epoch": 2, "tokens": [{"index": 0, "token": 1}]})
        assert moved.status == 200
        old = await call(sw.session, "POST", other_url, who="inst",
                         body={"session": str(other), "epoch": 1, "tokens": [{"index": 1, "token": 1}, {"index": 2, "token": 2}]})
        assert old.status == 409 and old.problem == "kvsp-stale-epoch"

        engine.unhang.set()
        lines = await guarded(read_stream(sw.session, started.json["tokens_url"]))
        assert lines[-1] == {"end": 10}
        fe = await scrape(w, sw.fe.url)
        assert value(fe, "kvsp_frontend_tokens_delivered_total") == 10 + 1
        assert value(fe, "kvsp_frontend_sessions") == 2
        assert value(fe, "kvsp_frontend_duplicates_dropped_total") == 1
        assert value(fe, "kvsp_frontend_delivery_batches_total", result="stale_epoch") == 1
        assert value(fe, "kvsp_frontend_stale_tokens_refused_total") == 2
        assert value(fe, "kvsp_frontend_sessions_opened_total", result="started") == 1
        await guarded(instance_service(sw.instances["a"]).sessions.wait(sid))  # the run ended (done sent)
        pc = await scrape(w, w.pc.url)
        assert value(pc, "kvsp_pc_checkpoints_total", result="stale_epoch") == 1
        assert value(pc, "kvsp_pc_sessions", state="serving") == 0  # done: the PC forgot it
        ii = await scrape(w, sw.instances["a"].url)
        assert value(ii, "kvsp_instance_sessions_running") == 0
