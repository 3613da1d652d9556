"""The inference instance (kvsp-draft §6.3, §6.5): prefetch directives over HTTP against real
holders, a real IS and a real PC, plus a slow holder double; state changes and draining."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from kvsp_moq.control.common.config import InstanceConfig
from kvsp_moq.control.holder.serve import HOLDER_SERVICE
from kvsp_moq.control.instance.reporter import persisted_epoch
from kvsp_moq.kvsp.records import PrefetchDirective
from kvsp_moq.storage import RecordKey
from test_instance_support import COMPAT, SCOPE_A, SCOPE_B, World, bkey, call, container, instance_service, record_for, slow_holder, world


def directive(blocks: list[tuple[int, list[str]]], *, deadline_ms: int = 10_000, lease_ms: int = 2_000, scope: bytes = SCOPE_A) -> dict[str, Any]:
    return {
        "directive": str(uuid.uuid4()), "request_ref": "r1", "scope_id": scope.hex(), "compat_id": COMPAT.hex(),
        "blocks": [{"block_key": bkey(i).hex(), "sources": sources} for i, sources in blocks],
        "layer_order": "ascending", "deadline_ms": deadline_ms, "lease_ms": lease_ms,
    }


async def post(w: World, ii: str, body: dict[str, Any], who: str = "pc") -> tuple[int, str, Any]:
    reply = await call(w.session, "POST", f"{ii}prefetch", who=who, body=body)
    return reply.status, reply.headers.get("Location", ""), reply.json


async def wait_done(w: World, server: Any, directive_id: str) -> dict[str, Any]:
    await instance_service(server).prefetch.get(uuid.UUID(directive_id)).done.wait()
    reply = await call(w.session, "GET", f"{server.url}prefetch/{directive_id}")
    assert reply.status == 200
    return reply.json


async def test_prefetch_202_location_complete_published_and_lease_released() -> None:
    async with world() as w:
        await w.put_block(0, 0)
        await w.put_block(1, 1)
        ii = await w.start_instance()
        body = directive([(0, [w.holders[0].url]), (1, [w.holders[1].url])])
        status, location, first = await post(w, ii.url, body)
        assert status == 202  # §6.5
        assert location == f"/prefetch/{body['directive']}"
        assert first["state"] == "pending"
        done = await wait_done(w, ii, body["directive"])
        assert done == {"directive": body["directive"], "state": "complete", "loaded": [bkey(0).hex(), bkey(1).hex()]}
        svc = instance_service(ii)
        assert svc.store.get(RecordKey(COMPAT, SCOPE_A, bkey(0))) is not None
        # §6.5 "publishes its new replica": the IS lists the instance as a holder
        for i in (0, 1):
            reply = await call(w.session, "GET", f"{w.index.url}replicas/{COMPAT.hex()}/{SCOPE_A.hex()}/{bkey(i).hex()}", who="holder-svc")
            assert ii.url in [r["holder"] for r in reply.json["replicas"]]
        # the leases were released at the real holders (§6.6)
        for h in w.holders:
            assert not h.app[HOLDER_SERVICE].store.is_pinned(RecordKey(COMPAT, SCOPE_A, bkey(0)))
        # a block already held is not loaded again, and counts as loaded
        again = directive([(0, [w.holders[0].url])])
        await post(w, ii.url, again)
        assert (await wait_done(w, ii, again["directive"]))["state"] == "complete"


async def test_lease_before_retrieval_released_after_and_verification_failure_moves_on() -> None:
    async with world() as w:
        await w.put_block(0, 0)
        async with slow_holder({bkey(0): container(0)}, stalled=False, tamper=True) as bad:
            await w.publish(record_for(0, bad.url))
            ii = await w.start_instance()
            body = directive([(0, [bad.url, w.holders[0].url])], lease_ms=1234)
            await post(w, ii.url, body)
            done = await wait_done(w, ii, body["directive"])
            assert done["state"] == "complete" and done["loaded"] == [bkey(0).hex()]
            # §6.5: lease (of lease_ms) before the GET, released after it; the tampered block
            # failed verification (§6.7) and the next source was used
            assert bad.events == [f"lease {bkey(0).hex()[:8]} 1234", f"get {bkey(0).hex()[:8]}", "release lease0"]
            stored = instance_service(ii).store.get(RecordKey(COMPAT, SCOPE_A, bkey(0)))
            assert stored is not None and stored.digest == record_for(0, bad.url).digest


async def test_deadline_reports_partial_with_loaded_keys_and_releases_lease() -> None:
    async with world() as w:
        await w.put_block(0, 0)
        async with slow_holder({bkey(1): container(1)}) as slow:
            await w.publish(record_for(1, slow.url))
            ii = await w.start_instance(prefetch_blocks_in_flight=1)  # block 0 loads before block 1 stalls
            body = directive([(0, [w.holders[0].url]), (1, [slow.url])], deadline_ms=50)
            await post(w, ii.url, body)
            await slow.entered.wait()  # block 1 is stalled at the slow holder
            pending = await call(w.session, "GET", f"{ii.url}prefetch/{body['directive']}")
            assert pending.json["state"] == "pending" and pending.json["loaded"] == [bkey(0).hex()]
            w.clock.advance(50)
            done = await wait_done(w, ii, body["directive"])
            assert done["state"] == "partial" and done["loaded"] == [bkey(0).hex()]
            assert slow.events[-1] == "release lease0"


async def test_directive_blocks_are_retrieved_concurrently() -> None:
    # Both blocks of the directive are at a holder that answers no GET until released: both
    # GETs arrive before either is answered, so the executor has them in flight together.
    async with world() as w:
        async with slow_holder({bkey(1): container(1), bkey(2): container(2)}, entered_after=2) as slow:
            await w.publish(record_for(1, slow.url))
            await w.publish(record_for(2, slow.url))
            ii = await w.start_instance(prefetch_blocks_in_flight=2)
            body = directive([(1, [slow.url]), (2, [slow.url])])
            await post(w, ii.url, body)
            await asyncio.wait_for(slow.entered.wait(), 10)  # one at a time would never get here
            assert sorted(e for e in slow.events if e.startswith("get ")) == sorted([f"get {bkey(1).hex()[:8]}", f"get {bkey(2).hex()[:8]}"])
            status_url = f"{ii.url}prefetch/{body['directive']}"
            # a long poll on a stalled directive answers at its bound, still pending
            assert (await call(w.session, "GET", f"{status_url}?wait_ms=20")).json["state"] == "pending"
            assert (await call(w.session, "GET", f"{status_url}?wait_ms=60001")).status == 400
            poll = asyncio.ensure_future(call(w.session, "GET", f"{status_url}?wait_ms=60000"))
            slow.release.set()
            done = (await poll).json
            assert done["state"] == "complete" and done["loaded"] == [bkey(1).hex(), bkey(2).hex()]


async def test_prefetch_never_blocks_admitted_requests() -> None:
    async with world() as w:
        async with slow_holder({bkey(1): container(1)}) as slow:
            await w.publish(record_for(1, slow.url))
            ii = await w.start_instance()
            session = str(uuid.uuid4())
            admit = {"session": session, "scope_id": SCOPE_A.hex(), "compat_id": COMPAT.hex(), "block_keys": [bkey(1).hex()]}
            assert (await call(w.session, "POST", f"{ii.url}sessions", who="client-a", body=admit)).status == 201
            body = directive([(1, [slow.url])])
            await post(w, ii.url, body)
            await slow.entered.wait()
            # while the directive is stalled, the admitted request completes, and another runs
            assert (await call(w.session, "DELETE", f"{ii.url}sessions/{session}", who="client-a")).status == 204
            other = dict(admit, session=str(uuid.uuid4()))
            reply = await call(w.session, "POST", f"{ii.url}sessions", who="client-a", body=other)
            assert reply.status == 201 and reply.json["resident"] == 0
            assert (await call(w.session, "GET", f"{ii.url}prefetch/{body['directive']}")).json["state"] == "pending"
            slow.release.set()
            assert (await wait_done(w, ii, body["directive"]))["state"] == "complete"
            reply = await call(w.session, "POST", f"{ii.url}sessions", who="client-a", body=dict(admit, session=str(uuid.uuid4())))
            assert reply.json["resident"] == 1  # served with the loaded prefix


async def test_failed_when_nothing_can_be_loaded() -> None:
    async with world() as w:
        ii = await w.start_instance()
        body = directive([(5, [w.holders[0].url])])
        await post(w, ii.url, body)
        done = await wait_done(w, ii, body["directive"])
        assert done["state"] == "failed" and done["loaded"] == [] and "no replica record" in done["error"]


async def test_refusals_bad_json_unknown_members_cross_scope() -> None:
    async with world() as w:
        ii = await w.start_instance()
        bad = await call(w.session, "POST", f"{ii.url}prefetch", body=b"{not json")
        assert bad.status == 400 and bad.problem == "kvsp-bad-record" and bad.json["member"] == "$"
        missing = directive([(0, [w.holders[0].url])])
        del missing["lease_ms"]
        reply = await call(w.session, "POST", f"{ii.url}prefetch", body=missing)
        assert reply.status == 400 and reply.json["member"] == "lease_ms"
        # cross-scope: the PC of scope A cannot direct a load of scope B (403), nor B's PC of A
        assert (await call(w.session, "POST", f"{ii.url}prefetch", body=directive([(0, [w.holders[0].url])], scope=SCOPE_B))).problem == "kvsp-forbidden"
        assert (await call(w.session, "POST", f"{ii.url}prefetch", who="pc-b", body=directive([(0, [w.holders[0].url])]))).status == 403
        # a principal that may not act for the instance (scope alone is not enough)
        assert (await call(w.session, "POST", f"{ii.url}prefetch", who="stranger", body=directive([(0, [w.holders[0].url])]))).status == 403
        assert (await call(w.session, "POST", f"{ii.url}prefetch", who=None, body=directive([(0, [w.holders[0].url])]))).status == 401
        extra = directive([(0, [w.holders[0].url])])
        extra["future"] = {"x": 1}
        extra["blocks"][0]["hint"] = 3
        status, _, _ = await post(w, ii.url, extra)
        assert status == 202  # unknown members ignored (§4.4)
        assert (await call(w.session, "GET", f"{ii.url}prefetch/{uuid.uuid4()}")).problem == "kvsp-not-found"
        assert (await call(w.session, "PUT", f"{ii.url}state", body={"state": "failed"})).status == 400


async def test_draining_completes_in_flight_then_sleeps_and_reports() -> None:
    async with world() as w:
        ii = await w.start_instance()
        svc = instance_service(ii)
        await svc.reporter.report_now()
        session = str(uuid.uuid4())
        admit = {"session": session, "scope_id": SCOPE_A.hex(), "compat_id": COMPAT.hex(), "block_keys": []}
        assert (await call(w.session, "POST", f"{ii.url}sessions", who="client-a", body=admit)).status == 201
        reply = await call(w.session, "PUT", f"{w.pc.url}instance-state", body={"instance": ii.url, "state": "sleeping"})
        assert reply.status == 200 and reply.json == {"state": "draining"}  # in-flight session first
        assert w.pc_service.registry.state(ii.url) == "draining"
        refused = await call(w.session, "POST", f"{ii.url}sessions", who="client-a", body=dict(admit, session=str(uuid.uuid4())))
        assert refused.status == 409 and refused.problem == "kvsp-not-active"  # §6.3 MUST NOT accept
        status, _, _ = await post(w, ii.url, directive([(0, [w.holders[0].url])]))
        assert status == 409
        assert (await call(w.session, "DELETE", f"{ii.url}sessions/{session}", who="client-a")).status == 204
        assert svc.state == "sleeping"
        await svc.reporter.flush()  # "enters sleeping and reports it"
        assert w.pc_service.registry.record(ii.url).state == "sleeping"
        # only the PC wakes it
        reply = await call(w.session, "PUT", f"{w.pc.url}instance-state", body={"instance": ii.url, "state": "active"})
        assert reply.json == {"state": "active"} and svc.state == "active"
        await svc.reporter.report_now()
        assert w.pc_service.registry.state(ii.url) == "active"


async def test_sleep_request_accepted_by_pc_then_sleeping() -> None:
    async with world() as w:
        w.pc_service.policy = lambda record, active: True
        ii = await w.start_instance(sleep_after_idle_ms=1_000)
        svc = instance_service(ii)
        assert svc.status_record().requested_state is None
        w.clock.advance(1_000)
        assert svc.status_record().requested_state == "sleeping"
        answer = await svc.reporter.report_now()
        assert answer is not None and answer.state == "draining"
        assert svc.state == "sleeping"  # nothing in flight: drained at once
        await svc.reporter.flush()
        assert w.pc_service.registry.state(ii.url) == "sleeping"


async def test_reporter_interval_and_epoch(tmp_path: Any) -> None:
    assert InstanceConfig(status_ttl_ms=3_000).report_ms == 1_000
    assert InstanceConfig(status_ttl_ms=3_000, report_interval_ms=5_000).report_ms == 1_000
    assert InstanceConfig(status_ttl_ms=3_000, report_interval_ms=500).report_ms == 500
    f = tmp_path / "epoch"
    assert [persisted_epoch(f), persisted_epoch(f), persisted_epoch(f)] == [1, 2, 3]
    async with world() as w:
        ii = await w.start_instance(report=True, status_ttl_ms=3_000)
        registry = w.pc_service.registry
        # the background loop reports at start, then every ttl/3 on the manual clock
        while registry.record(ii.url) is None:
            await _yield()
        first = registry.entry(ii.url).expires_ms
        while w.clock.sleepers == 0:
            await _yield()
        w.clock.advance(1_000)
        while registry.entry(ii.url).expires_ms == first:
            await _yield()
        assert registry.entry(ii.url).expires_ms == first + 1_000


async def _yield() -> None:
    import asyncio

    await asyncio.sleep(0)


async def test_running_directives_are_capped_with_429_and_retry_after() -> None:
    # A peer (or a PC gone wrong) cannot start unbounded work: with one directive stalled at a
    # holder and max_running_directives = 1, a second is refused with 429 kvsp-overloaded and
    # Retry-After, starts nothing, and is accepted once the first has ended; a repeat of the
    # running directive's id is still the same run (not a new one).
    async with world() as w:
        async with slow_holder({bkey(1): container(1)}) as slow:
            await w.publish(record_for(1, slow.url))
            ii = await w.start_instance(max_running_directives=1)
            first = directive([(1, [slow.url])])
            assert (await post(w, ii.url, first))[0] == 202
            await slow.entered.wait()  # the first directive is running, stalled at the holder
            assert (await post(w, ii.url, first))[0] == 202  # the same directive again
            second = directive([(1, [slow.url])])
            reply = await call(w.session, "POST", f"{ii.url}prefetch", who="pc", body=second)
            assert reply.status == 429 and reply.json["type"].endswith("kvsp-overloaded")
            assert reply.headers["Retry-After"] == "1"
            assert instance_service(ii).prefetch.get(uuid.UUID(second["directive"])) is None
            assert (await call(w.session, "GET", f"{ii.url}prefetch/{second['directive']}")).status == 404
            slow.release.set()
            assert (await wait_done(w, ii, first["directive"]))["state"] == "complete"
            assert (await post(w, ii.url, second))[0] == 202
            assert (await wait_done(w, ii, second["directive"]))["state"] == "complete"
