"""The Placement Controller (kvsp-draft §6.3, §6.4, §6.5) over HTTP: status records, epochs,
expiry, the sleep handshake, placement by the §6.4 cost (hand-computed), and the hook that
starts a new instance with an immediate prefetch directive. Real IS, holders, PC, instances."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from kvsp_moq.control.common.config import PcConfig
from kvsp_moq.control.common.errors import NotActive
from kvsp_moq.control.pc.service import StartRequest, sleep_policy
from kvsp_moq.kvsp.records import InstanceStatusRecord, Link, PrefetchBlock, PrefetchDirective
from test_instance_support import COMPAT, SCOPE_A, SCOPE_B, TOKENS, World, bkey, call, instance_service, world

IX = "https://ix.example/kvsp/"
IY = "https://iy.example/kvsp/"
IZ = "https://iz.example/kvsp/"


def status(instance: str, *, epoch: int = 1, links: dict[str, tuple[float, float]] | None = None, queued: int = 0,
           prefill: float = 10_000, ttl_ms: int = 3_000, requested: str | None = None, state: str = "active") -> dict[str, Any]:
    return InstanceStatusRecord(
        instance=instance, epoch=epoch, state=state, running=0, queued=queued, batch_size=8, kv_utilization=0.1,
        prefill_tokens_per_s=prefill, decode_tokens_per_s=100,
        links=tuple(Link(holder=h, mbit_per_s=m, rtt_us=r) for h, (m, r) in (links or {}).items()),
        requested_state=requested, ttl_ms=ttl_ms,
    ).to_json()


async def report(w: World, body: dict[str, Any], who: str = "pc") -> Any:
    return await call(w.session, "PUT", f"{w.pc.url}instance-status", who=who, body=body)


def place_body(keys: list[int], tokens: int, *, prefetch: bool = True, scope: bytes = SCOPE_A) -> dict[str, Any]:
    return {"scope_id": scope.hex(), "compat_id": COMPAT.hex(), "block_keys": [bkey(i).hex() for i in keys],
            "tokens": tokens, "prefetch": prefetch, "request_ref": "req-1"}


async def test_status_epochs_and_index_feed() -> None:
    async with world() as w:
        reply = await report(w, status(IX, epoch=5))
        assert reply.status == 200 and reply.json == {"state": "active"}
        assert w.is_service.statuses.get(IX) is not None  # the PC fed the IS (§6.4 links)
        stale = await report(w, status(IX, epoch=4))
        assert stale.status == 409 and stale.problem == "kvsp-stale-epoch"  # §6.3 MUST discard
        assert w.pc_service.registry.record(IX).epoch == 5
        assert (await report(w, status(IX, epoch=5))).status == 200
        # a restart (higher epoch) forgets what the PC had assigned to the old incarnation
        await w.pc_service.registry.assign(IX, "draining")
        assert w.pc_service.registry.state(IX) == "draining"
        assert (await report(w, status(IX, epoch=6))).json == {"state": "active"}


async def test_expiry_means_failed_and_no_placement() -> None:
    async with world() as w:
        await report(w, status(IX, ttl_ms=3_000))
        w.clock.advance(2_999)
        assert w.pc_service.registry.state(IX) == "active"
        w.clock.advance(1)
        views = (await call(w.session, "GET", f"{w.pc.url}instances")).json["instances"]
        assert views == [{"instance": IX, "epoch": 1, "state": "failed", "reported": "active",
                          "running": 0, "queued": 0, "kv_utilization": 0.1}]  # the last record's load
        reply = await call(w.session, "POST", f"{w.pc.url}placements", body=place_body([0], 16))
        assert reply.status == 409 and reply.problem == "kvsp-not-active"


async def test_sleep_request_answered_by_policy_and_never_assigned_after() -> None:
    async with world() as w:
        # min-active (default, 1): the only active instance may not sleep
        reply = await report(w, status(IX, requested="sleeping"))
        assert reply.json == {"state": "active"}
        await report(w, status(IY))
        reply = await report(w, status(IX, requested="sleeping"))
        assert reply.json == {"state": "draining"}
        # the instance has not drained yet (still reports active): the PC keeps it draining
        assert (await report(w, status(IX))).json == {"state": "draining"}
        for _ in range(3):
            placed = await call(w.session, "POST", f"{w.pc.url}placements", body=place_body([0], 16, prefetch=False))
            assert placed.json["instance"] == IY
            assert [c["instance"] for c in placed.json["candidates"]] == [IY]
        directive = PrefetchDirective(directive=uuid.uuid4(), scope_id=SCOPE_A, compat_id=COMPAT,
                                      blocks=(PrefetchBlock(block_key=bkey(0), sources=(w.holders[0].url,)),), deadline_ms=5, lease_ms=5)
        with pytest.raises(NotActive):  # §6.3 MUST NOT send directives to a non-active instance
            await w.pc_service.send_prefetch(directive, IX)
    never, always = sleep_policy("never"), sleep_policy("always")
    rec = InstanceStatusRecord.from_json(status(IX, requested="sleeping"))
    assert not never(rec, [IX, IY]) and always(rec, [IX])


async def test_refusals() -> None:
    async with world() as w:
        bad = await call(w.session, "PUT", f"{w.pc.url}instance-status", body=b"[1,")
        assert bad.status == 400 and bad.json["member"] == "$"
        body = status(IX)
        body["unknown"] = {"a": 1}
        assert (await report(w, body)).status == 200  # unknown members ignored
        assert (await report(w, status(IX), who="stranger")).problem == "kvsp-forbidden"
        assert (await call(w.session, "PUT", f"{w.pc.url}instance-status", who=None, body=status(IX))).status == 401
        cross = await call(w.session, "POST", f"{w.pc.url}placements", body=place_body([0], 16, scope=SCOPE_B))
        assert cross.status == 403
        missing = await call(w.session, "PUT", f"{w.pc.url}instance-state", body={"instance": IZ, "state": "active"})
        assert missing.problem == "kvsp-not-found"


async def test_placement_picks_lowest_section_6_4_cost() -> None:
    pc = None
    async with world(holders=1) as w:
        pc = w.pc_service
        pc.service_time_us = lambda s: 1_000.0  # mean service time
        h0 = w.holders[0].url
        await w.put_block(0, 0)
        await w.put_block(0, 1)
        await report(w, status(IX, links={h0: (8, 100)}, queued=2, prefill=10_000))
        await report(w, status(IY, links={h0: (1, 0)}, queued=0, prefill=20_000))
        await report(w, status(IZ, links={}, queued=0, prefill=5_000))
        reply = await call(w.session, "POST", f"{w.pc.url}placements", body=place_body([0, 1, 2], 40, prefetch=False))
        assert reply.status == 200, reply.body
        got = {c["instance"]: c for c in reply.json["candidates"]}
        # A container is 20 + 16*4 + 4*2*32 = 340 octets; two matched blocks = 680 octets from h0.
        # IX: fetch = 100 + 8*680/8 = 780; all = 1e6*40/1e4 = 4000; unmatched = 4000 - 3200 = 800;
        #     wait = 2 * 1000; cost = 2000 + min(780 + 800, 4000) = 3580
        assert got[IX]["fetch_us"] == 780 and got[IX]["recompute_unmatched_us"] == 800 and got[IX]["cost_us"] == 3580
        # IY: fetch = 8*680/1 = 5440; all = 2000; unmatched = 400; cost = min(5840, 2000) = 2000
        assert got[IY]["fetch_us"] == 5440 and got[IY]["cost_us"] == 2000
        # IZ: no link to h0, no estimate: cost = recompute all = 1e6*40/5000 = 8000
        assert "fetch_us" not in got[IZ] and got[IZ]["cost_us"] == 8000
        assert reply.json["instance"] == IY and reply.json["cost_us"] == 2000 and reply.json["matched"] == 2
        assert "directive" not in reply.json


async def test_new_instance_hook_gets_an_immediate_directive() -> None:
    started: list[str] = []

    async def start(request: StartRequest) -> str | None:
        server = await holder_world.start_instance()  # a real instance server
        started.append(server.url)
        assert request.lookup.matched == 2
        return server.url

    holder_world: World
    async with world(start_instance=start) as w:
        holder_world = w
        await w.put_block(0, 0)
        await w.put_block(1, 1)
        reply = await call(w.session, "POST", f"{w.pc.url}placements", body=place_body([0, 1], 32))
        assert reply.status == 200, reply.body
        placed = reply.json
        assert placed["started"] is True and placed["instance"] == started[0]
        assert placed["directive_status"] == f"{started[0]}prefetch/{placed['directive']}"
        run = instance_service(w.instances[0]).prefetch.get(uuid.UUID(placed["directive"]))
        assert run.directive.request_ref == "req-1"
        await run.done.wait()
        assert run.status().state == "complete" and list(run.status().loaded) == [bkey(0), bkey(1)]


async def test_placement_sends_directive_to_running_instance_when_loading_wins() -> None:
    async with world(pc=None) as w:
        await w.put_block(0, 0)
        ii = await w.start_instance()
        await instance_service(ii).reporter.report_now()
        reply = await call(w.session, "POST", f"{w.pc.url}placements", body=place_body([0], 10_000))
        assert reply.json["instance"] == ii.url and "directive" in reply.json
        run = instance_service(ii).prefetch.get(uuid.UUID(reply.json["directive"]))
        await run.done.wait()
        assert run.status().state == "complete"
        # the same request placed again (a client retrying): the directive sent for it (§6.5 request_ref)
        same = await call(w.session, "POST", f"{w.pc.url}placements", body=place_body([0], 10_000))
        assert same.json["directive"] == reply.json["directive"] and len(instance_service(ii).prefetch.by_request_ref("req-1")) == 1
        # another request, now resident at the instance: no new directive is needed
        await instance_service(ii).reporter.report_now()
        again = await call(w.session, "POST", f"{w.pc.url}placements", body=place_body([0], 10_000) | {"request_ref": "req-2"})
        assert again.json["instance"] == ii.url and "directive" not in again.json
    assert PcConfig().sleep_policy == "min-active" and TOKENS
